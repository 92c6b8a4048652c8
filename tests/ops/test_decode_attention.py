"""Decode attention over the KV cache (split-K Triton kernel) vs its SDPA twin, and ``KVCache`` wired to it.

Slots a row must not read (before ``start``, at or past ``length - kv_hide``, past ``ctx_len``) are NaN in
the kernel's cache: one read shows up as a non-finite output. The twin gets the clean cache (SDPA multiplies
masked entries by 0, which NaN survives).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from kernel_checks import TOL, assert_close

from ssmspec.models.kv_cache import KVCache
from ssmspec.ops.attention import decode_attention

ATTN_TOL = {**TOL, torch.bfloat16: (4e-2, 3e-2)}  # p is rounded to bf16 before the PV product


def _tree_mask(rows: int, L: int, g: torch.Generator) -> torch.Tensor:
    """(rows, L, L) ancestor-or-self masks of random trees in topological order (parent[i] < i)."""
    mask = torch.zeros(rows, L, L, dtype=torch.bool)
    for r in range(rows):
        for i in range(L):
            mask[r, i, i] = True
            if i:
                mask[r, i] |= mask[r, int(torch.randint(0, i, (1,), generator=g))]
    return mask


def _case(*, B, rows_per_seq, L, Hq, Hkv, D, max_len, dtype, device, lengths, starts, tree=False, valid=False,
          hide=False, seq_index=True, ctx_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows_per_seq = rows_per_seq if seq_index else 1  # without seq_index row r is sequence r
    rows = B * rows_per_seq

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    kc, vc = r(B, Hkv, max_len, D), r(B, Hkv, max_len, D)
    length = torch.tensor(lengths, device=device)
    start = torch.tensor(starts, device=device)
    seq = torch.arange(B).repeat_interleave(rows_per_seq).to(device)
    kv_hide = None
    if hide:  # at most what the sequence has committed
        kv_hide = (torch.randint(0, 3, (rows,), generator=g).to(device)).minimum((length - start)[seq].clamp(min=0))
    valid_t = None
    if valid:  # trailing pad tokens, and the last row entirely padding
        n_real = torch.randint(1, L + 1, (rows,), generator=g)
        n_real[-1] = 0
        valid_t = (torch.arange(L)[None] < n_real[:, None]).to(device)
    ctx = max_len if ctx_len is None else ctx_len
    end = (length[seq] - (0 if kv_hide is None else kv_hide)).clamp(max=ctx)
    slot = torch.arange(max_len, device=device)
    hidden = (slot[None] < start[seq, None]) | (slot[None] >= end[:, None])  # (rows, max_len) never read
    kc_nan, vc_nan = kc.clone(), vc.clone()
    for b in range(B):  # a slot is poisoned only when no row of its sequence may read it
        bad = hidden[seq == b].all(0)
        kc_nan[b, :, bad], vc_nan[b, :, bad] = float("nan"), float("nan")
    return dict(q=r(rows, L, Hq, D), k=r(rows, L, Hkv, D), v=r(rows, L, Hkv, D), k_cache=kc, v_cache=vc,
                k_cache_nan=kc_nan, v_cache_nan=vc_nan, start=start, length=length, ctx_len=ctx,
                scale=1 / math.sqrt(D), seq_index=seq if seq_index else None, kv_hide=kv_hide,
                tree_mask=_tree_mask(rows, L, g).to(device) if tree else None, valid=valid_t)


def _run(c: dict, backend: str, splits=None, store=(None, None)) -> torch.Tensor:
    nan = backend == "triton"
    return decode_attention(c["q"], c["k"], c["v"], c["k_cache_nan" if nan else "k_cache"],
                            c["v_cache_nan" if nan else "v_cache"], c["start"], c["length"], ctx_len=c["ctx_len"],
                            scale=c["scale"], seq_index=c["seq_index"], kv_hide=c["kv_hide"],
                            tree_mask=c["tree_mask"], valid=c["valid"], backend=backend,
                            store_k=store[0], store_v=store[1], **({"splits": splits} if splits else {}))


# max_len 150: 3 blocks of 64, the last partial; lengths: none committed, a full cache, left padding
SHAPES = [
    pytest.param(dict(B=3, rows_per_seq=1, L=1, Hq=8, Hkv=2, D=64, lengths=[0, 150, 77], starts=[0, 0, 5]),
                 id="decode-L1-gqa4-d64"),
    pytest.param(dict(B=2, rows_per_seq=2, L=3, Hq=2, Hkv=2, D=128, lengths=[150, 40], starts=[3, 0]),
                 id="chain-L3-mha-d128-2rows"),
    pytest.param(dict(B=3, rows_per_seq=2, L=7, Hq=8, Hkv=2, D=64, lengths=[0, 131, 65], starts=[0, 130, 0]),
                 id="L7-gqa4-d64-2rows"),
    pytest.param(dict(B=2, rows_per_seq=1, L=5, Hq=12, Hkv=4, D=96, lengths=[100, 64], starts=[0, 1], ctx_len=90),
                 id="L5-gqa3-d96-ctx90"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,masks", [
    pytest.param(torch.float32, {}, id="fp32-causal"),
    pytest.param(torch.float32, dict(tree=True, valid=True, hide=True, store=True), id="fp32-tree-valid-hide-store"),
    pytest.param(torch.float32, dict(valid=True, seq_index=False), id="fp32-causal-valid-noseq"),
    pytest.param(torch.bfloat16, dict(tree=True, valid=True, hide=True, store=True), id="bf16-tree-valid-hide-store"),
    pytest.param(torch.float16, dict(valid=True, hide=True), id="fp16-causal-valid-hide"),
])
def test_kernel_vs_twin(shape, dtype, masks, device):
    masks = dict(masks)
    store = masks.pop("store", False)
    c = _case(max_len=150, dtype=dtype, device=device, **shape, **masks)
    rows, L, Hkv, D = c["k"].shape
    outs, stores = {}, {}
    for backend in ("triton", "reference"):  # the pending scratch: one spare row and two spare columns
        stores[backend] = tuple(torch.full((rows + 1, Hkv, L + 2, D), float("nan"), device=device, dtype=dtype)
                                for _ in range(2)) if store else (None, None)
        outs[backend] = _run(c, backend, store=stores[backend])
    assert_close(outs["triton"], outs["reference"], ATTN_TOL[dtype], "out")
    for got, want in zip(stores["triton"], stores["reference"]):
        if store:  # copies: exact, and nothing written outside [:rows, :, :L]
            torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [pytest.param(1, id="1split"), pytest.param(3, id="3splits"),
                                    pytest.param(7, id="7splits-more-than-blocks")])
def test_splits_agree(splits, device):
    c = _case(B=2, rows_per_seq=1, L=2, Hq=4, Hkv=1, D=64, max_len=300, lengths=[300, 129], starts=[0, 2],
              dtype=torch.float32, device=device, hide=True)
    assert_close(_run(c, "triton", splits=splits), _run(c, "reference"), ATTN_TOL[torch.float32], "out")


def test_fully_masked_query_sees_itself(device):
    """A pad row with nothing committed: the output is its own value vector, as in the twin."""
    c = _case(B=1, rows_per_seq=1, L=3, Hq=2, Hkv=1, D=64, max_len=64, lengths=[0], starts=[0], dtype=torch.float32,
              device=device)
    c["valid"] = torch.zeros(1, 3, dtype=torch.bool, device=device)
    out = _run(c, "triton")
    torch.testing.assert_close(out, c["v"].expand(1, 3, 2, 64), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad,match", [
    pytest.param(dict(L=65), "at most 64", id="L-too-long"),
    pytest.param(dict(Hq=3), "multiple of Hkv", id="heads-not-gqa"),
])
def test_bad_input(bad, match, device):
    kw = dict(B=1, rows_per_seq=1, L=1, Hq=4, Hkv=2, D=64, max_len=8, lengths=[4], starts=[0], dtype=torch.float32,
              device=device) | bad
    with pytest.raises(ValueError, match=match):
        _run(_case(**kw), "triton")


def test_store_needs_both(device):
    c = _case(B=1, rows_per_seq=1, L=1, Hq=2, Hkv=1, D=64, max_len=8, lengths=[4], starts=[0], dtype=torch.float32,
              device=device)
    with pytest.raises(ValueError, match="store_k and store_v"):
        _run(c, "triton", store=(torch.zeros(1, 1, 1, 64, device=device), None))


def _step(**kw) -> SimpleNamespace:
    """The fields of StepInputs that KVCache.attend reads, for a decode call."""
    return SimpleNamespace(**(dict(prefill=False, kv_bound=0, seq_index=None, kv_hide=None, tree_mask=None, valid=None)
                              | kw))


def test_kv_cache_attend_uses_kernel_and_commit_clamps(monkeypatch, device):
    """KVCache.attend on a decode call gives the same output through the kernel as through SDPA; commit
    never moves length past max_len (finished sequences keep stepping)."""
    cache = KVCache(2, 2, 64, 20, rows=2, max_new=3, device=device, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.length.copy_(torch.tensor([19, 4]))
    q, k, v = (torch.randn(2, 3, n, 64, generator=g).to(device) for n in (4, 2, 2))
    step = _step(valid=torch.tensor([[True, True, False], [True, True, True]], device=device))
    outs = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("SSMSPEC_OPS_BACKEND", backend)
        outs[backend] = cache.attend(q, k, v, step, scale=0.125)
    assert_close(outs["triton"], outs["reference"], ATTN_TOL[torch.float32], "attend")
    cache.commit(torch.tensor([0, 1], device=device), torch.tensor([[0, 1, 2], [0, 1, 2]], device=device),
                 torch.tensor([3, 3], device=device))
    assert cache.length.tolist() == [20, 7]
    torch.testing.assert_close(cache.k[1, :, 4:7], k[1].transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    pytest.param(dict(B=1, rows_per_seq=1, L=1, lengths=[8000], starts=[0]), id="B1-decode-8k"),
    pytest.param(dict(B=64, rows_per_seq=1, L=1, lengths=[4096 - 61 * i for i in range(64)], starts=[0] * 64),
                 id="B64-decode-4k"),
    pytest.param(dict(B=4, rows_per_seq=2, L=16, lengths=[4000, 0, 1234, 4096], starts=[0, 0, 17, 0], tree=True,
                      valid=True, hide=True), id="B4x2-tree16"),
    pytest.param(dict(B=8, rows_per_seq=1, L=64, lengths=[2048] * 8, starts=[0] * 8), id="B8-chain64"),
])
def test_kernel_nemotron_h_4b_sizes(case, device):
    """Nemotron-H-4B attention: 32 query heads, 8 KV heads, head dim 128, bf16, caches of 4096-8192 slots."""
    max_len = 8192 if case["B"] == 1 else 4096
    c = _case(Hq=32, Hkv=8, D=128, max_len=max_len, dtype=torch.bfloat16, device=device, **case)
    assert_close(_run(c, "triton"), _run(c, "reference"), ATTN_TOL[torch.bfloat16], "out")


def test_model_decodes_on_the_fused_kernels(monkeypatch):
    """tiny-hybrid (M, *, E blocks) generates the same greedy tokens with every op on its Triton kernel as on
    the reference ops, and decode reached the norm and attention kernels."""
    from ssmspec.engine.generate import generate
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model
    from ssmspec.ops.attention import triton as attn_triton
    from ssmspec.ops.norm import triton as norm_triton

    model = build_model(load_preset("tiny-hybrid"), seed=0)
    prompts = [[5, 17, 33, 8, 90], [9, 10, 11]]
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "reference")
    ref = generate(model, prompts, max_new_tokens=4, strategy="autoregressive", timing=False).sequences
    calls: dict[str, int] = {}
    for mod, fn in ((attn_triton, "decode_attention_triton"), (norm_triton, "add_rms_norm_triton"),
                    (norm_triton, "gated_rms_norm_triton")):
        def spy(*a, _orig=getattr(mod, fn), _fn=fn, **k):
            calls[_fn] = calls.get(_fn, 0) + 1
            return _orig(*a, **k)
        monkeypatch.setattr(mod, fn, spy)
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    out = generate(model, prompts, max_new_tokens=4, strategy="autoregressive", timing=False).sequences
    assert out == ref
    assert set(calls) == {"decode_attention_triton", "add_rms_norm_triton", "gated_rms_norm_triton"}, calls
