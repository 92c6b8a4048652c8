"""Run one experiment from a composed config: validate, resolve, measure, write the run directory.

``run_experiment(cfg, out_dir)`` is what ``python -m ssmspec run experiment=<id>`` executes inside its
Hydra job (and what tests call directly on a config composed with Hydra's compose API):

1. validate and resolve the config: the experiment exists and its functions import; profile, device,
   dtype and ``cuda_graph`` fit this machine; the model preset and sampling settings are valid; the
   experiment's ``profile_overrides[profile]`` is merged into ``bench`` (command-line ``bench.*``
   overrides still win). Any problem raises ``UserError`` before a file is written.
2. write config.yaml (fully resolved) and env.json into a temporary directory inside ``out_dir``,
   then stream the bench function's rows into results.jsonl, one JSON line per measurement, adding
   the columns experiment, run_id, profile, device, device_name and weights;
3. move the files into ``out_dir`` on success; remove the temporary directory on any failure.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ssmspec import config as C
from ssmspec.bench.env import collect_env
from ssmspec.registry import Experiment, get_experiment

log = logging.getLogger("ssmspec.run")
RESULT_FILES = ("config.yaml", "env.json", "results.jsonl")


class UserError(ValueError):
    """A problem with what the user asked for: printed as one message, exit status 2."""


# 1. validation ------------------------------------------------------------------------------------
def _parse_bench_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """Command-line overrides of ``bench.*`` keys as (key, value), to re-apply after profile merges."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        key = ov.key_or_group
        if key.startswith("bench.") and not ov.is_delete() and not ov.is_sweep_override():
            out.append((key, ov.value()))
    return out


def prepare(cfg: DictConfig, *, cli_overrides: list[str] = ()) -> tuple[DictConfig, Experiment]:
    """Validate ``cfg`` and resolve its automatic values in place; returns (cfg, experiment)."""
    try:
        return _prepare(cfg, list(cli_overrides))
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from e


def _prepare(cfg: DictConfig, cli_overrides: list[str]) -> tuple[DictConfig, Experiment]:
    block = cfg.get("experiment")
    if not block or not block.get("id"):
        raise UserError("no experiment chosen: add experiment=<id> (`python -m ssmspec list` shows the ids)")
    exp = get_experiment(block.id)
    exp.bench_fn(), exp.plot_fn()  # import errors surface now, not after the run
    if exp.needs_gpu and not C.cuda_available():
        raise UserError(f"experiment {exp.id!r} needs a CUDA GPU and this machine has none; run it on a GPU "
                        f"machine (`make reproduce` skips it on the cpu profile)")
    profile = C.resolve_profile(str(cfg.profile))
    device = C.resolve_device(str(cfg.device))
    dtype = C.resolve_dtype(str(cfg.dtype), device)
    with open_dict(cfg):
        cfg.profile, cfg.device, cfg.dtype = profile, device, C.dtype_name(dtype)
        extra = (cfg.get("profile_overrides") or {}).get(profile)
        if extra:
            cfg.bench = OmegaConf.merge(cfg.bench, extra)
        for key, value in _parse_bench_overrides(cli_overrides):
            OmegaConf.update(cfg, key, value, merge=False)
    C.use_cuda_graph(cfg.bench.get("cuda_graph", "auto"), device)
    C.model_config(cfg)
    C.sampling_config(cfg)
    OmegaConf.resolve(cfg)
    return cfg, exp


# 2.-3. the run directory -------------------------------------------------------------------------------
@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory whose files land in ``final`` only if the block succeeds.

    The temporary directory is a hidden folder inside ``final`` (created when missing), so ``final``
    itself is never renamed (it may be a mount point such as a device's $OUT). On success its files
    replace the result files of an older run there (other files are left alone); on failure it is
    removed, and so is ``final`` if this call created it.
    """
    final = Path(final).absolute()
    created = not final.exists()
    final.mkdir(parents=True, exist_ok=True)
    tmp = final / f".partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not any(final.iterdir()):
            final.rmdir()
        raise
    for name in RESULT_FILES:
        if (final / name).exists() and not (tmp / name).exists():
            (final / name).unlink()  # stale file of the older run
    for item in tmp.iterdir():
        os.replace(item, final / item.name)
    tmp.rmdir()


def _json_default(obj):
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"result value {obj!r} of type {type(obj).__name__} is not JSON serialisable")


def _clean(value):
    """NaN / inf -> None so that results.jsonl stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def run_experiment(cfg: DictConfig, out_dir: Path, *, cli_overrides: list[str] = ()) -> Path:
    """Validate ``cfg``, run its experiment and write ``out_dir``; returns ``out_dir``."""
    cfg, exp = prepare(cfg, cli_overrides=cli_overrides)
    out_dir = Path(out_dir)
    weights = str(cfg.checkpoint) if cfg.get("checkpoint") else "random"
    import torch

    threads = cfg.bench.get("cpu_threads")
    if cfg.device == "cpu" and threads:
        torch.set_num_threads(int(threads))
    env = collect_env(device=cfg.device, weights=weights)
    # which GPU(s) a launcher gave this process (None: not set, every GPU visible)
    env["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    run_id = f"{env['time'].replace(':', '').replace('+0000', 'Z')}-{uuid.uuid4().hex[:6]}"
    added = {"experiment": exp.id, "run_id": run_id, "profile": cfg.profile, "device": env["device"],
             "device_name": env["device_name"]}
    bench = exp.bench_fn()
    log.info("experiment %s (profile %s, %s, %s weights) -> %s", exp.id, cfg.profile, env["device_name"], weights,
             out_dir)
    n = 0
    try:
        with staged_dir(out_dir) as tmp:
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            (tmp / "env.json").write_text(json.dumps(env, indent=2) + "\n")
            # benchmarks never need gradients: a stray autograd graph would hold every activation
            with (tmp / "results.jsonl").open("w") as f, torch.no_grad():
                for row in bench(cfg):
                    row = {**added, **{k: _clean(v) for k, v in dict(row).items()}}
                    row.setdefault("weights", weights)
                    f.write(json.dumps(row, default=_json_default) + "\n")
                    f.flush()
                    n += 1
            if n == 0:
                raise UserError(f"experiment {exp.id!r} produced no rows with these settings; check its bench grid")
    except UserError:
        raise
    except ValueError as e:  # the bench refused a setting (e.g. a prompt longer than the cache)
        raise UserError(str(e)) from e
    log.info("wrote %d rows to %s", n, out_dir)
    return out_dir
