"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 layout): the chunked WY prefill and the tree form equal the
token-by-token recurrence, and a model's step-by-step decode equals one parallel forward (float64, CPU)."""
import pytest
import torch

from ssmspec.engine.context import RunContext
from ssmspec.models.config import load_preset
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import build_model
from ssmspec.ops.gdn import gdn_chunk_scan, gdn_recurrence_ref, gdn_tree_scan, l2norm
from ssmspec.strategies import SpecConfig, StepInputs, make_strategy

QWEN = ["tiny-qwen3.5", "tiny-qwen3-next"]


def _inputs(B=2, L=11, G=2, H=4, N=8, P=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(r(B, L, G, N)), l2norm(r(B, L, G, N))
    v = r(B, L, H, P)
    g = -torch.nn.functional.softplus(r(B, L, H))  # log-decay <= 0
    beta = torch.sigmoid(r(B, L, H))
    s0 = r(B, H, N, P).float()
    return s0, q, k, v, g, beta


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunk_scan_equals_recurrence(chunk):
    s0, q, k, v, g, beta = _inputs()
    y_ref, s_ref = gdn_recurrence_ref(s0, q, k, v, g, beta)
    y, s = gdn_chunk_scan(q, k, v, g, beta, chunk_size=chunk, initial_state=s0)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=1e-5)  # the state is returned in fp32


def test_tree_scan_equals_recurrence_along_every_path():
    """Nodes of a token tree (parents [-1, 0, 0, 1, 1, 2, 5]) read only their ancestors: each node's output
    equals the recurrence over its root path."""
    parents = [-1, 0, 0, 1, 1, 2, 5]
    L = len(parents)
    s0, q, k, v, g, beta = _inputs(L=L, seed=1)
    mask = torch.zeros(L, L, dtype=torch.bool)
    for s in range(L):
        t = s
        while t >= 0:
            mask[s, t] = True
            t = parents[t]
    y, _ = gdn_tree_scan(s0, q, k, v, g, beta, mask=mask[None].expand(2, L, L))
    for s in range(L):
        path = mask[s].nonzero().flatten()
        y_ref, _ = gdn_recurrence_ref(s0, q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path])
        torch.testing.assert_close(y[:, s], y_ref[:, -1], rtol=0, atol=1e-10)
    # a wrong mask (a sibling seen as an ancestor) changes the output: the test can fail
    bad = mask.clone()
    bad[4, 3] = True
    y_bad, _ = gdn_tree_scan(s0, q, k, v, g, beta, mask=bad[None].expand(2, L, L))
    assert (y_bad[:, 4] - y[:, 4]).abs().max() > 1e-6


def _forward(model, ids, prefill_strategy):
    cfg = model.cfg
    kv = [KVCache(1, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=1, max_new=ids.shape[1], device="cpu",
                  dtype=model.dtype) for _ in cfg.attention_layers]
    step = StepInputs(input_ids=ids, positions=torch.arange(ids.shape[1])[None], prefill=True)
    return model(ids, RunContext(strategy=prefill_strategy, kv=kv, step=step)), kv


@pytest.mark.parametrize("preset", QWEN)
def test_step_by_step_decode_equals_one_parallel_forward(preset):
    """Prompt of 3 then 9 single-token calls through the recurrent update equal one prefill over all 12
    tokens (chunked WY form, chunk 4, so the prompt pass crosses chunk boundaries), float64."""
    cfg = load_preset(preset)
    model = build_model(cfg, seed=2, dtype=torch.float64)
    ids = torch.tensor([[5, 17, 33, 8, 99, 3, 250, 41, 7, 7, 120, 64]])
    ar = make_strategy("autoregressive")
    ar.allocate(cfg, 1, SpecConfig(), "cpu", torch.float64)
    with torch.no_grad():
        full, _ = _forward(model, ids, ar)
        ar2 = make_strategy("autoregressive")
        ar2.allocate(cfg, 1, SpecConfig(), "cpu", torch.float64)
        first, kv = _forward(model, ids[:, :3], ar2)
        for c in kv:  # the prompt's keys and values become committed slots 0..2
            c.commit(torch.zeros(1, dtype=torch.long), torch.arange(3)[None], torch.tensor([3]))
        steps = [first[:, -1]]
        for t in range(3, ids.shape[1]):
            step = StepInputs(input_ids=ids[:, t:t + 1], positions=torch.tensor([[t]]), kv_bound=t + 1)
            steps.append(model(ids[:, t:t + 1], RunContext(strategy=ar2, kv=kv, step=step))[:, 0])
            ones = torch.ones(1, dtype=torch.long)
            for c in kv:
                c.commit(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), ones)
    got = torch.stack(steps, dim=1)[0]  # logits at positions 2 .. 11
    torch.testing.assert_close(got, full[0, 2:], rtol=0, atol=1e-6)  # states are kept in fp32 (as every strategy)
    assert full.abs().max() > 1e-3 and ar.gdn_state.abs().max() > 0  # the check is not vacuous
