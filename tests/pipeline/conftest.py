"""Fixtures for the experiment-pipeline tests: run the CLI in-process on a tiny grid."""
from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _restore_logging():
    """Hydra points the root logger at the stdout of the moment; put the handlers back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def train_cache(tmp_path_factory):
    """One training cache per test session (per xdist worker): the tiny pair (conf/train/tiny.yaml, ~30 s) is trained
    by the first test that asks for it; trained_acceptance and the (acc) rows of other experiments read it
    (``bench.cache_dir=`` / ``bench.trained.cache_dir=``)."""
    return tmp_path_factory.mktemp("train-cache")


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """``cli(*argv) -> (status, stdout, stderr)`` running ``ssmspec.cli.main`` in this process, from a
    temporary working directory (so default run directories land there)."""
    from ssmspec import cli as cli_mod

    monkeypatch.chdir(tmp_path)

    def run(*argv: str):
        capsys.readouterr()
        status = cli_mod.main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run
