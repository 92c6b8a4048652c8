"""Run one experiment from a composed config: validate, resolve, measure, write the run directory.

``run_experiment(cfg, out_dir)`` is what ``python -m ssmspec run experiment=<id>`` executes inside its
Hydra job (and what tests call directly on a config composed with Hydra's compose API):

1. validate and resolve the config: the experiment exists and its functions import; every command-line
   override is one the experiment honours (``check_overrides``: declared bench keys with the declared
   types, settings listed in ``experiment.reads``, no ``+key`` that no config has); profile, device (a
   ``cuda:N`` this machine has; it is the current device while the run lasts: ``on_device``), dtype
   and ``cuda_graph`` fit this machine; the experiment's ``profile_overrides[profile]`` is merged into
   ``bench`` (command-line ``bench.*`` overrides still win; ``model=<preset>`` replaces ``bench.presets``);
   every number of the model, sampling, data and bench settings is in range (``config.check_values``).
   Any problem raises ``UserError`` before a file is written.
2. lock ``out_dir`` for the whole run (a second run into it is refused, naming this one), remove the
   staging folders that killed runs left there, write config.yaml (fully resolved) and env.json into a
   staging folder inside ``out_dir`` that records its owner (ssmspec/rundir.py), then stream the bench
   function's rows into results.jsonl, one JSON line per measurement, adding the columns experiment,
   run_id, profile, device, device_name and weights; env.json then records the row count and the sha256 of
   results.jsonl, and the seconds the rows took (``wall_s``; and, from the start, the source hash of
   ``provenance``);
3. move the files into ``out_dir`` on success, all of them or (on a signal meanwhile) after all of them;
   remove the staging folder on any failure, a signal included (ssmspec/interrupt.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ssmspec import config as C
from ssmspec import interrupt, rundir
from ssmspec.bench import trained_rows
from ssmspec.bench.env import collect_env
from ssmspec.registry import Experiment, get_experiment

log = logging.getLogger("ssmspec.run")
RESULT_FILES = ("config.yaml", "env.json", "results.jsonl")


class UserError(ValueError):
    """A problem with what the user asked for: printed as one message, exit status 2."""


# 1. validation ------------------------------------------------------------------------------------
# top-level settings every experiment honours (the runner reads them itself)
ALWAYS = ("experiment", "profile", "device", "dtype", "results_dir", "profile_overrides", "hydra")
GROUP_KEYS = ("model", "strategy", "drafter", "verify", "data", "bench", "experiment")


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(overrides))


def _parse_bench_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """Command-line overrides of ``bench.*`` keys as (key, value), to re-apply after profile merges."""
    out = []
    for ov in _parse(overrides):
        key = ov.key_or_group
        if key.startswith("bench.") and not ov.is_delete() and not ov.is_sweep_override():
            out.append((key, ov.value()))
    return out


def _reads(exp: Experiment, key: str) -> bool:
    """Whether ``exp`` reads the setting ``key`` (a group selection such as ``data`` needs the whole group)."""
    return exp.reads is None or any(key == r or key.startswith(r + ".") for r in exp.reads)


def _check_bench_key(exp: Experiment, key: str, value, *, typed: bool) -> None:
    node = exp.bench_schema
    parts = key.split(".")[1:]
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            here = ".".join(["bench", *parts[:i]])
            known = ", ".join(sorted(node)) if isinstance(node, dict) else "none (not a mapping)"
            raise UserError(f"experiment {exp.id!r} has no setting {key}; keys of {here}: {known} (an experiment "
                            f"declares its bench keys in conf/experiment/{exp.id}.yaml, see experiments/README.md)")
        node = node[part]
    if typed:
        _check_type(key, node, value)


def _check_type(key: str, declared, value) -> None:
    """``value`` has the type the experiment file declares for ``key`` (numbers, booleans, mappings and the
    elements of number lists are checked; a string or null declaration accepts anything)."""
    def kind(v):
        return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "number" if isinstance(
            v, float) else "list" if isinstance(v, list) else "mapping" if isinstance(v, dict) else "str"

    if value is None or declared is None or isinstance(declared, str):
        return
    want, got = kind(declared), kind(value)
    if want == "number" and got == "int":
        return
    if want != got:
        raise UserError(f"{key} must be {'an' if want[0] in 'ai' else 'a'} {want} like {declared!r}, got {value!r}")
    if want == "list" and declared and all(kind(d) in ("int", "number") for d in declared):
        elem = "number" if any(kind(d) == "number" for d in declared) else "int"
        bad = [v for v in value if not (kind(v) == elem or (elem == "number" and kind(v) == "int"))]
        if bad:
            raise UserError(f"{key} must be a list of {elem}s like {declared!r}, got {value!r}")


def check_overrides(exp: Experiment, overrides: list[str]) -> None:
    """Refuse, with the fix, an override the run would not honour: a key the experiment does not declare
    (``bench.*``), a setting its bench does not read (``experiment.reads``), a key added with ``+`` that no
    config has, or a value of the wrong type."""
    from ssmspec.models.config import ModelConfig
    from ssmspec.verify.distributions import SamplingConfig

    schema_fields = {"model": ModelConfig, "sampling": SamplingConfig}
    for ov in _parse(overrides):
        key = ov.key_or_group
        root = key.split(".")[0]
        if root in ALWAYS:
            continue
        group_choice = root in GROUP_KEYS and "." not in key
        if root == "bench":
            if not group_choice:
                typed = not (ov.is_delete() or ov.is_sweep_override())
                _check_bench_key(exp, key, ov.value() if typed else None, typed=typed)
            continue
        if (ov.is_add() or ov.is_force_add()) and root in schema_fields:
            fields = ", ".join(f.name for f in dataclasses.fields(schema_fields[root]))
            raise UserError(f"{root} has no field {key.partition('.')[2]!r}; its fields: {fields}")
        if ov.is_add() or ov.is_force_add():
            raise UserError(f"{ov.input_line}: {key!r} is not a setting of any config (a misspelt name?); "
                            f"`python -m ssmspec run experiment={exp.id} --cfg job` lists them")
        if root == "model" and "presets" in exp.bench_schema:
            if not group_choice:
                raise UserError(f"{key} changes nothing in experiment {exp.id!r}: it builds every preset of "
                                f"bench.presets from conf/model/<preset>.yaml; add a preset file with the change, "
                                f"or pass a checkpoint=")
            continue  # model=<preset> becomes bench.presets=[<preset>] (prepare)
        if not _reads(exp, key):
            what = f"{root}=" if group_choice else key
            reads = ", ".join(exp.reads or ()) or "only its bench.* keys"
            raise UserError(f"experiment {exp.id!r} does not read {what} (it reads {reads}); drop {ov.input_line}")


def _model_choice(exp: Experiment, overrides: list[str]) -> str | None:
    """``model=<preset>`` typed for an experiment that sweeps ``bench.presets``: that preset alone wins
    (the README's ``model=tiny-hybrid``); typed together with ``bench.presets`` it is refused."""
    if "presets" not in exp.bench_schema:
        return None
    parsed = list(_parse(overrides))
    choice = next((ov for ov in parsed if ov.key_or_group == "model" and not ov.is_delete()), None)
    if choice is None:
        return None
    if any(ov.key_or_group == "bench.presets" for ov in parsed):
        raise UserError(f"{choice.input_line} and bench.presets=... both choose the models of {exp.id!r}; keep one "
                        f"(model=<preset> runs that preset alone)")
    return None if choice.is_sweep_override() else str(choice.value())


def _nested_presets(node, prefix: str = "bench") -> list[str]:
    """Keys ``bench.<...>.presets`` below the top level: parts of an experiment that run on a subset of its
    presets (``model=<preset>`` runs that preset alone in them too)."""
    out = []
    for key, value in node.items():
        if isinstance(value, DictConfig):
            out += _nested_presets(value, f"{prefix}.{key}")
            if "presets" in value:
                out.append(f"{prefix}.{key}.presets")
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
    check_overrides(exp, cli_overrides)
    from ssmspec.ops.dispatch import interpret_mode

    refusal = exp.gpu_refusal(cuda=C.cuda_available(), interpreting=interpret_mode())
    if refusal:
        raise UserError(refusal)
    profile = C.resolve_profile(str(cfg.profile))
    device = _gpu_that_exists(C.resolve_device(str(cfg.device)))
    dtype = C.resolve_dtype(str(cfg.dtype), device)
    with open_dict(cfg):
        cfg.profile, cfg.device, cfg.dtype = profile, device, C.dtype_name(dtype)
        extra = (cfg.get("profile_overrides") or {}).get(profile)
        if extra:
            cfg.bench = OmegaConf.merge(cfg.bench, extra)
        for key, value in _parse_bench_overrides(cli_overrides):
            OmegaConf.update(cfg, key, value, merge=False)
        preset = _model_choice(exp, cli_overrides)
        if preset:
            log.info("model=%s: experiment %s runs that preset alone (bench.presets=[%s])", preset, exp.id, preset)
            cfg.bench.presets = [preset]
            typed = {key for key, _ in _parse_bench_overrides(cli_overrides)}
            for key in _nested_presets(cfg.bench):  # e.g. lossless' bench.sampling.presets: that preset too
                if key not in typed:
                    OmegaConf.update(cfg, key, [preset], merge=False)
    C.use_cuda_graph(cfg.bench.get("cuda_graph", "auto"), device)
    C.check_values(cfg)
    OmegaConf.resolve(cfg)
    return cfg, exp


def _gpu_that_exists(device: str) -> str:
    """``cuda:N`` only where this machine has GPU N (its visible devices); ``device`` unchanged otherwise."""
    if not device.startswith("cuda"):
        return device
    import torch

    try:
        index = torch.device(device).index
    except RuntimeError:
        raise UserError(f"device must be cpu, cuda[:index] or auto, got {device!r}") from None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise UserError(f"device={device} does not exist: this machine has {count} visible CUDA device"
                        f"{'s' if count != 1 else ''} (cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''}); "
                        f"name one of them, or device=cuda")
    return device


@contextmanager
def on_device(device: str) -> Iterator[None]:
    """The run's GPU as the current CUDA device while it runs (no-op for ``cpu`` and a bare ``cuda``).

    Triton launches its kernels on the current device's stream and ``torch.cuda.graph`` captures on one, so a
    run on ``cuda:1`` with ``cuda:0`` current would launch its kernels on the wrong GPU; the launcher's
    ``reproduce --jobs`` pins each job with CUDA_VISIBLE_DEVICES instead, where ``cuda`` is its GPU."""
    if not device.startswith("cuda:"):
        yield
        return
    import torch

    with torch.cuda.device(torch.device(device)):
        yield


# 2.-3. the run directory -------------------------------------------------------------------------------
@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a staging directory whose files land in ``final`` only if the block succeeds.

    ``final`` is locked for the whole block (``rundir.lock``: another process gets ``rundir.Busy``), and
    staging folders in it whose owner is dead are removed first. The staging directory is a hidden folder
    inside ``final`` (created when missing) with an owner record, so ``final`` itself is never renamed (it
    may be a mount point such as a device's $OUT). On success its files replace the result files of an
    older run there (other files are left alone), with signals held until all of them are in place; on
    failure it is removed, and so is ``final`` if this call created it.
    """
    final = Path(final).absolute()
    created = not final.exists()
    with rundir.lock(final):
        rundir.sweep(final)
        with interrupt.deferred():  # a staging folder always has its owner record
            tmp = rundir.new_partial(final)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if created and not any(final.iterdir()):
                final.rmdir()
            raise
        try:
            with interrupt.deferred():  # the run's files move together: a signal waits for the last one
                (tmp / rundir.OWNER_FILE).unlink()
                for name in RESULT_FILES:
                    if (final / name).exists() and not (tmp / name).exists():
                        (final / name).unlink()  # stale file of the older run
                for item in tmp.iterdir():
                    os.replace(item, final / item.name)
                tmp.rmdir()
        except interrupt.Interrupted as e:
            e.written.append(final)  # the run is complete on disk; the signal came after
            raise


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
    with on_device(str(cfg.device)):
        return _run(cfg, exp, Path(out_dir))


def _run(cfg: DictConfig, exp: Experiment, out_dir: Path) -> Path:
    weights = str(cfg.checkpoint) if cfg.get("checkpoint") else exp.weights
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
    t0 = time.perf_counter()
    try:
        with staged_dir(out_dir) as tmp:
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            (tmp / "env.json").write_text(json.dumps(env, indent=2) + "\n")
            # benchmarks never need gradients: a stray autograd graph would hold every activation
            with (tmp / "results.jsonl").open("w") as f, torch.no_grad():
                for row in trained_rows.rows(bench, cfg):  # (acc): + bench.trained's pairs
                    row = {**added, **{k: _clean(v) for k, v in dict(row).items()}}
                    row.setdefault("weights", weights)
                    f.write(json.dumps(row, default=_json_default) + "\n")
                    f.flush()
                    n += 1
            if n == 0:
                raise UserError(f"experiment {exp.id!r} produced no rows with these settings; check its bench grid")
            # the rows this record describes: results.jsonl edited afterwards no longer matches (test_provenance)
            # wall_s: how long the bench took to write its rows (reproduce queues the longest references first)
            env.update(rows=n, results_sha256=hashlib.sha256((tmp / "results.jsonl").read_bytes()).hexdigest(),
                       wall_s=round(time.perf_counter() - t0, 1))
            (tmp / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    except UserError:
        raise
    except rundir.Busy as e:
        raise UserError(rundir.busy_message(out_dir, str(e))) from None
    except ValueError as e:  # the bench refused a setting (e.g. a prompt longer than the cache)
        raise UserError(str(e)) from e
    log.info("wrote %d rows to %s", n, out_dir)
    return out_dir
