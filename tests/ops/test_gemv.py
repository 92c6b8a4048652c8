"""The decode GEMV kernels (``ops/gemv``) vs their twins -- the norm ops followed by F.linear -- on odd sizes
(N, K not multiples of the interpreter's 16 x 32 blocks), and at the real layer sizes on the GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import TOL, assert_close

from ssmspec.ops.gemv import add_rms_norm_linear, gated_norm_linear, linear_small
from ssmspec.ops.norm import add_rms_norm, gated_rms_norm

N_ODD, K_ODD = 37, 70  # 3 blocks of 16 output rows (the last partial), 3 chunks of 32 channels (the last partial)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def _poisoned_slice(*shape, dtype, device, seed, pad=9):
    """(..., K) view into a wider NaN-filled tensor (row stride K + pad): a read past K shows up as NaN."""
    wide = torch.full((*shape[:-1], shape[-1] + pad), float("nan"), dtype=dtype, device=device)
    wide[..., :shape[-1]] = _randn(*shape, dtype=dtype, device=device, seed=seed)
    return wide[..., :shape[-1]]


def _linear(n, k, dtype, device, bias):
    w = _randn(n, k, dtype=dtype, device=device, seed=10, scale=k ** -0.5)
    return w, (_randn(n, dtype=dtype, device=device, seed=11) if bias else None)


def _residual_exact(r_k, r_r):
    """The new residual is one rounded fp32 add: exact, except that the CPU interpreter rounds fp32 -> bf16
    by truncation (see tests/ops/test_norm.py)."""
    exact = r_k.dtype != torch.bfloat16 or torch.cuda.is_available()
    torch.testing.assert_close(r_k, r_r, atol=0, rtol=0 if exact else 2 ** -7)


@pytest.mark.parametrize("rows,bias", [
    pytest.param((1, 1), False, id="M1"), pytest.param((3, 1), True, id="M3-bias"),
    pytest.param((2, 4), False, id="M8-B2-L4"), pytest.param((8,), True, id="M8-bias"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_small(rows, dtype, bias, device):
    x = _poisoned_slice(*rows, K_ODD, dtype=dtype, device=device, seed=0)
    w, b = _linear(N_ODD, K_ODD, dtype, device, bias)
    out = linear_small(x, w, b, backend="triton")
    assert out.shape == (*rows, N_ODD) and out.dtype == dtype
    assert_close(out, F.linear(x, w, b), TOL[dtype], "out")


@pytest.mark.parametrize("rows,has_residual,res_fp32", [  # every residual case, each M; a bias on the M = 3 cases
    pytest.param((1, 1), False, False, id="M1-first-block"), pytest.param((2, 4), False, False, id="M8-first-block"),
    pytest.param((3, 1), False, True, id="M3-first-block-fp32res"), pytest.param((2, 4), True, False, id="M8-residual"),
    pytest.param((3, 1), True, True, id="M3-residual-fp32res"), pytest.param((1, 1), True, True, id="M1-residual-fp32res"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_linear(rows, dtype, has_residual, res_fp32, device):
    x = _poisoned_slice(*rows, K_ODD, dtype=dtype, device=device, seed=0)
    rdt = torch.float32 if res_fp32 else dtype
    residual = _randn(*rows, K_ODD, dtype=rdt, device=device, seed=1, scale=3.0) if has_residual else None
    nw = _randn(K_ODD, dtype=dtype, device=device, seed=2, scale=0.2) + 1
    w, b = _linear(N_ODD, K_ODD, dtype, device, bias=rows[0] == 3)
    out_k, r_k = add_rms_norm_linear(x, residual, nw, w, b, eps=1e-5, residual_in_fp32=res_fp32, backend="triton")
    out_r, r_r = add_rms_norm_linear(x, residual, nw, w, b, eps=1e-5, residual_in_fp32=res_fp32, backend="reference")
    assert out_k.dtype == out_r.dtype == dtype and r_k.dtype == r_r.dtype
    assert_close(out_k, out_r, TOL[dtype], "out")
    _residual_exact(r_k, r_r)
    if not has_residual and not res_fp32:
        assert r_k is x  # nothing to add or cast: no copy, as add_rms_norm


@pytest.mark.parametrize("rows,group_size", [  # a bias past M = 1
    pytest.param((1, 1), K_ODD, id="M1-1group"), pytest.param((3, 1), 35, id="M3-2groups-odd"),
    pytest.param((2, 4), 35, id="M8-2groups-odd"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_linear(rows, dtype, group_size, device):
    y = _randn(*rows, K_ODD, dtype=dtype, device=device, seed=0)
    z = _poisoned_slice(*rows, K_ODD, dtype=dtype, device=device, seed=1)  # z: a slice of in_proj's output
    nw = _randn(K_ODD, dtype=dtype, device=device, seed=2, scale=0.2) + 1
    w, b = _linear(N_ODD, K_ODD, dtype, device, bias=rows[0] != 1)
    out_k = gated_norm_linear(y, z, nw, w, b, group_size=group_size, eps=1e-5, backend="triton")
    out_r = gated_norm_linear(y, z, nw, w, b, group_size=group_size, eps=1e-5, backend="reference")
    assert out_k.dtype == out_r.dtype == dtype
    assert_close(out_k, out_r, TOL[dtype], "out")


@pytest.mark.parametrize("split", [1, 3])
def test_split_k_slices_meet_in_one_launch(split, monkeypatch):
    """K in 1 or 3 slices (the interpreter's default is 2, above): every op equals its twin, the slices of one
    group of the gated norm straddle a slice boundary (groups of 35, slices of 32), the counters are left at zero
    for the next launch, and a second launch gives the same bits (the slices are summed in slice order)."""
    import ssmspec.ops.gemv.triton as T
    monkeypatch.setattr(T, "_INTERPRET_SPLIT", split)
    monkeypatch.setattr(T, "_COUNTERS", {})  # this test's weights alone (an earlier one's address may repeat)
    dev, dt = "cpu", torch.float32
    x = _poisoned_slice(3, 1, K_ODD, dtype=dt, device=dev, seed=0)
    z = _randn(3, 1, K_ODD, dtype=dt, device=dev, seed=1)
    res = _randn(3, 1, K_ODD, dtype=dt, device=dev, seed=2, scale=3.0)
    nw = _randn(K_ODD, dtype=dt, device=dev, seed=3, scale=0.2) + 1
    w, b = _linear(N_ODD, K_ODD, dt, dev, bias=True)
    calls = [lambda be: linear_small(x, w, b, backend=be),
             lambda be: add_rms_norm_linear(x, res, nw, w, b, eps=1e-5, backend=be)[0],
             lambda be: gated_norm_linear(x, z, nw, w, b, group_size=35, eps=1e-5, backend=be)]
    for call in calls:
        first = call("triton")
        assert_close(first, call("reference"), TOL[dt], "out")
        assert torch.equal(call("triton"), first)
    counters = [c for (d, ptr, _), c in T._COUNTERS.items() if ptr == w.data_ptr()]
    assert len(counters) == (split > 1) and all(int(c.abs().sum()) == 0 for c in counters)


def test_twins_are_the_unfused_ops():
    x, res = _randn(2, 1, 24, dtype=torch.float64, device="cpu", seed=0), _randn(2, 1, 24, dtype=torch.float64,
                                                                                   device="cpu", seed=1)
    nw, w = _randn(24, dtype=torch.float64, device="cpu", seed=2), _randn(5, 24, dtype=torch.float64, device="cpu", seed=3)
    h, r = add_rms_norm(x, res, nw, eps=1e-5, residual_in_fp32=True)
    out, r2 = add_rms_norm_linear(x, res, nw, w, eps=1e-5, residual_in_fp32=True)
    assert torch.equal(out, F.linear(h, w)) and torch.equal(r, r2)
    g = gated_rms_norm(x, res, nw, group_size=8, eps=1e-5)
    assert torch.equal(gated_norm_linear(x, res, nw, w, group_size=8, eps=1e-5), F.linear(g, w))


def _ones(*shape, device, dtype=torch.float32):
    return torch.ones(*shape, device=device, dtype=dtype)


@pytest.mark.parametrize("call,match", [
    pytest.param(lambda d: linear_small(_ones(17, 8, device=d), _ones(4, 8, device=d), backend="triton"), "F.linear",
                 id="M17"),
    pytest.param(lambda d: linear_small(_ones(2, 8, device=d), _ones(4, 8, device=d, dtype=torch.bfloat16),
                                        backend="triton"), "dtype", id="dtype-mismatch"),
    pytest.param(lambda d: linear_small(_ones(2, 8, device=d), _ones(4, 7, device=d), backend="triton"), "K=7",
                 id="K-mismatch"),
    pytest.param(lambda d: linear_small(_ones(2, 8, device=d), _ones(4, 8, device=d), _ones(5, device=d),
                                        backend="triton"), "bias", id="bias-shape"),
    pytest.param(lambda d: add_rms_norm_linear(_ones(2, 8, device=d), _ones(2, 7, device=d), _ones(8, device=d),
                                               _ones(4, 8, device=d), eps=1e-5, backend="triton"), "residual",
                 id="residual-shape"),
    pytest.param(lambda d: gated_norm_linear(_ones(2, 8, device=d), _ones(2, 8, device=d), _ones(8, device=d),
                                             _ones(4, 8, device=d), group_size=3, eps=1e-5, backend="triton"),
                 "group_size", id="group-not-dividing"),
    pytest.param(lambda d: linear_small(_ones(2, 8, device=d, dtype=torch.float64),
                                        _ones(4, 8, device=d, dtype=torch.float64), backend="triton"),
                 "backend='reference'", id="float64"),
])
def test_bad_input(call, match, device):
    with pytest.raises(ValueError, match=match):
        call(device)


# Real layer sizes: (N, K) of the projections a norm precedes, and out_proj after the gated norm
MAMBA2_27B = dict(d=2560, in_proj=10576, d_inner=5120, groups=1, res_fp32=True)
NEMOTRON_H_4B = dict(d=3072, in_proj=16496, d_inner=7168, groups=8, res_fp32=False, q=4096, kv=1024, d_ff=12288)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("sizes", [pytest.param(MAMBA2_27B, id="mamba2-2.7b"), pytest.param(NEMOTRON_H_4B, id="nemotron-h-4b")])
def test_real_sizes(m, sizes, device):
    bf = torch.bfloat16
    d, tol = sizes["d"], TOL[bf]
    x = _randn(m, 1, d, dtype=bf, device=device, seed=0)
    res = _randn(m, 1, d, dtype=torch.float32 if sizes["res_fp32"] else bf, device=device, seed=1)
    nw = _randn(d, dtype=bf, device=device, seed=2, scale=0.2) + 1
    h, r_unfused = add_rms_norm(x, res, nw, eps=1e-5, residual_in_fp32=sizes["res_fp32"])
    firsts = [sizes["in_proj"]] + [sizes[k] for k in ("q", "kv", "d_ff") if k in sizes]  # in_proj, attention, MLP
    for n in firsts:
        w, _ = _linear(n, d, bf, device, bias=False)
        out, r = add_rms_norm_linear(x, res, nw, w, eps=1e-5, residual_in_fp32=sizes["res_fp32"], backend="triton")
        ref, r_ref = add_rms_norm_linear(x, res, nw, w, eps=1e-5, residual_in_fp32=sizes["res_fp32"],
                                         backend="reference")
        assert_close(out, ref, tol, f"norm + ({n}, {d})")
        assert_close(out, F.linear(h, w), tol, f"norm + ({n}, {d}) vs F.linear")
        assert torch.equal(r, r_ref) and torch.equal(r, r_unfused)
        assert_close(linear_small(h, w, backend="triton"), F.linear(h, w), tol, f"({n}, {d})")
    I = sizes["d_inner"]
    y, z = _randn(m, 1, I, dtype=bf, device=device, seed=3), _randn(m, 1, I, dtype=bf, device=device, seed=4)
    nwg = _randn(I, dtype=bf, device=device, seed=5, scale=0.2) + 1
    w, _ = _linear(d, I, bf, device, bias=False)
    gs = I // sizes["groups"]
    out = gated_norm_linear(y, z, nwg, w, group_size=gs, eps=1e-5, backend="triton")
    assert_close(out, gated_norm_linear(y, z, nwg, w, group_size=gs, eps=1e-5, backend="reference"), tol, "out_proj")
    assert_close(out, F.linear(gated_rms_norm(y, z, nwg, group_size=gs, eps=1e-5), w), tol, "out_proj vs F.linear")
    down = [(d, sizes[k]) for k in ("q", "d_ff") if k in sizes]  # o_proj (K = heads x head_dim), down_proj
    for n, k in down:
        w, _ = _linear(n, k, bf, device, bias=False)
        a = _randn(m, 1, k, dtype=bf, device=device, seed=6)
        assert_close(linear_small(a, w, backend="triton"), F.linear(a, w), tol, f"({n}, {k})")


@pytest.mark.parametrize("fusion", ["all", "gemv"])
@pytest.mark.parametrize("preset,new", [pytest.param("tiny-mamba2", 2, id="tiny-mamba2-prefill-decode"),
                                        pytest.param("tiny-hybrid", 0, id="tiny-hybrid-prefill")])
def test_model_fused_decode_equals_unfused(preset, new, fusion, monkeypatch):
    """A model on the Triton backend (the interpreter on CPU) at a few rows takes the decode GEMVs -- with
    ``all`` the fused forms: norm + in_proj, gated norm + out_proj, and (tiny-hybrid) the attention's q/k/v and
    the MLP's up_proj; with ``gemv`` the plain GEMV for every projection, the norms their own launches -- and gives
    the logits of the cuBLAS path (the norm kernels then F.linear) up to fp32 rounding: a 5-token prefill, and
    (``new``) greedy decode steps (every strategy's decode on these kernels: tests/strategies/test_kernels_wired.py)."""
    from model_forward import parallel_logits

    import ssmspec.ops.gemv.triton as gemv_triton
    from ssmspec.engine.generate import generate
    from ssmspec.models import layers
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model

    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    monkeypatch.setenv("SSMSPEC_DECODE_FUSION", fusion)  # every decode kernel is opt-in (ops.dispatch)
    calls: dict[str, int] = {}
    for fn in ("add_rms_norm_linear_triton", "gated_norm_linear_triton", "linear_small_triton"):
        def spy(*a, _orig=getattr(gemv_triton, fn), _fn=fn, **k):
            calls[_fn] = calls.get(_fn, 0) + 1
            return _orig(*a, **k)
        monkeypatch.setattr(gemv_triton, fn, spy)
    model = build_model(load_preset(preset), seed=0)
    ids = torch.tensor([[5, 17, 33, 8, 90]])  # 5 rows: fused
    prompts = [[5, 17, 33, 8]]

    def run():
        calls.clear()
        logits = parallel_logits(model, ids)
        seq = generate(model, prompts, max_new_tokens=new, strategy="autoregressive", timing=False).sequences if new else None
        return logits, seq, dict(calls)

    fused, seq_fused, fused_calls = run()
    monkeypatch.setattr(layers, "DECODE_ROWS", 0)  # nothing is small enough: the unfused path
    unfused, seq_unfused, unfused_calls = run()
    n_mamba, n_layers = model.cfg.pattern.count("M"), len(model.cfg.pattern)
    assert unfused_calls == {}
    steps = 1 + new  # the parallel prefill, then generate: its prefill gives the first token, a decode step each next
    if fusion == "all":
        assert fused_calls["gated_norm_linear_triton"] == steps * n_mamba
        assert fused_calls["add_rms_norm_linear_triton"] >= steps * n_mamba
        assert fused_calls["linear_small_triton"] >= steps  # the LM head (and o_proj, down_proj)
    else:  # every projection of every block (in and out at least) and the LM head, no fused form
        assert set(fused_calls) == {"linear_small_triton"}
        assert fused_calls["linear_small_triton"] >= steps * (2 * n_layers + 1)
    torch.testing.assert_close(fused, unfused, atol=2e-5, rtol=2e-5)
    assert seq_fused == seq_unfused


def test_decode_fusion_is_opt_in(monkeypatch):
    """The models take the decode kernels SSMSPEC_DECODE_FUSION names (``all``, ``none`` or a list of parts; the
    plain GEMV by default, the fused forms only when asked); a bad value is one error naming the choices."""
    from ssmspec.models import layers
    from ssmspec.ops.dispatch import decode_fusion

    x, w = torch.randn(1, 8), torch.randn(4, 8)
    lin = torch.nn.Linear(8, 4).requires_grad_(False)
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    monkeypatch.delenv("SSMSPEC_DECODE_FUSION", raising=False)
    assert not layers.fused_decode(x, w) and decode_fusion() == {"gemv"}
    assert layers._decode_kernel("gemv", x, lin.weight)
    monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "none")
    assert not layers._decode_kernel("gemv", x, lin.weight) and decode_fusion() == frozenset()
    monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "all")
    assert layers.fused_decode(x, w) and decode_fusion() == {"conv_ssm", "gemv", "norm_gemv"}
    monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "gemv, conv_ssm")
    assert not layers.fused_decode(x, w) and decode_fusion() == {"conv_ssm", "gemv"}
    assert layers._decode_kernel("gemv", x, lin.weight)
    for bad in ("fast", "gemv,fast", ","):
        monkeypatch.setenv("SSMSPEC_DECODE_FUSION", bad)
        with pytest.raises(ValueError, match="SSMSPEC_DECODE_FUSION must be none, all or a comma-separated list"):
            layers.fused_decode(x, w)


