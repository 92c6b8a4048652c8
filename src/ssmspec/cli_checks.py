"""What the command line (``cli.py``) refuses before Hydra starts anything, and how it says so: an unknown
config-group option, a key, type or value that does not compose (every run of a sweep is composed first), a
launcher this machine cannot use; a user error is one ``error:`` line and exit status ``EXIT_USER``."""
from __future__ import annotations

import logging
import re
import sys

from ssmspec import paths

EXIT_USER = 2
GROUPS = ("model", "strategy", "drafter", "verify", "data", "bench", "experiment")


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_USER


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (paths.CONF_DIR / group).glob("*.yaml"))


def _check_group_overrides(overrides: list[str]) -> None:
    """Unknown config-group options (experiment=foo, model=nope) fail here with the list of choices."""
    for ov in overrides:
        key, eq, value = ov.partition("=")
        key = key.lstrip("+")
        if not eq or key not in GROUPS or re.search(r"[()\[\]{}*]", value):
            continue
        for option in value.split(","):
            option = option.strip()
            if option in ("", "null") and key == "experiment":
                continue
            if not (paths.CONF_DIR / key / f"{option}.yaml").is_file():
                what = {"model": "model preset", "experiment": "experiment"}.get(key, f"{key} config")
                hint = " (`python -m ssmspec list` shows them)" if key == "experiment" else ""
                raise ValueError(f"unknown {what} {option!r}; choose one of: {', '.join(_options(key))}{hint}")


def _value(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        k, eq, v = ov.partition("=")
        if eq and k.lstrip("+") == key:
            return v
    return None


def _quote(path: str) -> str:
    return path if re.fullmatch(r"[\w./\-+:@]+", path) else "'" + path.replace("'", "\\'") + "'"


def _cfg_job(args: list[str]) -> bool:
    """``--cfg job`` (or ``-c job``) without ``--package``: ssmspec prints the config that runs."""
    return any(a in ("-c", "--cfg") and args[i + 1:i + 2] == ["job"] for i, a in enumerate(args)) and not any(
        a in ("-p", "--package") for a in args)


def _unquoted_equals(overrides: list[str]) -> tuple[str, str] | None:
    """(override, its fix) for the first override whose list value holds an element with an unquoted ``=``, such as
    ``bench.train_overrides=[distill.steps=600]``: Hydra's grammar reads that ``=`` as the start of a new key."""
    for ov in overrides:
        key, eq, value = ov.partition("=")
        value = value.strip()
        if not eq or not value.startswith("[") or not value.endswith("]"):
            continue
        if "=" not in re.sub(r"'[^']*'|\"[^\"]*\"", "", value):
            continue
        items = [i.strip() for i in value[1:-1].split(",")]
        fixed = [f'"{i}"' if "=" in i and not re.fullmatch(r"'.*'|\".*\"", i) else i for i in items]
        return ov, f"{key}=[{','.join(fixed)}]"
    return None


def _one_line(e: Exception, overrides: list[str] = ()) -> str:
    """A Hydra composition or parse error as one line naming the key and the fix."""
    first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    cause = str(e.__cause__ or "").strip().splitlines()
    if cause and "is not in struct" in cause[0]:
        return f"{first}: no such key; check its spelling (`python -m ssmspec run experiment=<id> --cfg job` " \
               f"lists every key)"
    if "no viable alternative" in first or "mismatched input" in first or "extraneous input" in first:
        bad = _unquoted_equals(list(overrides))
        if bad is not None:
            return (f"cannot parse the override {bad[0]}: a list element holding '=' must be quoted; write "
                    f"{bad[1]} (in a shell, the whole override in single quotes: '{bad[1]}')")
        return f"cannot parse an override ({first}); see https://hydra.cc/docs/advanced/override_grammar/basic"
    return f"{first}: {cause[0]}" if cause else first


def _variants(overrides: list[str]) -> list[list[str]]:
    """The runs a sweep's overrides ask for, enough to try every value once: the first value of every
    sweep, then each other value of one sweep at a time (not the whole product)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()] if ov.is_sweep_override()
               else [ov.input_line] for ov in parsed]
    base = [c[0] for c in choices]
    out = [base]
    for i, c in enumerate(choices):
        out += [base[:i] + [v] + base[i + 1:] for v in c[1:]]
    return out


def _precheck(overrides: list[str], *, multirun: bool) -> list:
    """Compose and validate every run the overrides ask for before Hydra starts any (one ``error:`` line
    for a bad key, type or value, never a half-started sweep); returns the prepared configs."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ssmspec.runner import prepare

    cfgs = []
    quiet = logging.getLogger("ssmspec")  # the job logs what prepare decides; once is enough
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        variants = _variants(overrides) if multirun else [overrides]
        with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3", job_name="precheck"):
            for ov in variants:
                cfgs.append(prepare(compose("config", overrides=ov), cli_overrides=ov)[0])
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(e, overrides)) from e
    finally:
        quiet.setLevel(level)
    return cfgs


# hydra/launcher choices of hydra-submitit-launcher -> (Python modules they import, commands they run)
_SUBMITIT = ("submitit", "hydra_plugins.hydra_submitit_launcher")
_LAUNCHER_NEEDS = {"slurm": (_SUBMITIT, ("sbatch", "srun")), "submitit_slurm": (_SUBMITIT, ("sbatch", "srun")),
                   "submitit_local": (_SUBMITIT, ())}
_LAUNCH_HERE = "here, run the sweep with hydra/launcher=gpu_queue, or without hydra/launcher (one job after another)"


def _check_launcher(overrides: list[str]) -> None:
    """A sweep through submitit on a machine without it (or, for Slurm, without Slurm) fails before Hydra
    starts, naming what is missing and the fix, instead of a traceback from inside the launcher."""
    import importlib.util
    import shutil

    choice = _value(overrides, "hydra/launcher")
    modules, commands = _LAUNCHER_NEEDS.get(choice, ((), ()))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        needs = (f"hydra-submitit-launcher ({' and '.join(missing)} {'does' if len(missing) == 1 else 'do'} not "
                 f"import here)" +
                 (" and a Slurm cluster" if commands else ""))
        install = "on the cluster, pip install -e \".[slurm]\"" if commands else "pip install -e \".[slurm]\""
        raise ValueError(f"hydra/launcher={choice} needs {needs}: {install}; {_LAUNCH_HERE}")
    absent = [c for c in commands if shutil.which(c) is None]
    if absent:
        raise ValueError(f"hydra/launcher={choice} submits the sweep to a Slurm cluster, and this machine has no "
                         f"Slurm ({' and '.join(absent)} not on PATH): run it on the cluster's login node; {_LAUNCH_HERE}")
