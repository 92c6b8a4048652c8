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


# typed views ------------------------------------------------------------------------------------
def model_config(cfg: DictConfig, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of ``cfg.model`` (with field overrides)."""
    return ModelConfig.from_dict({**_plain(cfg.model), **overrides})


def sampling_config(cfg: DictConfig) -> SamplingConfig:
    """The ``SamplingConfig`` of ``cfg.sampling``; out-of-range values raise ValueError."""
    return SamplingConfig(**_plain(cfg.get("sampling")))


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
