"""Reading a checkpoint directory, whatever its family: ``config.json`` (decoded, a broken file named with the
fix), the weight files (safetensors, sharded or not, else pytorch_model.bin) and the check of a state dict against
the model a config builds. Shared by ``loading`` (Mamba-2 / NemotronH / mamba_ssm), ``loading_qwen`` and
``loading_mil``, which import it and not each other."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.model import HybridLM

DEFAULT_MAX_SEQ_LEN = 8192
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin")


def _decode_floats(obj):
    """transformers 5 writes inf as {"__float__": "Infinity"}; turn such dicts back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


_RESAVE = "re-save the model with save_pretrained, or re-download the checkpoint"


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; a truncated or hand-broken file names itself, the place and the fix."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; a truncated "
                         f"download?); fix it or {_RESAVE}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} cannot be read ({e}); {_RESAVE}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object; {_RESAVE}")
    return data


def read_config_json(path: str | os.PathLike) -> dict:
    """The decoded ``config.json`` of a checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json; a checkpoint directory holds config.json plus its weights "
                         f"(save_pretrained output or a mamba_ssm checkpoint)")
    return _decode_floats(_read_json(file))


def _first_id(value, default: int) -> int:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return default if value is None else int(value)


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory (safetensors, sharded or not, else pytorch_model.bin)."""
    path = Path(path)
    found = next((path / f for f in _WEIGHT_FILES if (path / f).is_file()), None)
    if found is None:
        raise ValueError(f"{path}: no weights found (looked for {', '.join(_WEIGHT_FILES)}); save the model with "
                         f"save_pretrained or copy the checkpoint's weight files next to config.json")
    if found.name.endswith(".index.json"):
        weight_map = _read_json(found).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{found}: no weight_map (tensor name -> shard file); {_RESAVE}")
        files = [path / s for s in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{found} lists shard(s) {_listing(absent)} that are not in {path}; copy or re-download "
                             f"every shard")
    else:
        files = [found]
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(_read_weights(f))
    return sd


def _read_weights(file: Path) -> dict[str, Tensor]:
    """The tensors of one weight file; a truncated or corrupt file is named with the fix."""
    from safetensors import SafetensorError

    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"{file}: cannot read the weights ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                         f"the file is truncated or corrupt: {_RESAVE}") from None


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = HybridLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _listing(items: list[str], limit: int = 12) -> str:
    more = f" ... (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_state_dict(sd: dict[str, Tensor], cfg: ModelConfig, *, where: str = "checkpoint") -> None:
    """Raise one ``ValueError`` naming every missing / unexpected key and shape mismatch."""
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    mismatched = sorted(f"{k} {tuple(sd[k].shape)} vs {expected[k]}" for k in set(sd) & set(expected)
                        if tuple(sd[k].shape) != expected[k])
    if not (missing or unexpected or mismatched):
        return
    head = (f"{where} does not match its config ({cfg.family}, pattern {cfg.pattern!r}, d_model {cfg.d_model}, "
            f"vocab {cfg.vocab_size}):")
    lines = [head]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {_listing(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    if mismatched:
        lines.append(f"  shape mismatches, checkpoint vs config ({len(mismatched)}): {_listing(mismatched)}")
    lines.append("Fix: make config.json describe these weights (layer pattern, head counts, sizes, vocab_size, "
                 "tie_word_embeddings), or re-save the checkpoint with save_pretrained / re-download all shards.")
    raise ValueError("\n".join(lines))