@pytest.mark.parametrize("elem", [2, 4])
def test_gpu_blocks_fit_shared_memory(elem):
    """The rule's blocks, at every projection shape of the GPU presets and at both weight widths, keep the
    pipelined W and h tiles (num_stages of each) within an H100's 227 KB of shared memory per block (fp32 weights
    at bf16's blocks asked 240 KB: the GPU tests' fp32 models failed to launch), and the slices cover K."""
    import triton

    import ssmspec.ops.gemv.triton as T
    for N, K in [(10576, 2560), (2560, 5120), (16496, 3072), (3072, 7168), (12288, 3072), (3072, 12288),
                 (16, 2048), (50288, 2560)]:
        cfg = T._config(N, K, 132, elem)
        smem = cfg["num_stages"] * (cfg["BLOCK_N"] + T._BLOCK_M) * cfg["BLOCK_K"] * elem
        assert smem <= 227 * 1024, (N, K, elem, cfg, smem)
        assert 1 <= cfg["SPLIT"] <= triton.cdiv(K, cfg["BLOCK_K"])
        assert triton.cdiv(N, cfg["BLOCK_N"]) * cfg["SPLIT"] <= max(132, triton.cdiv(N, cfg["BLOCK_N"]))


def test_no_counters_are_made_inside_a_graph_capture(monkeypatch):
    """A weight's first split-K call during a CUDA graph capture makes no counters (zeros made then would be a
    graph node, zero only once the graph replays): that call runs K whole in every program and still equals the
    twin; the next call outside a capture makes them and splits K."""
    import ssmspec.ops.gemv.triton as T
    monkeypatch.setattr(T, "_INTERPRET_SPLIT", 3)
    monkeypatch.setattr(T, "_COUNTERS", {})  # this test's weights alone (an earlier one's address may repeat)
    x = _randn(2, K_ODD, dtype=torch.float32, device="cpu", seed=0)
    w, b = _linear(N_ODD, K_ODD, torch.float32, "cpu", bias=True)
    launches = []
    orig = T._norm_gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return orig[grid]
    monkeypatch.setattr(T, "_norm_gemv_kernel", Spy())
    asked = []  # the devices whose capture state was asked: the weight's (its counters live there)
    monkeypatch.setattr(T, "capturing", lambda device: asked.append(device) or True)
    out = T.linear_small_triton(x, w, b)
    assert launches == [(3, 1)] and not [k for k in T._COUNTERS if k[1] == w.data_ptr()]
    assert_close(out, F.linear(x, w, b), TOL[torch.float32], "out")
    assert asked == [w.device]
    monkeypatch.setattr(T, "capturing", lambda device: False)
    assert_close(T.linear_small_triton(x, w, b), F.linear(x, w, b), TOL[torch.float32], "out")
    assert launches[-1] == (3, 3) and [k for k in T._COUNTERS if k[1] == w.data_ptr()]


