"""The PyTorch GDN prefill ops against their naive twins: the chunked WY scan (``ops/gdn/chunk.py``) equals the
per-token gated delta rule (``naive.gdn_recurrence_ref``) in output and final state, and ``l2norm`` equals its
fp32 reference. Odd sizes (L = 13 over chunks of 1, 4, 5 and 64; H = 3 value heads over G = 1 key head and
H = 6 over G = 2; N = 48, P = 80), float64 and float32, without and with an initial state."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import STATE_TOL, TOL, assert_close

from ssmspec.ops.gdn import gdn_chunk_scan, gdn_recurrence_ref, l2norm, l2norm_ref

# (atol, rtol) per input dtype: float64 runs both sides in float64 (the chunk scan returns its state in fp32)
CHUNK_TOL = {torch.float64: (1e-10, 1e-10), torch.float32: TOL[torch.float32]}
CHUNK_STATE_TOL = {torch.float64: (1e-5, 1e-5), torch.float32: STATE_TOL}
L2_TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-2, 1e-2)}

SHAPES = [pytest.param(dict(B=2, L=13, H=3, G=1, N=48, P=80), id="H3-G1-N48-P80"),
          pytest.param(dict(B=1, L=7, H=6, G=2, N=8, P=5), id="H6-G2-N8-P5")]
DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")]


def _inputs(B, L, H, G, N, P, dtype, seed=0):
    """q, k l2-normalised (B, L, G, N); v (B, L, H, P); g = −exp(A_log)·softplus(a + bias) <= 0, beta = sigmoid(b)
    (B, L, H); a state (B, H, N, P) fp32 -- as a GDN mixer hands them over."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2norm_ref(r(B, L, G, N)), l2norm_ref(r(B, L, G, N))
    a_log = torch.rand(H, generator=gen, dtype=torch.float64) * 2 - 1.5
    g = -a_log.exp() * torch.nn.functional.softplus(r(B, L, H) - 1.0)
    beta = torch.sigmoid(r(B, L, H))
    v = r(B, L, H, P)
    s0 = (0.3 * r(B, H, N, P)).float()
    return s0, tuple(t.to(dtype) for t in (q, k, v, g, beta))


@pytest.mark.parametrize("chunk", [1, 4, 5, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_scan_equals_recurrence(shape, dtype, initial, chunk):
    s0, args = _inputs(**shape, dtype=dtype)
    start = s0 if initial else None
    ref_state = s0 if initial else torch.zeros_like(s0)
    y_ref, s_ref = gdn_recurrence_ref(ref_state, *args)
    y, s = gdn_chunk_scan(*args, chunk_size=chunk, initial_state=start)
    assert y.shape == args[2].shape and y.dtype == dtype
    assert s.shape == s0.shape and s.dtype == torch.float32
    assert_close(y, y_ref, CHUNK_TOL[dtype], "y")
    assert_close(s, s_ref, CHUNK_STATE_TOL[dtype], "final state")


def test_chunk_scan_of_no_tokens_keeps_the_state():
    s0, args = _inputs(B=2, L=0, H=3, G=1, N=6, P=5, dtype=torch.float32)
    y, s = gdn_chunk_scan(*args, initial_state=s0)
    assert y.shape == (2, 0, 3, 5)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("shape", [(3, 5, 48), (2, 1, 7), (4, 0, 3)], ids=["3x5x48", "2x1x7", "empty"])
def test_l2norm_equals_reference(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    x[..., :1] *= 30.0  # one large channel: the norm is not near 1
    y = l2norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    atol, rtol = L2_TOL[dtype]
    torch.testing.assert_close(y, l2norm_ref(x), atol=atol, rtol=rtol)
    if x.numel():
        norms = y.double().norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=5e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=0)
