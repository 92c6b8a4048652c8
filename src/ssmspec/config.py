"""Hydra structured configs and typed views of a composed run config.

``register_configs()`` stores the schemas that conf/config.yaml lists first in its defaults:
``schema/model`` (the ``ModelConfig`` fields with their defaults; the preset yaml then fills in the
numbers) and ``schema/sampling`` (``SamplingConfig``). Hydra then type-checks every override of
``model.*`` and ``sampling.*`` and rejects unknown fields. The dataclasses themselves stay frozen; the
schemas are unfrozen mirrors (a frozen structured config would be read-only and refuse overrides).

The helpers below turn the composed ``DictConfig`` into the project's objects (``model_config``,
``sampling_config``, ``build_strategy``, ``build_drafter``, ``spec_config``) and resolve the ``auto``
values of ``device``, ``dtype`` and ``profile``. Every bad value raises ``ValueError`` naming the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec.models.config import ModelConfig
from ssmspec.strategies.base import SpecConfig
from ssmspec.verify.distributions import SamplingConfig

PROFILES = ("cpu", "gpu")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
_SPEC_KEYS = {f.name for f in dataclasses.fields(SpecConfig)}


def _schema(cls: type) -> type:
    """An unfrozen dataclass with the same fields, types and defaults as the frozen ``cls``."""
    fields = []
    for f in dataclasses.fields(cls):
        default = (dataclasses.field(default=f.default) if f.default is not dataclasses.MISSING
                   else dataclasses.field(default_factory=f.default_factory))
        fields.append((f.name, f.type, default))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields, namespace={"__module__": __name__})


@functools.cache
def register_configs() -> None:
    """Store the structured configs in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="schema", name="model", node=_schema(ModelConfig))
    cs.store(group="schema", name="sampling", node=_schema(SamplingConfig))


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


# range checks -----------------------------------------------------------------------------------
# ModelConfig fields that size a tensor or divide another (0 would divide by zero or build an empty layer)
_MODEL_POSITIVE = ("d_model", "vocab_size", "ssm_heads", "head_dim", "state_size", "n_groups", "conv_kernel",
                   "chunk_size", "n_heads", "n_kv_heads", "attn_head_dim", "d_ff", "top_k", "moe_d_ff",
                   "n_expert_groups", "topk_groups", "max_seq_len", "norm_eps", "rope_theta", "routed_scaling")
_MODEL_NON_NEGATIVE = ("n_experts", "shared_d_ff", "dt_min_limit", "pad_token_id", "bos_token_id", "eos_token_id")
# data fields: (minimum, may be null)
_DATA_RANGES = {"num_prompts": (1, True), "max_prompt_len": (1, True), "prompt_len": (1, False),
                "min_token_id": (0, False), "seed": (0, False), "turn": (1, False)}


def _number(where: str, value, *, minimum: float, integer: bool = False, strict: bool = False) -> None:
    """``value`` is a number (an integer when ``integer``) >= ``minimum`` (> when ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"{where} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value != value or value < minimum or (strict and value == minimum):  # NaN compares false with all
        raise ValueError(f"{where} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")


def check_model_fields(data: dict, where: str = "model") -> None:
    """Ranges of the numeric ModelConfig fields in ``data`` (before the dataclass divides by any of them)."""
    for name in _MODEL_POSITIVE:
        if name in data:
            integer = isinstance(getattr(ModelConfig, name), int)
            _number(f"{where}.{name}", data[name], minimum=1 if integer else 0, integer=integer, strict=not integer)
    for name in _MODEL_NON_NEGATIVE:
        if name in data:
            _number(f"{where}.{name}", data[name], minimum=0, integer=name.endswith("_id") or "d_ff" in name)
    if data.get("dt_max_limit", math.inf) <= data.get("dt_min_limit", 0.0):
        raise ValueError(f"{where}.dt_max_limit must be above dt_min_limit, got {data['dt_max_limit']!r}")


def _check_bench(node, where: str = "bench") -> None:
    """Every number under ``bench`` is finite and >= 0 (grid sizes, counts, probabilities, timings)."""
    if isinstance(node, dict):
        for key, value in node.items():
            _check_bench(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_bench(value, f"{where}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        if not math.isfinite(node) or node < 0:
            raise ValueError(f"{where} must be a finite number >= 0, got {node!r}")


def check_values(cfg: DictConfig) -> None:
    """Type and range of every number a run reads, before anything runs: model, sampling, data, bench,
    seed, and results_dir naming a directory (or nothing yet)."""
    _number("seed", cfg.get("seed", 0), minimum=0, integer=True)
    results_dir = cfg.get("results_dir")
    if results_dir and Path(str(results_dir)).exists() and not Path(str(results_dir)).is_dir():
        raise ValueError(f"results_dir={results_dir} is a file, not a directory; name a directory")
    model_config(cfg)
    sampling_config(cfg)
    data = _plain(cfg.get("data"))
    for name, (minimum, nullable) in _DATA_RANGES.items():
        if name in data and not (nullable and data[name] is None):
            _number(f"data.{name}", data[name], minimum=minimum, integer=True)
    if data.get("turn", 1) not in (1, 2):
        raise ValueError(f"data.turn must be 1 or 2 (MT-Bench has two turns), got {data['turn']!r}")
    bench = _plain(cfg.get("bench"))
    _check_bench(bench)
    for name, minimum in (("iters", 1), ("warmup", 0), ("cpu_threads", 1)):
        if name == "iters" and bench.get(name) == "auto":  # experiments that size the run by the oracle's law
            continue
        if bench.get(name) is not None:
            _number(f"bench.{name}", bench[name], minimum=minimum, integer=True)


# typed views ------------------------------------------------------------------------------------
def model_config(cfg: DictConfig, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of ``cfg.model`` (with field overrides); numbers out of range raise ValueError."""
    data = {**_plain(cfg.model), **overrides}
    check_model_fields(data)
    return ModelConfig.from_dict(data)


