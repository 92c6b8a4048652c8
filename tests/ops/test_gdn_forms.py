"""The forms fla-core's gated delta rule kernels take, on our GDN ops (``ops/gdn/forms.py``): q and k raw with the
l2norm in the op (``use_qk_l2norm``), the raw gate (g=None; a, A_log, dt_bias), beta as logits (``beta_logits``),
and packed sequences (``cu_seqlens``) on the chunked prefill.

The law: an op given the new forms equals the same op given them resolved by the documented formulas
(q/‖q‖, −exp(A_log)·softplus(a + dt_bias), sigmoid(b)) -- bit for bit on the PyTorch paths, at the kernel
tolerances on the Triton kernel (its forms run in-kernel in fp32; small shapes under the CPU interpreter).
A packed call equals one call per sequence, with and without initial states. On a GPU with fla-core
importable, the ops at Qwen3.5-4B's GDN sizes equal fla's ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` run with ``use_qk_l2norm_in_kernel=True`` and ``cu_seqlens``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import STATE_TOL, TOL, assert_close, rel_err

from ssmspec.ops.gdn import gdn_chunk_scan, gdn_multistep, gdn_recurrent_update, l2norm

SMALL = dict(H=4, G=2, N=16, P=24)  # interpreter-sized: two value heads per key head, P not a power of two
QWEN35 = dict(H=32, G=16, N=128, P=128)  # Qwen3.5-4B's GDN mixer (conf/model/qwen3.5-4b.yaml)
FORMS = [pytest.param(("l2norm",), id="l2norm"), pytest.param(("gate",), id="raw-gate"),
         pytest.param(("beta",), id="beta-logits"), pytest.param(("l2norm", "gate", "beta"), id="all")]


def raw_inputs(B, L, H, G, N, P, dtype, device, seed=0, param_dtype=torch.float32) -> dict:
    """What a Qwen3.5 mixer has before the gated delta rule: q, k after the conv (not normed), v, the raw gate
    input a and beta logits b (B, L, H), and its parameters A_log, dt_bias (H,)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = dict(q=2 * r(B, L, G, N), k=2 * r(B, L, G, N), v=r(B, L, H, P), a=r(B, L, H), b=r(B, L, H))
    out = {n: x.to(device, dtype) for n, x in t.items()}
    out["A_log"] = (torch.rand(H, generator=gen) * 2 - 1.5).to(device, param_dtype)
    out["dt_bias"] = (0.5 * r(H)).to(device, param_dtype)
    return out


def resolved(raw: dict) -> tuple:
    """(q, k, g, beta) as today's ops take them, by the documented formulas (the law's right-hand side)."""
    cd = torch.promote_types(raw["a"].dtype, torch.float32)
    g = -torch.exp(raw["A_log"].float()).to(cd) * F.softplus(raw["a"].to(cd) + raw["dt_bias"].to(cd))
    return l2norm(raw["q"]), l2norm(raw["k"]), g, torch.sigmoid(raw["b"].to(cd))


def with_forms(raw: dict, forms: tuple) -> tuple[tuple, dict]:
    """The call's (q, k, g, beta) and keyword arguments with ``forms`` given raw and the others resolved."""
    q, k, g, beta = resolved(raw)
    kw = {}
    if "l2norm" in forms:
        q, k, kw["use_qk_l2norm"] = raw["q"], raw["k"], True
    if "gate" in forms:
        g, kw["a"], kw["A_log"], kw["dt_bias"] = None, raw["a"], raw["A_log"], raw["dt_bias"]
    if "beta" in forms:
        beta, kw["beta_logits"] = raw["b"], True
    return (q, k, g, beta), kw


def _state(rows, H, N, P, device, seed=1):
    return (0.3 * torch.randn(rows, H, N, P, generator=torch.Generator().manual_seed(seed))).to(device)


