"""The lines of the STree end-to-end experiments (``bench/e2e_tree.py``, ``bench/stree_unrolled.py``,
``bench/stree_beam.py``) and the settings they share: a ``Line`` (label, strategy, draft shape, verification), the
drafter a run uses (``bench.drafter``), the acceptance per temperature (``bench.alpha`` / ``bench.rank_decay``) and
the common ``bench`` checks."""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from ssmspec.drafting.static_tree import check_parents, resolve_shape

DRAFTERS = ("auto", "oracle", "self", "draft")
ORACLE_MODES = ("coupled", "forced")


@dataclasses.dataclass
class Line:
    """One curve: its label, strategy, draft shape (None: autoregressive) and verification."""

    label: str
    strategy: str
    parents: list[int] | None = None  # draft shape (a chain is [0, 1, ..., S-1])
    verify: str = "exact"  # exact (greedy / speculative / MSS) or naive
    shape: str | None = None  # shape name for the rows
    beams: int = 0  # > 0: the draft model's beam-search tree of this many beams (``drafting/beam_tree.py``); its
    #                 parents change every step, ``parents`` is only its layout (``beam_layers``)

    @property
    def depth(self) -> int:
        return max(check_parents(self.parents)) if self.parents else 0

    @property
    def is_chain(self) -> bool:
        return bool(self.parents) and self.parents == list(range(len(self.parents)))


def chain(S: int) -> list[int]:
    return list(range(S))


def named_shape(name) -> tuple[list[int], str]:
    """(parents, label) of a ``SHAPES`` name or an explicit parents list."""
    parents = resolve_shape(name)
    return parents, (name if isinstance(name, str) else f"custom{len(parents)}")


def verify_label(line: Line, *, oracle: bool, forced: bool, sampled: bool) -> str:
    """How a line's drafts were judged (rows' ``verify``)."""
    if not line.parents:
        return "sample" if sampled else "greedy"
    if line.verify == "naive":
        return "naive"
    if not sampled:
        return "greedy"
    rule = "speculative" if line.is_chain else "mss"
    if oracle:
        return f"forced-{rule}" if forced else "coupled"
    return rule


def beam_layers(M: int, N: int) -> list[int]:
    """A layout of the M-beam, N-step beam tree for sizes and depth (N layers of M nodes, each layer under the
    first node of the one above); the beam search picks the real parents every step."""
    if M < 1 or N < 1:
        raise ValueError(f"a beam tree needs M >= 1 beams and N >= 1 steps, got M={M}, N={N}")
    return [0 if layer == 0 else 1 + (layer - 1) * M for layer in range(N) for _ in range(M)]


def drafter_kind(cfg: DictConfig) -> str:
    kind = str(cfg.bench.get("drafter", "auto"))
    if kind not in DRAFTERS:
        raise ValueError(f"bench.drafter must be one of {', '.join(DRAFTERS)}; got {kind!r}")
    if kind == "auto":
        return "draft" if cfg.get("checkpoint") else "oracle"
    return kind


def acceptance_table(b: DictConfig) -> list[tuple[float, float, float]]:
    """(temperature, alpha, rank_decay) of every temperature: ``bench.alpha`` / ``bench.rank_decay`` are one
    number for all, or one per ``bench.temperature``; None where the file leaves them out (measured drafters)."""
    temps = [float(t) for t in b.temperature]
    if not temps or min(temps) < 0:
        raise ValueError(f"bench.temperature needs values >= 0, got {temps}")

    def per_temp(key: str) -> list:
        v = b.get(key)
        if v is None:
            return [None] * len(temps)
        vals = [float(x) for x in v] if isinstance(v, (list, tuple)) or hasattr(v, "__len__") else [float(v)]
        if len(vals) == 1:
            vals = vals * len(temps)
        if len(vals) != len(temps):
            raise ValueError(f"bench.{key} has {len(vals)} values but bench.temperature has {len(temps)}: give one "
                             f"value, or one per temperature")
        if any(not 0.0 <= x <= 1.0 for x in vals):
            raise ValueError(f"bench.{key} values must be in [0, 1], got {vals}")
        return vals

    return list(zip(temps, per_temp("alpha"), per_temp("rank_decay")))


def check_common(b: DictConfig, what: str) -> None:
    sizes = [int(x) for x in b.batch]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{what}: bench.batch needs positive sizes, got {sizes}")
    if int(b.prompt_len) < 1 or (str(b.iters) != "auto" and int(b.iters) < 1):
        raise ValueError(f"{what}: need bench.prompt_len >= 1 and bench.iters >= 1 (or auto)")
    if float(b.get("sigma", 0.0)) < 0:
        raise ValueError(f"{what}: bench.sigma is a noise std, >= 0; got {b.sigma}")
