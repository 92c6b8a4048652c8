"""Step-time experiments of ReplaySSM (seed 000): where a decode step's time goes (``replay_fig2_breakdown``),
the whole-step part of Fig. 6 (rows added to ``replay_fig6_speedup``) and how a kernel speedup propagates to
the verify forward and the whole step (``replay_fig10_propagation``). STree's model-call fit is in
``bench/steps_fit.py``.

Everything timed here is the engine's own step (``bench/steps.py``: an engine started at a context with random
drafts): the whole step is ``Engine.time_steps`` (CUDA-graph replays timed with CUDA events; eager on CPU), the
verify forward is ``DecodeStep.forward`` -- the first half of the engine's ``target_step`` (strategy layout +
model call) -- captured alone as a CUDA graph.

Breakdown (Fig. 2). On CUDA, torch.profiler records the device kernels of a few graph replays of the step;
kernel names classify them: the Triton kernels of the SSM state ops (``SSM_KERNEL_MODULES``: single-token,
multi-step, replay, tree scan, GDN -- not the conv kernels) are ``ssm``, those of ``ops/attention`` and any
SDPA / flash kernel are ``attention``, everything else (GEMMs, norms, conv, sampling, copies) plus the gaps
between kernels is ``rest`` = step time - ssm - attention. On CPU the reference twins run, so the same three
parts come from timers around the SSM state ops and the attention ops where the strategies and the KV cache
call them (``STATE_OPS``, ``ATTENTION_OPS``). Points whose weights + caches cannot fit the free memory
(``engine.memory``) are rows with ``status: skipped`` naming both numbers: where the curve stops.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import sys
import time
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.kernels import Ctx, mixer_sizes
from ssmspec.bench.replay_measure import replay_measure, snapshot_measure
from ssmspec.bench.steps import step_engine, step_row
from ssmspec.bench.timing import summarize, time_cuda_graph, time_eager
from ssmspec.engine.memory import HEADROOM, fmt_bytes, free_bytes, plan_bytes
from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig, make_strategy

log = logging.getLogger("ssmspec.bench.steps_replay")

# public SSM state ops (ops/*/__init__.py) and attention ops, by the names strategies and the KV cache call
STATE_OPS = ("selective_state_update", "ssm_multistep", "ssm_multistep_snapshot", "replay_verify", "tree_scan",
             "gdn_recurrent_update", "gdn_multistep", "gdn_multistep_snapshot", "gdn_replay_verify")
ATTENTION_OPS = ("decode_attention", "sdpa_attention")
# modules whose Triton kernels are SSM state kernels / attention kernels (device-side classification)
SSM_KERNEL_MODULES = ("ssmspec.ops.selective_state_update.triton", "ssmspec.ops.multistep.triton",
                      "ssmspec.ops.replay.triton", "ssmspec.ops.tree_scan.triton", "ssmspec.ops.gdn.recurrent",
                      "ssmspec.ops.gdn.replay", "ssmspec.ops.ssd.triton")
ATTENTION_KERNEL_MODULES = ("ssmspec.ops.attention.triton",)
ATTENTION_MARKERS = ("flash", "fmha", "attention", "sdpa", "attn")  # torch's SDPA backends' kernel names


# memory ------------------------------------------------------------------------------------------------
def point_fits(mcfg, strategy: str, *, batch: int, context: int, spec: SpecConfig, steps: int, dtype,
               device: str) -> tuple[bool, int, int]:
    """(fits, bytes needed, bytes free) of weights + one engine's caches and activations, before building it."""
    elt = torch.empty((), dtype=dtype).element_size()
    parts = plan_bytes(mcfg, make_strategy(strategy), batch=batch, spec=spec,
                       kv_capacity=context + steps * (spec.nodes + 1) + spec.nodes + 1, prefill_len=context,
                       dtype=dtype, prefill=False)
    need = mcfg.num_parameters() * elt + sum(parts.values())
    free = free_bytes(device)
    return need <= HEADROOM * free, need, free


def model_for(cfg: DictConfig, preset: str, max_context: int):
    """Random-weight (or checkpoint) model with room for ``max_context`` tokens in its KV caches."""
    if str(cfg.device).startswith("cuda"):
        torch.cuda.empty_cache()
    need = max_context + 64
    mcfg = load_preset(preset)
    return C.make_model(cfg, preset=preset, max_seq_len=max(need, mcfg.max_seq_len))