# the law on the PyTorch paths: bit for bit ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("forms", FORMS)
def test_reference_forms_equal_resolved(forms, dtype):
    raw = raw_inputs(2, 7, **SMALL, dtype=dtype, device="cpu")
    (q, k, g, beta), kw = with_forms(raw, forms)
    s0 = _state(2, SMALL["H"], SMALL["N"], SMALL["P"], "cpu")
    y, s = gdn_chunk_scan(q, k, raw["v"], g, beta, chunk_size=4, initial_state=s0, **kw)
    y_ref, s_ref = gdn_chunk_scan(*resolved(raw)[:2], raw["v"], *resolved(raw)[2:], chunk_size=4, initial_state=s0)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref), "chunk scan"
    st, st_ref = s0.clone(), s0.clone()
    y = gdn_multistep(st, q, k, raw["v"], g, beta, backend="reference", **kw)
    y_ref = gdn_multistep(st_ref, *resolved(raw)[:2], raw["v"], *resolved(raw)[2:], backend="reference")
    assert torch.equal(y, y_ref) and torch.equal(st, st_ref), "multistep (reference)"


# the Triton decode kernel: forms in-kernel ---------------------------------------------------------------
MULTI = [  # (dtype, L, forms, options)
    pytest.param(torch.float32, 3, ("l2norm",), {}, id="fp32-L3-l2norm"),
    pytest.param(torch.float32, 3, ("gate",), {}, id="fp32-L3-raw-gate"),
    pytest.param(torch.bfloat16, 3, ("beta",), dict(count=True), id="bf16-L3-beta-logits-update_count"),
    pytest.param(torch.bfloat16, 3, ("l2norm", "gate", "beta"), dict(rows=True, bf16_params=True),
                 id="bf16-L3-all-state_indices-bf16-params"),
    pytest.param(torch.float32, 2, ("l2norm", "gate", "beta"), dict(count=True, output=False), id="fp32-L2-all-replay"),
]


@pytest.mark.parametrize("dtype,L,forms,opts", MULTI)
def test_multistep_kernel_forms(dtype, L, forms, opts, device):
    """The kernel given the new forms equals the kernel given them resolved, and the reference given the same forms."""
    H, G, N, P = SMALL.values()
    raw = raw_inputs(2, L, H, G, N, P, dtype, device,
                     param_dtype=torch.bfloat16 if opts.get("bf16_params") else torch.float32)
    (q, k, g, beta), kw = with_forms(raw, forms)
    kw.update(output=opts.get("output", True))
    s0 = _state(3, H, N, P, device)
    if opts.get("rows"):
        kw["state_batch_indices"] = torch.tensor([2, 0], device=device)
        s0[1] = float("nan")  # nobody's state: never read
    else:
        s0 = s0[:2].clone()
    if opts.get("count"):
        kw["update_count"] = torch.tensor([1, L], device=device)
    plain = {n: kw[n] for n in ("output", "state_batch_indices", "update_count") if n in kw}
    states = [s0.clone() for _ in range(3)]
    y_new = gdn_multistep(states[0], q, k, raw["v"], g, beta, backend="triton", **kw)
    # the kernel's l2norm stays in fp32: resolve q, k in fp32 too, so only fp32 rounding separates the two
    q32, k32 = (l2norm(raw[n].float()) for n in ("q", "k")) if "l2norm" in forms else (q, k)
    y_res = gdn_multistep(states[1], q32, k32, raw["v"], *resolved(raw)[2:], backend="triton", **plain)
    y_ref = gdn_multistep(states[2], q, k, raw["v"], g, beta, backend="reference", **kw)
    live = [0, 2] if opts.get("rows") else [0, 1]
    if kw["output"]:
        assert_close(y_new, y_res, TOL[dtype], "y vs resolved")
        assert_close(y_new, y_ref, TOL[dtype], "y vs reference")
    else:
        assert y_new is None
    assert_close(states[0][live], states[1][live], STATE_TOL, "state vs resolved")
    # the reference's l2norm rounds q, k to their dtype first (as the mixer does): a bf16 rounding apart
    ref_tol = TOL[dtype] if "l2norm" in forms and dtype != torch.float32 else STATE_TOL
    assert_close(states[0][live], states[2][live], ref_tol, "state vs reference")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_recurrent_update_forms(backend, device):
    """One token with every form raw, a pad sequence among them: equals the update given them resolved."""
    H, G, N, P = SMALL.values()
    raw = {n: t[:, 0] if t.dim() > 1 else t for n, t in raw_inputs(3, 1, H, G, N, P, torch.float32, device).items()}
    (q, k, g, beta), kw = with_forms(raw, ("l2norm", "gate", "beta"))
    idx = torch.tensor([1, -1, 0], device=device)
    s0 = _state(2, H, N, P, device)
    st, st_res = s0.clone(), s0.clone()
    y = gdn_recurrent_update(st, q, k, raw["v"], g, beta, state_batch_indices=idx, backend=backend, **kw)
    y_res = gdn_recurrent_update(st_res, *resolved(raw)[:2], raw["v"], *resolved(raw)[2:], state_batch_indices=idx,
                                 backend=backend)
    assert_close(y, y_res, TOL[torch.float32], "y")
    assert_close(st, st_res, STATE_TOL, "state")
    assert torch.all(y[1] == 0), "a pad sequence outputs zeros"


