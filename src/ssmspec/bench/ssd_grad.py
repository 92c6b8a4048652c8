"""Benchmark of the SSD scan's forward + backward (seed 004, "Forward + Backward"): ``ssd_kernel_fwdbwd``.

Our trainable scan (``ssmspec.ops.ssd_grad.ssd_chunk_scan_trainable``, the call the training forward makes: the
one-kernel forward that saves checkpoint states, then the tile-parallel backward of ``ops/ssd_grad/triton.py``)
against mamba_ssm's ``mamba_chunk_scan_combined`` with its autograd backward, in the same run, per mixer size,
batch and sequence length; goal (P11): >= 2.4x at 32K tokens on forward + backward (seed 004 measured 2.42x on an H200).

Two phases per implementation: ``fwd`` is the forward with inputs that require grad (what a training step runs
first: ours saves its checkpoints, mamba_ssm its tensors), ``fwdbwd`` the forward then ``torch.autograd.grad`` of
y against a fixed random dy for every input (x, dt, A, B, C, D, and the initial state when
``bench.initial_state``). The backward's own time is fwdbwd - fwd. Rows of ``impl: ours`` carry ``speedup`` =
mamba_ssm's median over ours for the same phase and size, both from this run. Inputs as in
``bench/ssd.py:scan_inputs`` (x, B, C in ``cfg.dtype``, dt already discretized in fp32, mamba_ssm with
``dt_softplus=False``); mixer sizes from ``bench/ssd.py:mixer`` (``seed004``: H=8, P=N=64, G=1; or a model
preset's Mamba-2 mixer). Timing as in ``bench/ssd.py``: CUDA-graph replay of ``rot`` calls on input copies that
together exceed 4x L2, CUDA events (the graph holds the autograd backward too, so seed 004's autograd host
overhead at short sequences is not in these times); eager perf_counter on CPU.

Gradient agreement (where mamba_ssm runs): once per size, outside the timing, both gradients of the same loss;
``grad_rel`` holds, per input, ||ours - mamba_ssm|| / ||mamba_ssm|| and ``grad_rel_err`` the largest, on the ours
``fwdbwd`` row. ``bytes`` is the least the forward + backward must move (``fwdbwd_bytes``); ``hbm_fraction`` =
bytes / time / the measured copy bandwidth.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from omegaconf import DictConfig

from ssmspec.bench.kernels import Ctx, mamba_ssm_ops
from ssmspec.bench.ssd import F32, _copies, _grid, _measure, scan_bytes, scan_inputs
from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.ssd_grad import ssd_chunk_scan_trainable

log = logging.getLogger("ssmspec.bench.ssd_grad")
GRAD_INPUTS = ("x", "dt", "A", "B", "C", "D", "s0")
PHASES = ("fwd", "fwdbwd")


def fwdbwd_bytes(bsz: int, L: int, z: dict, act: int, *, initial_state: bool) -> int:
    """Least bytes of one forward + backward: the forward's (``scan_bytes``), then the backward reads x, dy, B, C
    and dt and writes dx, dB, dC and d dt (``act``-byte activations, fp32 dt), and reads / writes the initial
    state's gradient with one."""
    H, P, N, G = z["H"], z["P"], z["N"], z["G"]
    state = bsz * H * P * N * F32
    bwd = bsz * L * (3 * H * P * act + 4 * G * N * act + 2 * H * F32) + (state if initial_state else 0)
    return scan_bytes(bsz, L, z, act, initial_state=initial_state) + bwd


def grad_inputs(inp: dict, seed: int = 1) -> dict:
    """Leaf copies of the scan inputs that require grad, and ``dy`` (B, L, H, P): the fixed upstream gradient."""
    leaves = {k: (v.detach().clone().requires_grad_() if k in GRAD_INPUTS and v is not None else v)
              for k, v in inp.items()}
    g = torch.Generator(device=inp["x"].device).manual_seed(seed)
    leaves["dy"] = torch.empty_like(inp["x"]).normal_(generator=g)
    return leaves


def ours_call(i: dict, backend: str) -> Callable[[], tuple]:
    return lambda: ssd_chunk_scan_trainable(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], initial_state=i["s0"],
                                            backend=backend)


def mamba_call(chunk: Callable, i: dict, chunk_size: int) -> Callable[[], tuple]:
    return lambda: chunk(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=chunk_size, D=i["D"],
                         initial_states=i["s0"], dt_softplus=False, return_final_states=True)


