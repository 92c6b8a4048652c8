"""The training loop shared by targets (next-token cross-entropy) and drafts (KL to the target, ``distill.py``).

AdamW (weight decay on matrices only: norms, biases, A_log, D and dt_bias keep theirs), linear warm-up then a
cosine decay to ``min_lr_ratio`` of the peak, gradient clipping by global norm, bf16 autocast on CUDA only (fp32
on CPU), seeded batches. Batches are random windows of ``seq_len + 1`` tokens of the training stream (a seeded
generator); validation is a fixed set of evenly spaced windows of the validation stream, so every evaluation of a
run (and of the runs it is compared with) reads the same tokens. Every evaluation appends one JSON line to the
log: model, step, tokens seen, mean training loss since the last evaluation, validation loss, learning rate and
elapsed seconds.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.bench.inputs import track
from ssmspec.models.config import ModelConfig
from ssmspec.models.model import HybridLM
from ssmspec.train.forward import train_logits

log = logging.getLogger(__name__)

LossFn = Callable[[HybridLM, Tensor], Tensor]  # (model, windows (B, seq_len + 1)) -> scalar loss


@dataclass(frozen=True)
class LoopConfig:
    """One training loop (conf/train/<name>.yaml ``train`` for targets, ``distill`` for drafts)."""

    seq_len: int = 128  # tokens per training sequence (a window holds seq_len + 1: inputs and next tokens)
    batch: int = 16  # sequences per step
    steps: int = 200  # optimizer steps
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup: int = 20  # linear warm-up steps from 0 to lr
    weight_decay: float = 0.1  # AdamW decay of weight matrices
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    eval_every: int = 50  # steps between validation evaluations (also at step 0 and at the end)
    eval_batches: int = 4  # validation batches of `batch` windows each

    def __post_init__(self) -> None:
        for key in ("seq_len", "batch", "steps", "eval_every", "eval_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup < 0:
            raise ValueError(f"lr={self.lr} must be > 0, min_lr_ratio={self.min_lr_ratio} in [0, 1], "
                             f"warmup={self.warmup} >= 0")

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "LoopConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None


def lr_factor(step: int, c: LoopConfig) -> float:
    """Multiplier of the peak lr at ``step``: linear warm-up, then cosine from 1 to ``min_lr_ratio``."""
    if step < c.warmup:
        return (step + 1) / (c.warmup + 1)
    t = (step - c.warmup) / max(c.steps - c.warmup, 1)
    return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def lm_loss(model: HybridLM, windows: Tensor) -> Tensor:
    """Next-token cross-entropy of windows (B, L + 1): predict windows[:, 1:] from windows[:, :-1]."""
    logits = train_logits(model, windows[:, :-1])  # (B, L, V) fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def windows_for_eval(stream: Tensor, c: LoopConfig) -> Tensor:
    """(eval_batches * batch, seq_len + 1) evenly spaced windows of ``stream`` (1-D int64)."""
    n, span = c.eval_batches * c.batch, c.seq_len + 1
    if stream.numel() < span:
        raise ValueError(f"the validation split has {stream.numel()} tokens, fewer than one window of seq_len + 1 = "
                         f"{span}; lower seq_len or raise corpus.max_bytes / corpus.val_fraction")
    starts = torch.linspace(0, stream.numel() - span, n).long()
    return torch.stack([stream[s:s + span] for s in starts.tolist()])


def check_memory(cfg: ModelConfig, c: LoopConfig, device: torch.device, *, frozen: ModelConfig | None = None) -> None:
    """Refuse a model whose weights, gradients and AdamW states (16 bytes a parameter in fp32), plus a rough
    activation estimate, exceed the free memory of ``device`` (``frozen``: a target read alongside, 4 B/param)."""
    params = cfg.num_parameters()
    need = 16 * params + 4 * (frozen.num_parameters() if frozen else 0)
    need += 4 * c.batch * c.seq_len * (cfg.vocab_size * 3 + 24 * cfg.d_model * cfg.n_layer)  # logits + activations
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise ValueError(f"model {cfg.name!r} ({params / 1e6:.1f}M parameters) needs about {need / 2**30:.1f} GiB to "
                         f"train at batch {c.batch} x {c.seq_len}, more than the {free / 2**30:.1f} GiB free on "
                         f"{device}; shrink the model, lower the batch or seq_len, or train on a larger device")


def _param_groups(model: HybridLM, weight_decay: float) -> list[dict]:
    decay, keep = [], []
    for p in {id(p): p for p in model.parameters()}.values():  # a tied embedding once
        (decay if p.dim() >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model: HybridLM, loss_fn: LossFn, windows: Tensor, c: LoopConfig) -> float:
    """Mean of ``loss_fn`` over the validation windows, batch by batch, on the model's device (bf16 autocast on
    CUDA, as in training)."""
    model.eval()
    windows = windows.to(model.device)
    with _autocast(model.device):
        losses = [loss_fn(model, windows[i:i + c.batch]).item() for i in range(0, windows.shape[0], c.batch)]
    return sum(losses) / len(losses)


def _autocast(dev: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")


def fit(model: HybridLM, loss_fn: LossFn, train_stream: Tensor, val_windows: Tensor, c: LoopConfig, *, seed: int,
        label: str, log_file: Path) -> dict:
    """Train ``model`` in place for ``c.steps`` steps; returns {train_time_s, tokens_seen, initial_val_loss,
    val_loss}. A non-finite loss stops the run with a ``ValueError`` naming the fix."""
    dev = model.device
    span = c.seq_len + 1
    if train_stream.numel() <= span:
        raise ValueError(f"the training split has {train_stream.numel()} tokens, fewer than one window of seq_len + 1 "
                         f"= {span}; lower seq_len or raise corpus.max_bytes")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(_param_groups(model, c.weight_decay), lr=c.lr, betas=(c.beta1, c.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, c))
    autocast = _autocast(dev)
    val_windows = val_windows.to(dev)

    def record(step: int, train_loss: float | None, start: float) -> float:
        val = evaluate(model, loss_fn, val_windows, c)
        row = {"model": label, "step": step, "tokens": step * c.batch * c.seq_len, "train_loss": train_loss,
               "val_loss": val, "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.perf_counter() - start, 3)}
        with open(log_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        return val

    start = time.perf_counter()
    initial = val = record(0, None, start)
    log.info("%s: %d parameters, initial validation loss %.4f", label, model.cfg.num_parameters(), initial)
    running: list[float] = []
    bar = track(range(c.steps), desc=f"train {label}", total=c.steps)
    for step in bar:
        starts = torch.randint(0, train_stream.numel() - span, (c.batch,), generator=gen)
        windows = torch.stack([train_stream[s:s + span] for s in starts.tolist()]).to(dev)
        model.train()
        with autocast:
            loss = loss_fn(model, windows)
        if not torch.isfinite(loss):
            raise ValueError(f"training of {label} diverged: loss {loss.item()} at step {step}; lower train.lr (or "
                             f"distill.lr for drafts) or raise warmup")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        sched.step()
        running.append(loss.item())
        done = step + 1
        tok_s = done * c.batch * c.seq_len / max(time.perf_counter() - start, 1e-9)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{running[-1]:.3f}", tok_s=f"{tok_s:,.0f}")
        if done % c.eval_every == 0 or done == c.steps:
            val = record(done, sum(running) / len(running), start)
            log.info("%s step %d/%d: train loss %.4f, validation loss %.4f, %.0f tokens/s", label, done, c.steps,
                     sum(running) / len(running), val, tok_s)
            running = []
    model.eval()
    return {"train_time_s": round(time.perf_counter() - start, 3), "tokens_seen": c.steps * c.batch * c.seq_len,
            "initial_val_loss": initial, "val_loss": val}
