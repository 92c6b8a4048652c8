"""``python -m ssmspec ...``: see ssmspec/cli.py."""
import sys

from ssmspec.cli import main

sys.exit(main())
