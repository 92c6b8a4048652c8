"""ops.replay (ReplaySSM, seed 000 Alg. 2/4): output-only verify from a checkpoint + ring buffer equals the
plain recurrence; the flush folds only committed entries; pointers, ring writes and the flush rule."""
import pytest
import torch
import torch.nn.functional as F

from ssmspec.ops.replay import replay_commit, replay_flush_flags, replay_verify
from ssmspec.ops.ssd.naive import ssm_recurrence_ref


def _case(bsz, R, L, H, P, G, N, head, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(S0=r(bsz, H, P, N), ring_x=r(bsz, R, H, P), ring_dt=torch.rand(bsz, R, H, generator=gen) * 0.5,
                ring_B=r(bsz, R, G, N), head=torch.tensor(head), count=torch.tensor(count), x=r(bsz, L, H, P),
                dt=r(bsz, L, H), A=-torch.rand(H, generator=gen) * 2 - 0.2, B=r(bsz, L, G, N), C=r(bsz, L, G, N),
                D=r(H), dt_bias=r(H) * 0.1)


# (R, L, head, count, flush): committed windows that wrap around the ring end, an empty ring, a full window
CASES = {
    "wrap-noflush": (7, 2, [5, 0], [2, 3], [False, False]),
    "wrap-flush": (7, 2, [6, 3], [5, 4], [True, True]),
    "mixed-flush": (5, 3, [4, 1], [2, 0], [True, False]),
    "empty-ring-S0": (4, 1, [0, 3], [0, 0], [False, True]),
    "window-fills-ring": (6, 3, [2, 5], [3, 3], [False, False]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_replay_verify_equals_recurrence(case):
    R, L, head, count, flush = CASES[case]
    H, P, G, N = 4, 3, 2, 5
    c = _case(2, R, L, H, P, G, N, head, count)
    orig = {k: v.clone() for k, v in c.items()}
    flush_t = torch.tensor(flush)
    y = replay_verify(c["S0"], c["ring_x"], c["ring_dt"], c["ring_B"], c["head"], c["count"], c["x"], c["dt"], c["A"],
                      c["B"], c["C"], c["D"], dt_bias=c["dt_bias"], dt_limit=(0.0, float("inf")), flush=flush_t)
    dtd = F.softplus(orig["dt"] + orig["dt_bias"])
    for b in range(2):
        slots = [(head[b] + j) % R for j in range(count[b])]  # committed entries, oldest first
        xs = torch.cat([orig["ring_x"][b, slots], orig["x"][b]])[None]
        dts = torch.cat([orig["ring_dt"][b, slots], dtd[b]])[None]
        Bs = torch.cat([orig["ring_B"][b, slots], orig["B"][b]])[None]
        Cs = torch.cat([torch.zeros(count[b], G, N), orig["C"][b]])[None]
        yr, _ = ssm_recurrence_ref(xs, dts, orig["A"], Bs, Cs, orig["D"], initial_state=orig["S0"][b:b + 1])
        torch.testing.assert_close(y[b], yr[0, count[b]:], rtol=1e-4, atol=1e-4)
        if flush[b]:  # S0 now holds the committed entries, the ring restarts after them
            _, folded = ssm_recurrence_ref(xs[:, :count[b]], dts[:, :count[b]], orig["A"], Bs[:, :count[b]],
                                           Cs[:, :count[b]], None, initial_state=orig["S0"][b:b + 1])
            torch.testing.assert_close(c["S0"][b], folded[0], rtol=1e-5, atol=1e-5)
            assert (int(c["head"][b]), int(c["count"][b])) == ((head[b] + count[b]) % R, 0)
        else:  # output only: no state store, pointers untouched
            assert torch.equal(c["S0"][b], orig["S0"][b])
            assert (int(c["head"][b]), int(c["count"][b])) == (head[b], count[b])
        new_slots = [(int(c["head"][b]) + int(c["count"][b]) + s) % R for s in range(L)]
        assert torch.equal(c["ring_x"][b, new_slots], orig["x"][b])
        torch.testing.assert_close(c["ring_dt"][b, new_slots], dtd[b])
        kept = [s for s in range(R) if s not in new_slots]  # nothing else in the ring is written
        assert torch.equal(c["ring_x"][b, kept], orig["ring_x"][b, kept])


def test_flush_rule_boundary_and_commit():
    """Flush one window early: h + 2L > R (seed 000); exactly h + 2L == R does not flush."""
    count = torch.tensor([0, 4, 5, 9])
    assert replay_flush_flags(count, 3, 10).tolist() == [False, False, True, True]  # 4 + 6 == 10: no flush
    assert replay_flush_flags(torch.tensor([0]), 1, 1).tolist() == [True]  # R = L: every call flushes
    per_layer = torch.tensor([[2, 0, 1], [2, 0, 1]])  # (n_layers, B), one accepted count per sequence
    replay_commit(per_layer, torch.tensor([0, 3, 1]))
    assert per_layer.tolist() == [[3, 4, 3], [3, 4, 3]]


def test_call_longer_than_ring_is_refused():
    c = _case(1, 3, 4, 2, 2, 1, 2, [0], [0])
    with pytest.raises(ValueError, match="buffer size"):
        replay_verify(c["S0"], c["ring_x"], c["ring_dt"], c["ring_B"], c["head"], c["count"], c["x"], c["dt"],
                      c["A"], c["B"], c["C"], dt_bias=None, flush=torch.tensor([True]))