def sampling_config(cfg: DictConfig) -> SamplingConfig:
    """The ``SamplingConfig`` of ``cfg.sampling``; unknown fields and out-of-range values raise ValueError."""
    data = _plain(cfg.get("sampling"))
    fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"sampling has no field {unknown[0]!r}; its fields: {', '.join(sorted(fields))}")
    return SamplingConfig(**data)


def build_strategy(cfg: DictConfig):
    """``make_strategy`` from ``cfg.strategy``: its ``name`` plus every option that is not a SpecConfig field."""
    from ssmspec.strategies import make_strategy

    opts = _plain(cfg.strategy)
    name = opts.pop("name")
    return make_strategy(name, **{k: v for k, v in opts.items() if k not in _SPEC_KEYS})


def build_drafter(cfg: DictConfig, **extra):
    """``make_drafter`` from ``cfg.drafter`` (None for ``none``); ``extra`` adds run-time options such as
    the target model of an oracle."""
    from ssmspec.drafting import make_drafter

    opts = _plain(cfg.drafter)
    name = opts.pop("name")
    return make_drafter(name, **opts, **extra)


def spec_config(cfg: DictConfig, drafter=None) -> SpecConfig:
    """The run's ``SpecConfig``: the drafter's shape (none: standard decoding) with the SpecConfig fields
    the strategy config sets (e.g. replay's ``buffer_size``)."""
    base = drafter.spec if drafter is not None else SpecConfig()
    changes = {k: v for k, v in _plain(cfg.strategy).items() if k in _SPEC_KEYS}
    return dataclasses.replace(base, **changes)


def make_model(cfg: DictConfig, *, preset: str | None = None, **overrides):
    """The run's model on ``cfg.device`` in ``cfg.dtype`` (both resolved): the checkpoint when
    ``cfg.checkpoint`` is set, else ``preset`` (default: ``cfg.model``) with seeded random weights
    (``cfg.seed``). ``overrides`` change ModelConfig fields (e.g. max_seq_len)."""
    from ssmspec.models import build_model, load_preset

    dtype = resolve_dtype(str(cfg.dtype), str(cfg.device))
    if cfg.get("checkpoint"):
        from ssmspec.models.loading import load_model

        return load_model(str(cfg.checkpoint), device=cfg.device, dtype=dtype,
                          max_seq_len=overrides.get("max_seq_len"))
    mcfg = load_preset(preset, **overrides) if preset else model_config(cfg, **overrides)
    return build_model(mcfg, seed=int(cfg.seed), device=cfg.device, dtype=dtype)


# auto values ------------------------------------------------------------------------------------
def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_profile(value: str) -> str:
    """``auto`` -> gpu with CUDA, else cpu; gpu without CUDA is an error."""
    if value == "auto":
        return "gpu" if cuda_available() else "cpu"
    if value not in PROFILES:
        raise ValueError(f"profile must be cpu, gpu or auto, got {value!r}")
    if value == "gpu" and not cuda_available():
        raise ValueError("profile=gpu needs a CUDA device and this machine has none; use profile=cpu "
                         "(or leave profile=auto)")
    return value


def resolve_device(value: str) -> str:
    """``auto`` -> cuda when available, else cpu; cuda without a GPU is an error."""
    if value == "auto":
        return "cuda" if cuda_available() else "cpu"
    if str(value).startswith("cuda") and not cuda_available():
        raise ValueError(f"device={value} needs a CUDA device and this machine has none; use device=cpu "
                         f"(or leave device=auto)")
    if not (value == "cpu" or str(value).startswith("cuda")):
        raise ValueError(f"device must be cpu, cuda[:index] or auto, got {value!r}")
    return value


def resolve_dtype(value: str, device: str) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU."""
    if value == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or auto, got {value!r}")
    return _DTYPES[value]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def use_cuda_graph(value, device: str) -> bool:
    """``bench.cuda_graph``: auto -> True on CUDA, False on CPU; True on CPU is an error."""
    if value == "auto" or value is None:
        return str(device).startswith("cuda")
    if isinstance(value, str):
        raise ValueError(f"bench.cuda_graph must be true, false or auto, got {value!r}")
    if value and not str(device).startswith("cuda"):
        raise ValueError("bench.cuda_graph=true needs a CUDA device; use bench.cuda_graph=auto or false on CPU")
    return bool(value)