def release(device: str) -> None:
    """Give a finished engine's caches and graph pools back to the driver, so the next engine's memory check
    (``engine.memory.check_fits``: the driver's free bytes) sees them free."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


# kernel classification ---------------------------------------------------------------------------------
def kernel_names() -> dict[str, str]:
    """{Triton kernel name: 'ssm' | 'attention'} from the kernels the op modules define (no conv kernels)."""
    out: dict[str, str] = {}
    for part, mods in (("ssm", SSM_KERNEL_MODULES), ("attention", ATTENTION_KERNEL_MODULES)):
        for name in mods:
            mod = importlib.import_module(name)
            for obj in vars(mod).values():
                wrapped = False  # a Triton kernel: JITFunction, or the interpreter's wrapper under TRITON_INTERPRET=1
                while hasattr(obj, "fn") and type(obj).__module__.startswith("triton"):
                    wrapped = True
                    obj = obj.fn  # jit / autotuner / heuristics wrappers hold the Python function in .fn
                name = getattr(obj, "__name__", "")
                if wrapped and name.endswith("_kernel") and "conv" not in name:
                    out[name] = part  # launched kernels only (helpers such as _dot are inlined)
    return out


def classify(kernel: str, names: dict[str, str]) -> str:
    """'ssm', 'attention' or 'rest' for a device kernel's name."""
    if kernel in names:
        return names[kernel]
    low = kernel.lower()
    return "attention" if any(m in low for m in ATTENTION_MARKERS) else "rest"