def test_a_draft_takes_its_own_decode_kernels(monkeypatch):
    """SSMSPEC_DRAFT_DECODE_FUSION sets the draft model's decode kernels (``decode_fusion_scope`` around the draft
    engine's calls) and leaves the target's: with the norms fused into the draft's GEMVs, only draft calls reach
    the fused kernels, and greedy replay + draft_model emits the autoregressive tokens as without it. Unset, the
    draft takes the target's setting; a bad value is one error naming the variable; a scope ends where it ends."""
    import ssmspec.ops.gemv.triton as gemv_triton
    from ssmspec.drafting import make_drafter
    from ssmspec.engine.generate import generate
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model
    from ssmspec.ops.dispatch import decode_fusion, decode_fusion_scope, draft_decode_fusion

    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    monkeypatch.delenv("SSMSPEC_DECODE_FUSION", raising=False)
    monkeypatch.delenv("SSMSPEC_DRAFT_DECODE_FUSION", raising=False)
    assert draft_decode_fusion() is None
    with decode_fusion_scope(frozenset({"norm_gemv"})):
        assert decode_fusion() == {"norm_gemv"}
        with decode_fusion_scope(None):  # no scope: the enclosing one stands
            assert decode_fusion() == {"norm_gemv"}
    assert decode_fusion() == {"gemv"}
    monkeypatch.setenv("SSMSPEC_DRAFT_DECODE_FUSION", "gemv,fast")
    with pytest.raises(ValueError, match="SSMSPEC_DRAFT_DECODE_FUSION must be none, all or a comma-separated"):
        draft_decode_fusion()

    target = build_model(load_preset("tiny-mamba2"), seed=0)
    draft = build_model(load_preset("tiny-mamba2"), seed=1)
    prompts = [[5, 17, 33, 8], [9, 10, 11]]
    new = 3
    ref = generate(target, prompts, max_new_tokens=new, strategy="autoregressive", timing=False).sequences
    seen: list[tuple[str, bool]] = []  # (kernel, whose weight: the draft's)
    draft_weights = {p.data_ptr() for p in draft.parameters()}
    for fn in ("add_rms_norm_linear_triton", "gated_norm_linear_triton"):
        def spy(*a, _orig=getattr(gemv_triton, fn), _fn=fn, **k):
            seen.append((_fn, any(t.data_ptr() in draft_weights for t in a if isinstance(t, torch.Tensor))))
            return _orig(*a, **k)
        monkeypatch.setattr(gemv_triton, fn, spy)
    outs = []
    for value in (None, "gemv,norm_gemv"):
        if value is None:
            monkeypatch.delenv("SSMSPEC_DRAFT_DECODE_FUSION")
        else:
            monkeypatch.setenv("SSMSPEC_DRAFT_DECODE_FUSION", value)
        for kind, opts in (("draft_model", {}), ("async_draft", {"fanout": [2, 1, 1], "backup": "draft"})):
            seen.clear()
            drafter = make_drafter(kind, draft=draft, draft_len=2, **opts)  # async: its speculation's calls too
            outs.append(generate(target, prompts, max_new_tokens=new, strategy="replay", drafter=drafter,
                                 timing=False).sequences)
            if value is None:
                assert seen == []  # the target's default: no fused norm anywhere
            else:
                n_draft_layers = draft.cfg.pattern.count("M")
                assert seen and all(mine for _, mine in seen), f"{kind}: a target call took the draft's kernels"
                assert sum(fn == "gated_norm_linear_triton" for fn, _ in seen) >= n_draft_layers * 2, kind
    assert all(out == ref for out in outs)