# packed sequences ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [pytest.param([5, 0, 13, 1], id="5-0-13-1"), pytest.param([9], id="one")])
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype,forms", [pytest.param(torch.float64, (), id="fp64"),
                                         pytest.param(torch.float32, ("l2norm", "gate", "beta"), id="fp32-all-forms")])
def test_varlen_equals_per_sequence(lens, initial, dtype, forms):
    """A packed call (B == 1, cu_seqlens) equals one call per sequence: outputs in packed order, one final state
    per sequence (an empty sequence keeps its initial state), chunks counted from each sequence's start."""
    H, G, N, P = SMALL.values()
    T = sum(lens)
    raw = raw_inputs(1, T, H, G, N, P, dtype, "cpu", seed=3)
    (q, k, g, beta), kw = with_forms(raw, forms)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    s0 = _state(len(lens), H, N, P, "cpu") if initial else None
    y, s = gdn_chunk_scan(q, k, raw["v"], g, beta, chunk_size=4, initial_state=s0, cu_seqlens=cu, **kw)
    assert y.shape == (1, T, H, P) and s.shape == (len(lens), H, N, P)
    tol = (1e-10, 1e-10) if dtype == torch.float64 else TOL[torch.float32]
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = {n: t[:, lo:hi] if t.dim() > 1 else t for n, t in raw.items()}
        (q1, k1, g1, b1), kw1 = with_forms(one, forms)
        y1, s1 = gdn_chunk_scan(q1, k1, one["v"], g1, b1, chunk_size=4,
                                initial_state=None if s0 is None else s0[i:i + 1], **kw1)
        assert_close(y[:, lo:hi], y1, tol, f"y of sequence {i}")
        assert_close(s[i], s1[0], tol if dtype == torch.float64 else STATE_TOL, f"final state of sequence {i}")


# bad input -----------------------------------------------------------------------------------------------
def _bad_cases():
    raw = raw_inputs(1, 6, **SMALL, dtype=torch.float32, device="cpu")
    q, k, g, beta = resolved(raw)
    v, a, A_log, dt_bias = raw["v"], raw["a"], raw["A_log"], raw["dt_bias"]
    s4 = _state(2, SMALL["H"], SMALL["N"], SMALL["P"], "cpu")
    return {
        "g-and-a": (lambda: gdn_chunk_scan(q, k, v, g, beta, a=a, A_log=A_log, dt_bias=dt_bias), "not both"),
        "a-without-A_log": (lambda: gdn_chunk_scan(q, k, v, None, beta, a=a, dt_bias=dt_bias), "A_log"),
        "no-gate": (lambda: gdn_multistep(s4[:1], q, k, v, None, beta, backend="reference"), "or pass g"),
        "A_log-per-group": (lambda: gdn_multistep(s4[:1], q, k, v, None, beta, a=a, A_log=A_log[:2], dt_bias=dt_bias,
                                                  backend="reference"), "one per value head"),
        "cu-float": (lambda: gdn_chunk_scan(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 6.0])), "integer"),
        "cu-short-of-L": (lambda: gdn_chunk_scan(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 5])), "end at"),
        "cu-decreasing": (lambda: gdn_chunk_scan(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 2, 6])),
                          "never decrease"),
        "cu-with-B2": (lambda: gdn_chunk_scan(*(t.expand(2, *t.shape[1:]) for t in (q, k, v, g, beta)),
                                              cu_seqlens=torch.tensor([0, 6])), "B == 1"),
        "cu-states": (lambda: gdn_chunk_scan(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 1, 3, 6]),
                                             initial_state=s4), "one state per sequence"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_forms_name_the_fix(case):
    call, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=match):
        call()