def _profile_device(eng, steps: int) -> tuple[dict[str, float], int, str]:
    """ms per step of SSM / attention / other kernels over ``steps`` launches of the engine's step, the
    kernels seen, and how they ran (graph replays; eager steps where the profiler saw no graph kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    names = kernel_names()
    for mode in ("cuda_graph", "eager"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                if mode == "cuda_graph":
                    eng.launch()
                else:  # the same step functions, run eagerly on the engine's static buffers
                    eng._eager()
            torch.cuda.synchronize()
        eng.collect(keep=0)
        parts = dict(ssm=0.0, attention=0.0, rest=0.0)
        n = 0
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                parts[classify(e.name, names)] += e.time_range.elapsed_us() / 1e3 / steps
                n += 1
        if n:
            return parts, n // steps, mode
        log.warning("profiler saw no kernels of graph replays; profiling eager steps instead")
    raise RuntimeError("torch.profiler recorded no CUDA kernels; the breakdown needs CUPTI (kineto)")


@contextlib.contextmanager
def _op_timers(parts: dict[str, float]):
    """CPU: add the seconds spent in the SSM state ops and attention ops to ``parts`` while active, by
    wrapping them where ``ssmspec.strategies.*`` / ``ssmspec.models.*`` call them (restored on exit)."""
    patched = []

    def wrap(fn, part):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - t0
        return timed

    try:
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(("ssmspec.strategies.", "ssmspec.models.")):
                continue
            for part, ops in (("ssm", STATE_OPS), ("attention", ATTENTION_OPS)):
                for op in ops:
                    fn = vars(mod).get(op)
                    if callable(fn):
                        patched.append((mod, op, fn))
                        setattr(mod, op, wrap(fn, part))
        yield
    finally:
        for mod, op, fn in patched:
            setattr(mod, op, fn)


def _profile_host(eng, steps: int) -> tuple[dict[str, float], float]:
    """CPU: ms per step in the SSM state ops and attention ops, and the mean step time, over ``steps``."""
    secs = dict(ssm=0.0, attention=0.0)
    t0 = time.perf_counter()
    with _op_timers(secs):
        for _ in range(steps):
            eng.launch()
            eng.collect(keep=0)
    total = (time.perf_counter() - t0) * 1e3 / steps
    return {k: v * 1e3 / steps for k, v in secs.items()}, total


def breakdown_fields(eng, steps: int, step_ms: float) -> dict:
    """The Fig. 2 columns of one engine: ms per step and share of ``step_ms`` in ssm / attention / rest."""
    if eng.cuda:
        parts, kernels, mode = _profile_device(eng, steps)
        extra = {"breakdown": "profiler-kernels", "profiled": mode, "kernels_per_step": kernels,
                 "kernel_ms": sum(parts.values())}
        ssm, attn = parts["ssm"], parts["attention"]
    else:
        parts, total = _profile_host(eng, steps)
        ssm, attn = parts["ssm"], parts["attention"]
        ssm, attn = ssm * step_ms / total, attn * step_ms / total  # shares of the profiled steps, on step_ms
        extra = {"breakdown": "op-timers", "profiled": "eager"}
    rest = max(step_ms - ssm - attn, 0.0)
    return {**extra, "ssm_ms": ssm, "attention_ms": attn, "rest_ms": rest, "ssm_share": ssm / step_ms,
            "attention_share": attn / step_ms, "rest_share": rest / step_ms}


def _skip_row(what: str, need: int, free: int, **fields) -> dict:
    return {**fields, "status": "skipped",
            "reason": f"{what} needs {fmt_bytes(need)} but {fmt_bytes(free)} are free (at most {HEADROOM:.0%} used)"}


def _positive(b: DictConfig, *keys: str) -> None:
    for key in keys:
        vals = [int(v) for v in b[key]]
        if not vals or min(vals) < 1:
            raise ValueError(f"bench.{key} needs positive sizes, got {vals}")


def run_breakdown(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 2: share of the decode-step time in SSM state kernels, attention and the rest, per preset x
    strategy (standard decode) x batch x context (module doc)."""
    b = cfg.bench
    _positive(b, "batch", "context")
    strategies = [str(s) for s in b.strategies]
    bad = [s for s in strategies if s not in ("autoregressive", "replay")]
    if bad:
        raise ValueError(f"replay_fig2_breakdown times standard decode; bench.strategies may hold autoregressive "
                         f"and replay, got {bad}")
    device, dtype = str(cfg.device), C.resolve_dtype(str(cfg.dtype), str(cfg.device))
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters, prof = int(b.warmup), int(b.iters), int(b.profile_steps)
    steps = warmup + iters + prof + 2
    spec = SpecConfig(buffer_size=int(b.R))
    for preset in b.presets:
        mcfg = load_preset(preset)
        grid = [(s, bsz, T) for bsz in b.batch for T in b.context for s in strategies]
        fits = {g: point_fits(mcfg, g[0], batch=g[1], context=g[2], spec=spec, steps=steps, dtype=dtype,
                              device=device) for g in grid}
        ok = [g for g in grid if fits[g][0]]
        model = model_for(cfg, preset, max((g[2] for g in ok), default=1)) if ok else None
        for strategy, bsz, T in grid:
            base = dict(model=preset, strategy=strategy, batch=bsz, context=T, dtype=C.dtype_name(dtype),
                        R=spec.buffer_size if strategy == "replay" else None)
            fit, need, free = fits[(strategy, bsz, T)]
            if not fit:
                yield _skip_row(f"{preset} at batch {bsz}, context {T}", need, free, **base)
                continue
            eng = step_engine(model, strategy=strategy, batch=bsz, context=T, spec=spec, graph=graph, steps=steps)
            row = step_row(eng, warmup=warmup, iters=iters, **base, status="ok")
            row.update(breakdown_fields(eng, prof, row["ms_p50"]))
            log.info("%s %s B=%d T=%d: %.3f ms, ssm %.0f%% attention %.0f%%", preset, strategy, bsz, T,
                     row["ms_p50"], 100 * row["ssm_share"], 100 * row["attention_share"])
            del eng
            release(device)
            yield row
        del model
        release(device)


# Fig. 6, whole step ------------------------------------------------------------------------------------
def step_speedup_rows(cfg: DictConfig) -> Iterator[dict]:
    """Whole engine steps of standard decode, `autoregressive` vs `replay` (R = ``bench.step_R``), per preset
    of ``bench.step_presets`` at ``bench.step_batch`` / ``bench.step_context``: rows impl ``step_<strategy>``
    with ``stage: step`` (seed 000, Fig. 6 end-to-end part; goal P5: >= 1.45x on nemotron-h-4b)."""
    b = cfg.bench
    presets = list(b.get("step_presets") or [])
    if not presets:
        return
    device, dtype = str(cfg.device), C.resolve_dtype(str(cfg.dtype), str(cfg.device))
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters = int(b.warmup), int(b.iters)
    bsz, T, R = int(b.step_batch), int(b.step_context), int(b.step_R)
    spec, steps = SpecConfig(buffer_size=R), warmup + iters + 2
    for preset in presets:
        mcfg = load_preset(preset)
        for strategy in ("autoregressive", "replay"):
            fit, need, free = point_fits(mcfg, strategy, batch=bsz, context=T, spec=spec, steps=steps, dtype=dtype,
                                         device=device)
            if not fit:
                raise ValueError(f"replay_fig6_speedup step rows: {preset} at batch {bsz}, context {T} needs "
                                 f"{fmt_bytes(need)} but {fmt_bytes(free)} are free; lower bench.step_batch or "
                                 f"bench.step_context")
        model = model_for(cfg, preset, T)
        for strategy in ("autoregressive", "replay"):
            eng = step_engine(model, strategy=strategy, batch=bsz, context=T, spec=spec, graph=graph, steps=steps)
            yield step_row(eng, warmup=warmup, iters=iters, model=preset, impl=f"step_{strategy}", stage="step",
                           context=T, R=R if strategy == "replay" else None, L=1, status="ok",
                           dtype=C.dtype_name(model.dtype))
            del eng
            release(device)
        del model
        release(device)


