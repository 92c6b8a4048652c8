"""Microbenchmark of one Mamba-2 decode step's conv + SSM update (issue 26 item 1): our fused kernel
(``ops.conv_ssm_update``, one launch) vs our unfused pair (``causal_conv1d_update`` then
``selective_state_update``, what ``autoregressive`` ran before) vs causal-conv1d's ``causal_conv1d_update`` +
mamba_ssm's ``selective_state_update`` (the baseline's two kernels, called as mamba_ssm's Mamba-2 layer calls
them at decode; ``status: skipped`` where either package cannot be imported).

    from ssmspec.bench.conv_ssm import time_conv_ssm
    rows = time_conv_ssm("mamba2-2.7b", 8)   # {"fused": {...}, "unfused": {...}, "mamba_ssm": {...}, ...}

Each impl is timed as CUDA-graph replays (``bench.timing.time_cuda_graph``) of ``rot`` calls, each on its own
copy of the conv and SSM states, ``rot`` chosen so the copies together exceed 4x the L2 cache (the state would
otherwise be read from L2 at small batch); a sample is the replay time over ``rot``. Each row: ms_p50 / p20 /
p80 and the raw samples; ``bytes`` = the fewest bytes the fused step must move (SSM state read and written,
conv state read and written, xbc and dt read, y written; weights once); ``hbm_fraction`` against the measured
copy bandwidth. ``speedup_vs_unfused`` and ``speedup_vs_mamba_ssm`` are ratios of medians of this one run.
On CPU (no GPU) the reference ops are timed eagerly, a smoke run only.
"""
from __future__ import annotations

import math

import torch

from ssmspec.bench.timing import hbm_fraction, measure_hbm_bandwidth, summarize, time_cuda_graph, time_eager
from ssmspec.models.config import load_preset
from ssmspec.ops.causal_conv1d import causal_conv1d_update
from ssmspec.ops.conv_ssm_update import conv_ssm_update
from ssmspec.ops.selective_state_update import selective_state_update

ROTATION_CAP = 256  # most state copies one graph cycles through


def _mamba_ssm_pair():
    try:
        from causal_conv1d import causal_conv1d_update as conv
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu
    except Exception as e:  # noqa: BLE001 -- any import failure means: no baseline on this machine
        return None, f"causal-conv1d / mamba_ssm not importable: {type(e).__name__}: {e}"
    return (conv, ssu), ""


def _step_fns(impl: str, c, w: dict, xbc, dt, states, pair):
    """One decode step of ``impl`` per (conv_state, ssm_state) copy."""
    H, P, G, N = c.ssm_heads, c.head_dim, c.n_groups, c.state_size
    bsz = xbc.shape[0]
    sizes = dict(heads=H, head_dim=P, groups=G, state_size=N)
    lim = (c.dt_min_limit, c.dt_max_limit)
    fns = []
    for cs, ss, ws in states:
        if impl == "fused":
            fns.append(lambda cs=cs, ss=ss, ws=ws: conv_ssm_update(
                xbc, cs, w["conv"], w["bias"], ss, dt, w["A"], w["D"], w["dt_bias"], **sizes, dt_limit=lim,
                workspace=ws))
            continue

        def unfused(cs=cs, ss=ss):
            if impl == "mamba_ssm":
                post = pair[0](xbc, cs, w["conv"], w["bias"], "silu")  # (B, conv_dim)
            else:
                post = causal_conv1d_update(xbc[:, None], cs, w["conv"], w["bias"])[:, 0]
            x, B, C = post.split([H * P, G * N, G * N], dim=-1)
            x, B, C = x.reshape(bsz, H, P), B.reshape(bsz, G, N), C.reshape(bsz, G, N)
            if impl == "mamba_ssm":
                return pair[1](ss, x, dt[..., None].expand(-1, -1, P), w["A"][:, None, None].expand(H, P, N), B, C,
                               D=w["D"][:, None].expand(H, P), dt_bias=w["dt_bias"][:, None].expand(H, P),
                               dt_softplus=True, dt_limit=lim)
            return selective_state_update(ss, x, dt, w["A"], B, C, w["D"], dt_bias=w["dt_bias"], dt_softplus=True,
                                          dt_limit=lim)
        fns.append(unfused)
    return fns


def time_conv_ssm(model_preset: str, batch: int, *, device: str | None = None, dtype: torch.dtype = torch.bfloat16,
                  warmup: int = 3, iters: int = 20, seed: int = 0) -> dict:
    """ms per decode step of one Mamba-2 mixer of ``model_preset`` at ``batch`` (see the module docstring)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    c = load_preset(model_preset)
    H, P, G, N, W, cd = c.ssm_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel, c.conv_dim
    act = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    w = dict(conv=r(cd, W, scale=0.4).to(dtype), bias=r(cd, scale=0.2).to(dtype) if c.conv_bias else None,
             A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device), D=r(H), dt_bias=r(H, scale=0.5))
    row = r(batch, c.d_inner + cd + H).to(dtype)  # in_proj's z | xbc | dt: the kernels read strided views
    xbc, dt = row[:, c.d_inner:c.d_inner + cd], row[:, c.d_inner + cd:] - 3.0
    ssm_bytes, conv_bytes = batch * H * P * N * 4, batch * cd * (W - 1) * act
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    rot = max(1, min(ROTATION_CAP, math.ceil(4 * l2 / (ssm_bytes + conv_bytes)))) if cuda else 1
    nbytes = 2 * (ssm_bytes + conv_bytes) + batch * (cd + H * P + H) * act + cd * W * act
    peak = measure_hbm_bandwidth(device) if cuda else None
    pair, why = _mamba_ssm_pair() if cuda else (None, "CPU: no baseline")
    out = dict(model=model_preset, batch=batch, H=H, P=P, N=N, G=G, W=W, rot=rot, bytes=nbytes,
               dtype=str(dtype).removeprefix("torch."), timing="cuda_graph" if cuda else "eager", peak_gbps=peak)
    for impl in ("fused", "unfused", "mamba_ssm"):
        if impl == "mamba_ssm" and pair is None:
            out[impl] = dict(status="skipped", reason=why)
            continue
        states = [(r(batch, cd, W - 1).to(dtype), r(batch, H, P, N, scale=0.1),
                   torch.zeros(batch * G, dtype=torch.int32, device=device)) for _ in range(rot)]
        fns = _step_fns(impl, c, w, xbc, dt, states, pair)

        def step(fns=fns):
            for f in fns:
                f()
        time = time_cuda_graph if cuda else lambda f, warmup, iters: time_eager(f, warmup, iters, device=device)
        samples = [s / rot for s in time(step, warmup=warmup, iters=iters)]
        out[impl] = dict(status="ok", **summarize(samples), samples_ms=samples,
                         hbm_fraction=hbm_fraction(nbytes, summarize(samples)["ms_p50"], peak) if peak else None)
        del states, fns
    for other in ("unfused", "mamba_ssm"):
        if out[other]["status"] == "ok":
            out[f"speedup_vs_{other}"] = out[other]["ms_p50"] / out["fused"]["ms_p50"]
    return out