# fla-core on its own grids (GPU) -------------------------------------------------------------------------
def _fla_args(raw: dict, H: int) -> dict:
    """Our raw tensors in fla's layout: q, k (B, T, HV, K) (the key heads repeated to the value heads, as
    transformers hands them to fla), v (B, T, HV, V), g (B, T, HV) the fp32 log-decay, beta (B, T, HV) fp32."""
    rep = H // raw["q"].shape[2]
    _, _, g, beta = resolved(raw)
    return dict(q=raw["q"].repeat_interleave(rep, dim=2), k=raw["k"].repeat_interleave(rep, dim=2), v=raw["v"],
                g=g, beta=beta)


def _ours(raw: dict) -> tuple[tuple, dict]:
    return with_forms(raw, ("l2norm", "gate", "beta"))


@pytest.mark.gpu
def test_chunk_scan_matches_fla_chunk_varlen():
    """Packed prefill of three sequences from their own states at Qwen3.5-4B sizes: our chunk scan with every
    form raw equals fla's chunk kernel with in-kernel l2norm and cu_seqlens."""
    device = "cuda"
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    H, G, N, P = QWEN35.values()
    cu = torch.tensor([0, 100, 357, 512], device=device)
    raw = raw_inputs(1, 512, H, G, N, P, torch.bfloat16, device)
    s0 = _state(3, H, N, P, device)
    (q, k, g, beta), kw = _ours(raw)
    y, s = gdn_chunk_scan(q, k, raw["v"], g, beta, initial_state=s0, cu_seqlens=cu, **kw)
    y_fla, s_fla = fla.chunk_gated_delta_rule(**_fla_args(raw, H), initial_state=s0.clone(), output_final_state=True,
                                              cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    assert rel_err(y, y_fla) < 1e-2, f"y vs fla chunk: relative error {rel_err(y, y_fla):.2e}"
    assert rel_err(s, s_fla) < 1e-2, f"final states vs fla chunk: relative error {rel_err(s, s_fla):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 4])
def test_multistep_matches_fla_fused_recurrent(L):
    """Decode from stored states, batch 8: our kernel with every form in-kernel equals fla's fused recurrent
    kernel with use_qk_l2norm_in_kernel."""
    device = "cuda"
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    H, G, N, P = QWEN35.values()
    raw = raw_inputs(8, L, H, G, N, P, torch.bfloat16, device)
    s0 = _state(8, H, N, P, device)
    st = s0.clone()
    (q, k, g, beta), kw = _ours(raw)
    y = gdn_multistep(st, q, k, raw["v"], g, beta, backend="triton", **kw)
    y_fla, s_fla = fla.fused_recurrent_gated_delta_rule(**_fla_args(raw, H), initial_state=s0.clone(),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(y, y_fla, TOL[torch.bfloat16], "y vs fla fused recurrent")
    assert_close(st, s_fla, (1e-3, 1e-3), "state vs fla fused recurrent")


@pytest.mark.gpu
def test_chunk_scan_matches_fla_fused_recurrent_varlen():
    """fla's fused recurrent kernel over packed sequences (cu_seqlens) and our packed chunk scan agree."""
    device = "cuda"
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    H, G, N, P = QWEN35.values()
    cu = torch.tensor([0, 7, 8, 77], device=device)
    raw = raw_inputs(1, 77, H, G, N, P, torch.bfloat16, device, seed=4)
    s0 = _state(3, H, N, P, device)
    (q, k, g, beta), kw = _ours(raw)
    y, s = gdn_chunk_scan(q, k, raw["v"], g, beta, initial_state=s0, cu_seqlens=cu, **kw)
    y_fla, s_fla = fla.fused_recurrent_gated_delta_rule(**_fla_args(raw, H), initial_state=s0.clone(),
                                                        output_final_state=True, cu_seqlens=cu,
                                                        use_qk_l2norm_in_kernel=True)
    assert_close(y, y_fla, TOL[torch.bfloat16], "y vs fla fused recurrent (varlen)")
    # the states: norm-wise (our chunk scan rounds its bf16 WY blocks; elementwise, 0.1% of entries sat 3e-3 apart
    # on an H200, against fla's fp32 recurrence)
    assert float((s - s_fla).norm() / s_fla.norm()) < 1e-2, "final states vs fla fused recurrent (varlen)"