# Fig. 10 -----------------------------------------------------------------------------------------------
def forward_samples(eng, *, warmup: int, iters: int) -> list[float]:
    """ms per verify forward: the engine's ``DecodeStep.forward`` (layout + model call) alone, on the static
    buffers of a started engine whose drafts are set (after ``time_steps``); a CUDA graph of it on CUDA."""
    if eng.step.drafts is None and eng.drafter is not None:
        raise ValueError("forward_samples needs an engine that has stepped (its drafts set); call time_steps first")
    if eng.graphed:
        return time_cuda_graph(eng.step.forward, warmup=warmup, iters=iters)
    with torch.no_grad():
        return time_eager(eng.step.forward, warmup=warmup, iters=iters, device=str(eng.model.device))


def run_propagation(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 10: `snapshot` vs `replay` verify of S drafts -- the SSM state kernel (``stage: kernel``, the
    accepted count the random drafts give: 0), the verify forward (``stage: forward``) and the whole engine step
    (``stage: step``), per preset x batch at ``bench.context``. Rows: impl ``<stage>_<strategy>``."""
    b = cfg.bench
    _positive(b, "batch")
    S, R, T = int(b.S), int(b.R), int(b.context)
    if S < 1 or R < S + 1 or T < 1:
        raise ValueError(f"replay_fig10_propagation needs S >= 1, R >= S + 1 (one call of pending + S drafts) and "
                         f"context >= 1, got S={S}, R={R}, context={T}")
    ctx = Ctx(cfg)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), ctx.device)
    warmup, iters = int(b.warmup), int(b.iters)
    spec, steps = SpecConfig(draft_len=S, buffer_size=R), warmup + iters + 2
    L = S + 1
    for preset in b.presets:
        mcfg, z = load_preset(preset), mixer_sizes(preset)
        for bsz in b.batch:
            for strategy in ("snapshot", "replay"):
                fit, need, free = point_fits(mcfg, strategy, batch=bsz, context=T, spec=spec, steps=steps,
                                             dtype=ctx.dtype, device=ctx.device)
                if not fit:
                    raise ValueError(f"replay_fig10_propagation: {preset} {strategy} at batch {bsz}, context {T} "
                                     f"needs {fmt_bytes(need)} but {fmt_bytes(free)} are free; lower bench.batch")
        model = model_for(cfg, preset, T + steps * L)
        for bsz in b.batch:
            base = dict(model=preset, batch=bsz, S=S, L=L, context=T, **z)
            samples, nbytes = snapshot_measure(ctx, bsz, L, z)
            yield ctx.row(samples, nbytes, **base, impl="kernel_snapshot", stage="kernel", strategy="snapshot")
            samples, nbytes, cyc = replay_measure(ctx, bsz, L, R, 0, z)
            yield ctx.row(samples, nbytes, **base, impl="kernel_replay", stage="kernel", strategy="replay", R=R,
                          accepted=0, flush_period=len(cyc))
            for strategy in ("snapshot", "replay"):
                eng = step_engine(model, strategy=strategy, batch=bsz, context=T, spec=spec, graph=graph,
                                  steps=steps)
                row = step_row(eng, warmup=warmup, iters=iters, **base, impl=f"step_{strategy}", stage="step",
                               R=R if strategy == "replay" else None, status="ok")
                fwd = forward_samples(eng, warmup=warmup, iters=iters)
                yield {**{k: v for k, v in row.items() if not k.startswith("ms_") and k not in ("samples_ms", "n")},
                       **summarize(fwd), "samples_ms": fwd, "impl": f"forward_{strategy}", "stage": "forward"}
                yield row
                del eng
                release(ctx.device)
        del model
        release(ctx.device)
