"""Training a multi-token-prediction head on its frozen target (issue 24; the head: ``models/mtp.py``).

The head reads the target's final hidden state at t (after its final norm) and the embedding of token t + 1 and
is trained on the cross-entropy of token t + 2, on the windows the target trained on, through the target's loop
(``trainer.fit``: AdamW, warm-up and cosine, clipping, seeded batches, the log) with the target frozen: only the
head's parameters move, the embedding and LM head it shares with the target stay as trained. A window of
``seq_len + 1`` tokens gives ``seq_len - 1`` entries (t = 0 .. seq_len - 2).

A train config asks for heads with a section ``mtp: {layers: 1, <LoopConfig fields>}`` (conf/train/tiny.yaml);
``layers: 0`` or no section trains none. Every target then carries an untrained head from its start (its weights
are drawn after the target's, so the target trains exactly as without one and the head gets no gradient), the
head trains after the target, and the target's checkpoint holds it as ``mtp.*`` weights (``export.py``). The
manifest records, per target, the head's steps, time, validation loss and its top-1 agreement with the target's
own next-next token (argmax of the head at t == argmax of the target at t + 1: what decides whether the first
draft is accepted), next to the agreement of always guessing the target's most frequent next-next token.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.model import HybridLM
from ssmspec.models.mtp import mtp_hidden
from ssmspec.train.export import canonical_config
from ssmspec.train.forward import reference_ops, train_context, train_hidden
from ssmspec.train.trainer import LoopConfig, LossFn, fit, windows_for_eval


@dataclass(frozen=True)
class HeadSettings:
    """The ``mtp`` section of a train config."""

    layers: int  # MTP layers of every target's head (1: the published heads)
    loop: LoopConfig  # the head's training loop


def head_settings(node) -> HeadSettings | None:
    """The ``mtp`` section (None, or layers 0: no heads), checked like the other loops."""
    if node is None:
        return None
    if not isinstance(node, dict):
        raise ValueError(f"mtp must be a mapping (layers: 1 and the loop of conf/train/tiny.yaml), got {node!r}")
    node = dict(node)
    layers = node.pop("layers", 0)
    if layers not in (0, 1):
        raise ValueError(f"mtp.layers={layers!r} must be 0 (no head) or 1 (one MTP layer, as the published heads)")
    loop = LoopConfig.from_dict(node, "mtp")
    return HeadSettings(layers, loop) if layers else None


def with_head(cfg: ModelConfig, settings: HeadSettings | None) -> ModelConfig:
    """The target config with its head declared (attention, then the target's kind of MLP), as the loader reads
    it back; unchanged without settings."""
    if settings is None:
        return cfg
    return canonical_config(cfg.replace(mtp_layers=settings.layers, mtp_pattern="*-"))


def head_forward(model: HybridLM, hidden: Tensor, next_ids: Tensor) -> Tensor:
    """The head on hidden (B, L, d) at entries t and next_ids (B, L) the tokens t + 1 -> (B, L, d), differentiable in
    the head's parameters (causal attention over the entries, positions 0 .. L - 1)."""
    ctx = train_context(model, next_ids, attention=model.mtp.attention_blocks, strategy=False)
    with reference_ops():
        return mtp_hidden(model, next_ids, hidden, ctx)


def _entries(target: HybridLM, windows: Tensor) -> tuple[Tensor, Tensor]:
    """windows (B, L + 1) -> (the head's output (B, L - 1, d) at entries 0 .. L - 2, the target's hidden (B, L, d))."""
    with torch.no_grad():
        h = train_hidden(target, windows[:, :-1])  # (B, L, d)
    return head_forward(target, h[:, :-1], windows[:, 1:-1]), h


def mtp_loss(target: HybridLM) -> LossFn:
    """loss(head, windows (B, L + 1)) = cross-entropy of token t + 2 at every entry t (module doc)."""

    def loss(_, windows: Tensor) -> Tensor:
        g, _h = _entries(target, windows)
        logits = target.logits(g)  # (B, L - 1, V) fp32
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 2:].reshape(-1))

    return loss


@torch.no_grad()
def agreement(target: HybridLM, windows: Tensor, batch: int) -> dict:
    """Top-1 agreement of the head with the target's next-next token over ``windows`` (module doc), and that of
    always guessing the target's most frequent one."""
    same, guesses = 0, []
    for i in range(0, windows.shape[0], batch):
        g, h = _entries(target, windows[i:i + batch])
        want = target.logits(h[:, 1:]).argmax(-1)  # (B, L - 1) the target's token after t + 1
        same += (target.logits(g).argmax(-1) == want).sum().item()
        guesses.append(want.reshape(-1))
    want = torch.cat(guesses)
    return {"agreement": same / want.numel(), "majority_agreement": want.bincount().max().item() / want.numel(),
            "agreement_tokens": want.numel()}


class _Head(nn.Module):
    """What ``trainer.fit`` trains: the target's head alone (its parameters), beside the frozen target."""

    def __init__(self, target: HybridLM) -> None:
        super().__init__()
        self.head = target.mtp
        n = sum(p.numel() for p in self.head.parameters())
        self.cfg = SimpleNamespace(num_parameters=lambda: n)
        self.device = target.device


def train_head(target: HybridLM, train_stream: Tensor, val_stream: Tensor, settings: HeadSettings, *, seed: int,
               label: str, log_file: Path) -> dict:
    """Train ``target``'s head on the frozen target (module doc); returns the manifest's record of it."""
    if target.mtp is None:
        raise ValueError(f"model {target.cfg.name!r} has no MTP head to train; build it from with_head(cfg, settings)")
    c = settings.loop
    target.eval().requires_grad_(False)
    target.mtp.requires_grad_(True)
    val = windows_for_eval(val_stream, c)
    stats = fit(_Head(target), mtp_loss(target), train_stream, val, c, seed=seed, label=label, log_file=log_file)
    target.requires_grad_(False)
    target.eval()
    params = sum(p.numel() for p in target.mtp.parameters())
    return {"layers": settings.layers, "params": params, "steps": c.steps, **stats,
            **agreement(target, val.to(target.device), c.batch)}
