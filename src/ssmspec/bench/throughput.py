"""Experiment ``throughput_ar``: prefill and decode throughput of model presets with the autoregressive loop.

For every preset, batch B and context length T (the ``bench`` grid of conf/experiment/throughput_ar.yaml):

- prefill: one model call over B synthetic prompts of T tokens that sets every SSM / conv state and KV
  cache, and picks the first token from the last position's logits (a serving system computes the LM
  head at the last position only; ``HybridLM.forward`` would build (B, T, V) fp32 logits). Timed eager
  with CUDA events (one call is long; a graph adds nothing). tokens_per_s = B * T / time.
- decode: one step of the autoregressive loop, as generate() runs it without drafts: strategy layout ->
  model call on the B pending tokens (full LM head) -> greedy pick -> strategy commit and KV-cache
  append -> the pick becomes the pending token. The caches start as if T tokens had been prefilled:
  KV lengths are T (contents random: a step's time does not depend on the values), SSM / conv states
  zero. On CUDA the step is captured once in a CUDA graph and replayed; each replay is a real step
  (caches grow by one token). tokens_per_s = B / time.

Rows: model, params, strategy, phase, batch, context, tokens (per timed call), dtype, timing
(cuda_graph | eager), samples_ms and its summary (ms_p50 ...), tokens_per_s (from the median), status
(ok | oom | skipped); decode rows on CUDA add bytes_min (weights + SSM/conv state read and written + the
KV cache read once) and hbm_fraction = bytes_min / time / measured copy bandwidth.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.bench.timing import hbm_fraction, measure_hbm_bandwidth, summarize, time_cuda_graph, time_eager
from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.strategies import SpecConfig, StepInputs
from ssmspec.verify.base import Verdict

log = logging.getLogger("ssmspec.bench.throughput")


def _kv_caches(mcfg, batch: int, max_len: int, *, max_new: int, device, dtype) -> list[KVCache]:
    return [KVCache(batch, mcfg.n_kv_heads, mcfg.attn_head_dim, max_len, rows=batch, max_new=max_new,
                    device=device, dtype=dtype) for _ in mcfg.attention_layers]


def prefill_fn(model, strategy, ids: torch.Tensor):
    """A closure running one prefill of ``ids`` (B, T); returns the (B,) first tokens."""
    mcfg = model.cfg
    bsz, T = ids.shape
    strategy.allocate(mcfg, bsz, SpecConfig(), ids.device, model.dtype)
    kv = _kv_caches(mcfg, bsz, T + 1, max_new=T, device=ids.device, dtype=model.dtype)
    positions = torch.arange(T, device=ids.device)[None].expand(bsz, T)
    step = StepInputs(input_ids=ids, positions=positions, prefill=True)
    ctx = RunContext(strategy=strategy, kv=kv, step=step)
    rows = torch.arange(bsz, device=ids.device)
    cols = torch.arange(T, device=ids.device)[None].expand(bsz, T)
    count = torch.full((bsz,), T, device=ids.device, dtype=torch.long)

    @torch.no_grad()
    def run() -> torch.Tensor:
        for c in kv:
            c.length.zero_()
        h = model.embeddings(ids)  # (B, T, d)
        for block in model.layers:
            h = block(h, ctx)
        for c in kv:
            c.commit(rows, cols, count)
        h = model.norm_f(h[:, -1:].to(model.norm_f.weight.dtype))  # last position only
        return model.lm_head(h.to(model.lm_head.weight.dtype))[:, -1].float().argmax(-1)  # (B,)

    return run


def decode_fn(model, strategy, pending: torch.Tensor, context: int, steps: int):
    """A closure running one autoregressive decode step on static buffers (graph-capturable); the caches
    hold ``context`` tokens before the first step and have room for ``steps`` more."""
    mcfg = model.cfg
    bsz, device = pending.shape[0], pending.device
    strategy.allocate(mcfg, bsz, SpecConfig(), device, model.dtype)
    max_len = context + steps
    kv = _kv_caches(mcfg, bsz, max_len, max_new=1, device=device, dtype=model.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for c in kv:
        c.k.normal_(generator=gen)
        c.v.normal_(generator=gen)
        c.length.fill_(context)
    pending = pending.clone()  # (B,) static: the token fed next
    seq_len = torch.full((bsz,), context, device=device, dtype=torch.long)  # (B,) tokens in the state
    rows = torch.arange(bsz, device=device)
    cols = torch.zeros(bsz, 1, device=device, dtype=torch.long)  # the pending token's column
    zeros = torch.zeros(bsz, device=device, dtype=torch.long)
    ones = torch.ones(bsz, device=device, dtype=torch.long)
    ctx = RunContext(strategy=strategy, kv=kv, step=None)

    @torch.no_grad()
    def run() -> None:
        step = strategy.layout(pending, None, seq_len)
        step.kv_bound = max_len  # host-known bound: no sync, fixed shapes across replays
        ctx.step = step
        logits = model(step.input_ids, ctx)  # (B, 1, V) fp32
        nxt = logits[:, -1].argmax(-1)  # (B,) greedy
        strategy.commit(Verdict(accepted=zeros, path=cols, bonus=nxt), step)
        for c in kv:
            c.commit(rows, cols, ones)
        pending.copy_(nxt)
        seq_len.add_(1)

    bytes_min = (sum(p.numel() * p.element_size() for p in model.parameters())
                 + 2 * sum(t.numel() * t.element_size() for t in (strategy.ssm_state, strategy.conv_state))
                 + sum(2 * bsz * mcfg.n_kv_heads * context * mcfg.attn_head_dim * c.k.element_size() for c in kv))
    return run, bytes_min


def _timed(fn, *, graph: bool, warmup: int, iters: int, device: str) -> tuple[list[float], str]:
    if graph:
        try:
            return time_cuda_graph(fn, warmup=warmup, iters=iters), "cuda_graph"
        except RuntimeError as e:  # host sync or dynamic shape somewhere in the step: time it eager
            log.warning("CUDA-graph capture failed (%s); timing eager", str(e).splitlines()[0])
            torch.cuda.synchronize()
    return time_eager(fn, warmup=warmup, iters=iters, device=device), "eager"


def _grid(b: DictConfig) -> list[tuple[str, int, int]]:
    phases = list(b.get("phases", ["prefill", "decode"]))
    bad = sorted(set(phases) - {"prefill", "decode"})
    if bad:
        raise ValueError(f"bench.phases may hold prefill and decode, got {bad}")
    batches, contexts = [int(x) for x in b.batch], [int(x) for x in b.context]
    if not batches or not contexts or min(batches + contexts) < 1:
        raise ValueError(f"bench.batch and bench.context need positive sizes, got {batches} and {contexts}")
    return [(ph, bs, T) for ph in phases for bs in batches for T in contexts]


def run_throughput(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``throughput_ar`` (experiment contract): yields one row per grid point."""
    b = cfg.bench
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters = int(b.warmup), int(b.iters)
    pre_warmup, pre_iters = int(b.get("prefill_warmup") or warmup), int(b.get("prefill_iters") or iters)
    max_tokens = int(b.get("max_prefill_tokens") or 0)
    grid = _grid(b)
    presets = [None] if cfg.get("checkpoint") else list(b.get("presets") or [cfg.model.name])
    peak = measure_hbm_bandwidth() if device.startswith("cuda") else None
    strategy = C.build_strategy(cfg)
    if strategy.speculative:
        raise ValueError(f"throughput_ar times standard decoding; strategy {strategy.name!r} speculates. Use "
                         f"strategy=autoregressive (or a strategy with speculative=False)")
    points = [(p, *g) for p in presets for g in grid]
    model, current = None, object()
    for preset, phase, bsz, T in track(points, desc="throughput", total=len(points)):
        if preset != current:
            model = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            model = C.make_model(cfg, preset=preset)
            current = preset
        mcfg = model.cfg
        row = {"model": mcfg.name, "params": mcfg.num_parameters(), "strategy": strategy.name, "phase": phase,
               "batch": bsz, "context": T, "dtype": C.dtype_name(model.dtype),
               "tokens": bsz * T if phase == "prefill" else bsz}
        if phase == "prefill" and max_tokens and bsz * T > max_tokens:
            log.info("skip prefill %s B=%d T=%d: %d tokens > bench.max_prefill_tokens=%d", mcfg.name, bsz, T,
                     bsz * T, max_tokens)
            yield {**row, "status": "skipped"}
            continue
        try:
            if phase == "prefill":
                ids = synthetic_prompts(bsz, T, mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)),
                                        min_token_id=int(cfg.data.get("min_token_id", 3)), device=device)
                samples = time_eager(prefill_fn(model, strategy, ids), warmup=pre_warmup, iters=pre_iters,
                                     device=device)
                timing, extra = "eager", {}
            else:
                pending = synthetic_prompts(bsz, 1, mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)),
                                            device=device)[:, 0]
                fn, bytes_min = decode_fn(model, strategy, pending, T, steps=warmup + iters + 8)
                samples, timing = _timed(fn, graph=graph, warmup=warmup, iters=iters, device=device)
                del fn  # the step's caches
                extra = {"cache_fill": "random", "bytes_min": bytes_min}
        except torch.OutOfMemoryError as e:
            log.warning("out of memory: %s %s B=%d T=%d (%s)", mcfg.name, phase, bsz, T, str(e)[:400])
            strategy = C.build_strategy(cfg)  # drop the state tensors of this point
            torch.cuda.empty_cache()
            yield {**row, "status": "oom"}
            continue
        stats = summarize(samples)
        row.update(status="ok", timing=timing, **extra, **stats, samples_ms=samples,
                   tokens_per_s=row["tokens"] / (stats["ms_p50"] * 1e-3))
        if peak and phase == "decode":
            row.update(hbm_gbps_peak=peak, hbm_fraction=hbm_fraction(row["bytes_min"], stats["ms_p50"], peak))
        log.info("%-14s %-7s B=%-3d T=%-5d %9.3f ms  %12.0f tok/s  (%s)", mcfg.name, phase, bsz, T,
                 stats["ms_p50"], row["tokens_per_s"], timing)
        yield row
    del model
