"""The speculation cache's lookup kernel (``ops/cache_lookup``) against its twin and against a per-row spelling
of its law, exactly, over random rounds: rows that hit at every depth, rows whose bonus matches a key of another
depth (a miss), rows with no match, rounds before the first cache (``have_cache`` False), every row hit (the flag
stays down) and batches past one block of rows."""
import pytest
import torch

from ssmspec.ops.cache_lookup import cache_lookup_step, cache_lookup_step_ref

OUTS = ("bonus", "src", "hit", "branch", "drafts", "miss_any", "rounds", "hits")


def _case(device, *, B, N, S, have=True, all_hit=False, seed=0):
    """A round: keys from a small vocabulary (so bonus tokens often match some key), the verdict's bonus drawn
    from the row's keys or beside them."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)  # noqa: E731
    fan = r(0, 3, S + 1)
    fan[r(0, S + 1, 1)] += 1  # at least one branch
    depths = torch.repeat_interleave(torch.arange(S + 1), fan)[:N]
    depths = torch.cat([depths, torch.full((N - depths.numel(),), S)]) if depths.numel() < N else depths
    cache = r(0, 7, B, N, 1 + S)
    v_acc = r(0, S + 1, B)
    v_bonus = r(0, 7, B)
    if all_hit:  # every row's verdict is one of its branches
        pick = r(0, N, B)
        v_acc, v_bonus = depths[pick], cache[torch.arange(B), pick, 0]
    inputs = {"v_acc": v_acc, "v_bonus": v_bonus, "chain": r(0, 1000, B, S + 1), "cache": cache, "depths": depths,
              "have_cache": torch.tensor([have])}
    outs = {"bonus": r(0, 9, B), "src": r(0, 9, B), "hit": r(0, 2, B).bool(), "branch": r(0, 9, B),
            "drafts": r(0, 9, B, S), "miss_any": torch.tensor(not all_hit), "rounds": r(0, 9, 1)[0], "hits": r(0, 9, B)}
    mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return mv(inputs), mv(outs)


def _run(fn, inputs, outs):
    i = {k: v.clone() for k, v in inputs.items()}
    o = {k: v.clone() for k, v in outs.items()}
    fn(i["v_acc"], i["v_bonus"], i["chain"], i["cache"], i["depths"], i["have_cache"], **o)
    return {k: o[k].cpu() for k in OUTS}


def _spelled(inputs, outs):
    """The law one row at a time, in Python ints (ops/cache_lookup's module doc)."""
    t = {k: v.cpu().tolist() for k, v in {**inputs, **outs}.items()}
    have = bool(t["have_cache"][0])
    got = {k: [] for k in ("bonus", "src", "hit", "branch", "drafts", "hits")}
    for b in range(len(t["v_acc"])):
        k, bon = t["v_acc"][b], t["v_bonus"][b]
        match = [n for n, key in enumerate(t["cache"][b]) if key[0] == bon and t["depths"][n] == k]
        h = have and bool(match)
        br = match[0] if match else 0
        got["bonus"].append(bon)
        got["src"].append(t["chain"][b][k])
        got["hit"].append(h)
        got["branch"].append(br)
        got["drafts"].append(t["cache"][b][br][1:] if h else t["drafts"][b])
        got["hits"].append(t["hits"][b] + h)
    got["miss_any"] = not all(got["hit"])
    got["rounds"] = t["rounds"] + have
    return got


@pytest.mark.parametrize("have,all_hit", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("B,N,S", [(1, 1, 1), (3, 5, 4), (40, 16, 8), (17, 9, 3)])
def test_lookup_kernel_equals_twin_and_the_law(device, B, N, S, have, all_hit):
    for seed in range(3):
        inputs, outs = _case(device, B=B, N=N, S=S, have=have, all_hit=all_hit, seed=seed)
        got = _run(lambda *a, **k: cache_lookup_step(*a, **k, backend="triton"), inputs, outs)
        ref = _run(cache_lookup_step_ref, inputs, outs)
        law = _spelled(inputs, outs)
        for name in OUTS:
            assert got[name].tolist() == ref[name].tolist() == law[name], (name, seed)
        if have and all_hit:
            assert not law["miss_any"] and all(law["hit"])


def test_lookup_law_sees_hits_and_misses(device):
    """The random rounds are not vacuous: hits and misses both occur, and a hit's drafts differ from the stale ones."""
    inputs, outs = _case(device, B=40, N=16, S=8, seed=1)
    law = _spelled(inputs, outs)
    assert 0 < sum(law["hit"]) < 40 and law["miss_any"]
    assert any(h and d != old for h, d, old in zip(law["hit"], law["drafts"], outs["drafts"].cpu().tolist()))


def test_lookup_refuses_bad_buffers_with_what_is_wrong(device):
    inputs, outs = _case(device, B=3, N=5, S=4)
    with pytest.raises(ValueError, match=r"drafts has shape \(3, 3\), expected \(3, 4\)"):
        cache_lookup_step(*inputs.values(), **{**outs, "drafts": outs["drafts"][:, :3].contiguous()})
    with pytest.raises(ValueError, match="hit must be torch.bool"):
        cache_lookup_step(*inputs.values(), **{**outs, "hit": outs["hit"].long()})


@pytest.mark.gpu
def test_lookup_at_batch_256_equals_twin():
    inputs, outs = _case("cuda", B=256, N=32, S=8, seed=4)
    got = _run(lambda *a, **k: cache_lookup_step(*a, **k, backend="triton"), inputs, outs)
    ref = _run(cache_lookup_step_ref, inputs, outs)
    for name in OUTS:
        assert torch.equal(got[name], ref[name]), name
