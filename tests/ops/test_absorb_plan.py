"""The draft engine's absorb plan in one launch against its twin and against a per-row spelling of the law
(``ops/absorb_plan``): every output and every counter it advances, exactly, over random buffers, with rows
behind, caught up, ahead of the buffer (nothing to feed), resumed deeper than the buffer allows, one and several
drafting rows per sequence."""
import pytest
import torch

from ssmspec.ops.absorb_plan import absorb_plan, absorb_plan_ref

PAD = 0


def _case(device, *, B, A, W, S1, cap=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g).to(device)  # noqa: E731
    inputs = {"tokens": r(3, 50, B, cap), "length": r(0, cap + 1, B), "consumed": r(0, cap + 1, B),
              "skip": r(0, 5, B), "skip_row": r(0, W, B)}
    outs = {"ids": torch.full((B, A), -7, device=device), "pos": torch.full((B, A), -7, device=device),
            "valid": torch.ones(B, A, dtype=torch.bool, device=device), "src": torch.full((B,), -7, device=device),
            "n": torch.full((B,), -7, device=device), "skip_eff": torch.full((B,), -7, device=device),
            "last_idx": torch.full((B,), -7, device=device), "row_pos": torch.full((B * W, S1), -7, device=device)}
    return inputs, outs


def _run(fn, inputs, outs, **kw):
    i = {k: v.clone() for k, v in inputs.items()}
    o = {k: v.clone() for k, v in outs.items()}
    fn(i["tokens"], i["length"], i["consumed"], i["skip"], i["skip_row"], **o, pad=PAD, **kw)
    return {**i, **o}


def _spelled(inputs, *, A, S1, resumes, width, per_row, slots_base):
    """The law one row at a time, in Python ints (ops/absorb_plan's module doc)."""
    t = {k: v.cpu().tolist() for k, v in inputs.items()}
    B, cap, W = len(t["length"]), len(t["tokens"][0]), width
    out = {k: [] for k in ("ids", "pos", "valid", "src", "n", "skip_eff", "last_idx", "consumed", "skip", "row_pos")}
    for b in range(B):
        behind = max(t["length"][b] - t["consumed"][b], 0)
        s = min(t["skip"][b], max(behind - 1, 0))
        n = min(behind - s, A)
        start = t["consumed"][b] + s
        out["ids"].append([t["tokens"][b][min(start + j, cap - 1)] if j < n else PAD for j in range(A)])
        out["pos"].append([start + j for j in range(A)])
        out["valid"].append([j < n for j in range(A)])
        deep = resumes and s > 0
        out["src"].append(slots_base + (b * W + t["skip_row"][b]) * per_row + s - 1 if deep else b)
        out["n"].append(n)
        out["skip_eff"].append(s)
        out["last_idx"].append(max(n - 1, 0))
        out["consumed"].append(t["consumed"][b] + s + n)
        out["skip"].append(0)
        out["row_pos"] += [[t["consumed"][b] + s + n + d for d in range(S1)] for _ in range(W)]
    return out


@pytest.mark.parametrize("resumes", [True, False])
@pytest.mark.parametrize("B,A,W,S1", [(7, 2, 1, 3), (5, 5, 3, 4), (4, 1, 2, 1), (3, 9, 1, 2)])
def test_absorb_plan_kernel_equals_twin_and_the_law(device, resumes, B, A, W, S1):
    kw = dict(resumes=resumes, width=W, per_row=max(S1, 1), slots_base=B)
    for seed in range(4):
        inputs, outs = _case(device, B=B, A=A, W=W, S1=S1, seed=seed)
        got = _run(lambda *a, **k: absorb_plan(*a, **k, backend="triton"), inputs, outs, **kw)
        ref = _run(absorb_plan_ref, inputs, outs, **kw)
        law = _spelled(inputs, A=A, S1=S1, **kw)
        for name, want in law.items():
            assert got[name].cpu().tolist() == want, (name, seed)
            assert torch.equal(got[name], ref[name]), (name, seed)
        # the inputs it only reads are untouched
        for name in ("tokens", "length", "skip_row"):
            assert torch.equal(got[name], inputs[name])


def test_absorb_plan_law_catches_a_plan_that_forgets_the_bound_on_skip(device):
    """The spelled law is not vacuous: a twin that trusts ``skip`` beyond the buffer differs from it."""
    import ssmspec.ops.absorb_plan.naive as naive
    inputs, outs = _case(device, B=6, A=2, W=1, S1=3, seed=1)
    inputs["length"] = inputs["consumed"] + 1  # one token behind: only the bonus, whatever skip says
    inputs["skip"] = torch.full_like(inputs["skip"], 2)
    kw = dict(resumes=True, width=1, per_row=3, slots_base=6)
    law = _spelled(inputs, A=2, S1=3, **kw)
    assert _run(absorb_plan_ref, inputs, outs, **kw)["src"].cpu().tolist() == law["src"] == list(range(6))

    def unbounded(tokens, length, consumed, skip, skip_row, **k):
        naive.absorb_plan_ref(tokens, length + skip, consumed, skip, skip_row, **k)  # as if skip always fit
    assert _run(unbounded, inputs, outs, **kw)["src"].cpu().tolist() != law["src"]


def test_absorb_plan_refuses_bad_buffers_with_what_is_wrong(device):
    inputs, outs = _case(device, B=3, A=2, W=1, S1=2)
    kw = dict(pad=PAD, resumes=True, width=1, per_row=2, slots_base=3)
    bad = {**outs, "valid": outs["valid"].long()}
    with pytest.raises(ValueError, match="valid must be bool"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "n": outs["n"][:2]}
    with pytest.raises(ValueError, match=r"n has shape \(2,\), expected \(3,\)"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "row_pos": outs["row_pos"].int()}
    with pytest.raises(ValueError, match="row_pos must be int64"):
        absorb_plan(*inputs.values(), **bad, **kw)


@pytest.mark.gpu
def test_absorb_plan_at_batch_256_equals_twin():
    kw = dict(resumes=True, width=1, per_row=3, slots_base=256)
    inputs, outs = _case("cuda", B=256, A=2, W=1, S1=3, cap=1200, seed=3)
    got = _run(lambda *a, **k: absorb_plan(*a, **k, backend="triton"), inputs, outs, **kw)
    ref = _run(absorb_plan_ref, inputs, outs, **kw)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