def phase_fn(call: Callable[[], tuple], i: dict, phase: str) -> Callable[[], object]:
    """``fwd``: the call; ``fwdbwd``: the call, then the gradients of <y, dy> for every input that requires grad.
    Both with autograd on (the runner calls benches under ``no_grad``)."""
    wrt = [i[k] for k in GRAD_INPUTS if i.get(k) is not None]

    def run():
        with torch.enable_grad():
            y, s = call()
            if phase == "fwd":
                return y, s
            return torch.autograd.grad((y,), wrt, (i["dy"],))
    return run


def grad_agreement(a: Callable[[dict], Callable[[], tuple]], b: Callable[[dict], Callable[[], tuple]], inp: dict) -> dict:
    """{input: ||grad_a - grad_b|| / ||grad_b||} of <y, dy> for two implementations on the same inputs (``a`` and
    ``b`` make a call from an input set)."""
    out = {}
    grads = []
    for make in (a, b):
        i = grad_inputs(inp)
        grads.append(phase_fn(make(i), i, "fwdbwd")())
    names = [k for k in GRAD_INPUTS if inp.get(k) is not None]
    for k, ga, gb in zip(names, *grads):
        out[k] = ((ga.float() - gb.float()).norm() / gb.float().norm().clamp_min(1e-30)).item()
    return out


def run_ssd_fwdbwd(cfg: DictConfig) -> Iterator[dict]:
    """Ours (``impl: ours``, with the ``backend`` that ran: triton on CUDA, the reference on CPU) vs mamba_ssm
    (``impl: mamba_ssm``) for every mixer x batch x seqlen and both phases."""
    ctx = Ctx(cfg)
    b = cfg.bench
    _, chunk_m, why = mamba_ssm_ops()
    backend = str(b.get("backend", "auto"))
    cs = int(b.chunk_size)
    for name, z, bsz, L in _grid(b):
        init = bool(b.initial_state)
        inp = scan_inputs(bsz, L, z, ctx.dtype, ctx.device, initial_state=init)
        nbytes = {"fwd": scan_bytes(bsz, L, z, ctx.dtype.itemsize, initial_state=init),
                  "fwdbwd": fwdbwd_bytes(bsz, L, z, ctx.dtype.itemsize, initial_state=init)}
        rot = ctx.rotation(nbytes["fwdbwd"])
        sets = [grad_inputs(i) for i in _copies(inp, rot)]
        base = dict(model=name, batch=bsz, seqlen=L, **z, rot=rot, initial_state=init)
        ran = "triton" if use_triton(inp["x"], inp["dt"], inp["A"], inp["B"], backend=backend) else "reference"
        ours = {p: _measure(ctx, [phase_fn(ours_call(i, backend), i, p) for i in sets], nbytes[p], **base,
                            impl="ours", backend=ran, phase=p) for p in PHASES}
        if ran == "triton":  # the launch the defaults resolved to
            from ssmspec.ops.ssd_grad.triton import _sm_count, default_launch
            for row in ours.values():
                row.update(default_launch(L, z["P"], z["N"], itemsize=ctx.dtype.itemsize, chains=bsz * z["H"],
                                          heads=z["H"], groups=z["G"], bf16=ctx.dtype == torch.bfloat16,
                                          sms=_sm_count(torch.device(ctx.device))))
        big = bsz * L * z["H"] * z["P"] >= 2 ** 31
        if chunk_m is None:
            theirs = {p: dict(base, impl="mamba_ssm", phase=p, status="skipped", reason=why) for p in PHASES}
        elif big:  # a fault here would poison the CUDA context and end the whole run
            theirs = {p: dict(base, impl="mamba_ssm", phase=p, status="skipped",
                              reason="x has >= 2^31 elements: mamba_ssm 2.3.2's _chunk_scan_fwd indexes with 32-bit "
                                     "offsets and raised an illegal memory access in this run's grid on an H100")
                      for p in PHASES}
        else:
            theirs = {p: _measure(ctx, [phase_fn(mamba_call(chunk_m, i, cs), i, p) for i in sets], nbytes[p], **base,
                                  impl="mamba_ssm", phase=p, chunk_size=cs) for p in PHASES}
            if ours["fwdbwd"].get("status") == "ok" and theirs["fwdbwd"].get("status") == "ok":
                rel = grad_agreement(lambda i: ours_call(i, backend), lambda i: mamba_call(chunk_m, i, cs), inp)
                ours["fwdbwd"].update(grad_rel=rel, grad_rel_err=max(rel.values()))
        for p in PHASES:
            if ours[p].get("status") == "ok" and theirs[p].get("status") == "ok":
                ours[p]["speedup"] = theirs[p]["ms_p50"] / ours[p]["ms_p50"]
            yield ours[p]
            yield theirs[p]
        del sets, inp
        ctx.sync()
