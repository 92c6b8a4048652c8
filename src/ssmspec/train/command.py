"""``python -m ssmspec train [NAME] [--retrain] [key=value ...]``: compose conf/train/<NAME>.yaml (default tiny)
with Hydra overrides, train (or read from the cache) and print where the checkpoints are.

A user error (unknown run name or key, a corpus too small, a vocabulary below the byte alphabet, a model larger
than memory, a corrupt cache entry) is one ``error:`` line naming the fix, exit status 2; an interrupted run
leaves no cache entry (``cache.py``).
"""
from __future__ import annotations

import argparse
import sys

from ssmspec import paths
from ssmspec.cli_checks import _error


def run_names() -> list[str]:
    return sorted(p.stem for p in (paths.CONF_DIR / "train").glob("*.yaml"))


def compose_train(name: str, overrides: list[str]) -> dict:
    """conf/train/<name>.yaml with ``overrides`` applied, resolved to plain Python."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if name not in run_names():
        raise ValueError(f"unknown training run {name!r}; choose one of: {', '.join(run_names())} (conf/train/)")
    # inside a running Hydra app (an experiment's bench trains its pair) Hydra is already initialised: set the
    # app's state aside, compose on a clean one, and put the app's back
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(paths.CONF_DIR / "train"), version_base="1.3"):
            cfg = compose(name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).splitlines()[0]
        raise ValueError(f"{msg}; overrides are key=value with keys of conf/train/{name}.yaml (a new key: +key=value)")
    finally:
        restore_gh_from_backup(backup)
    return OmegaConf.to_container(cfg, resolve=True)


def shadowed_distill(cfg: dict, overrides: list[str]) -> list[str]:
    """Notes for ``distill.<field>=...`` overrides that a family's own loop (``models.<family>.distill``, which
    ``train/run.py:family_loop`` lays over the run's) keeps from reaching that family's draft."""
    notes = []
    for o in overrides:
        key, _, value = str(o).lstrip("+").partition("=")
        if not key.startswith("distill.") or not value:
            continue
        field = key.split(".", 1)[1]
        for fam, pair in sorted((cfg.get("models") or {}).items()):
            own = (pair or {}).get("distill") or {}
            if field in own:
                notes.append(f"{key}={value} does not reach the {fam} draft: models.{fam}.distill.{field}="
                             f"{own[field]} is its own loop's; set models.{fam}.distill.{field} to change it")
    return notes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ssmspec train", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default="tiny", help=f"a run of conf/train/ ({', '.join(run_names())})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100 seed=1")
    parser.add_argument("--retrain", action="store_true", help="train again even when the cache holds the run "
                        "(replaces a corrupt entry)")
    args = parser.parse_args(argv)
    if "=" in args.name:  # no run name given: the first override took its place
        args.overrides.insert(0, args.name)
        args.name = "tiny"
    from ssmspec.train.run import describe, train_pairs

    try:
        cfg = compose_train(args.name, args.overrides)
        for note in shadowed_distill(cfg, args.overrides):
            print(f"note: {note}", file=sys.stderr)
        result = train_pairs(cfg, retrain=args.retrain)
    except ValueError as e:
        return _error(str(e).replace("\n", " "))
    print(describe(result))
    return 0
