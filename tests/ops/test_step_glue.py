"""The step glue kernels (``ops/step_glue``), each against its twin and against a per-row spelling of its law,
exactly, over random inputs:

- ``absorb_plan``: every output and every counter it advances, with rows behind, caught up, ahead of the buffer
  (nothing to feed), resumed deeper than the buffer allows, one and several drafting rows per sequence;
- ``emit``: tokens written, lengths, emitted counts, finished flags, report, seq_len and the pending token, over
  random verdicts of chains and trees, with and without EOS, rows at the budget, rows already finished;
- ``chain_verdict``: accepted length, path and bonus, from the drafts' tokens and from the oracle's match flags.
"""
import pytest
import torch

from ssmspec.ops.step_glue import absorb_plan, absorb_plan_ref, chain_verdict, chain_verdict_ref, emit, emit_ref
from ssmspec.strategies.base import StepInputs
from ssmspec.strategies.snapshot import Snapshot

PAD = 0
EOS = 4


# absorb_plan ------------------------------------------------------------------------------------------------
def _case(device, *, B, A, W, S1, cap=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g).to(device)  # noqa: E731
    inputs = {"tokens": r(3, 50, B, cap), "length": r(0, cap + 1, B), "consumed": r(0, cap + 1, B),
              "skip": r(0, 5, B), "skip_row": r(0, W, B)}
    outs = {"ids": torch.full((B, A), -7, device=device), "pos": torch.full((B, A), -7, device=device),
            "valid": torch.ones(B, A, dtype=torch.bool, device=device), "src": torch.full((B,), -7, device=device),
            "n": torch.full((B,), -7, device=device), "skip_eff": torch.full((B,), -7, device=device),
            "last_idx": torch.full((B,), -7, device=device), "row_pos": torch.full((B * W, S1), -7, device=device),
            "slot_dst": torch.full((B, A), -7, device=device)}
    return inputs, outs


def _run_plan(fn, inputs, outs, **kw):
    i = {k: v.clone() for k, v in inputs.items()}
    o = {k: v.clone() for k, v in outs.items()}
    fn(i["tokens"], i["length"], i["consumed"], i["skip"], i["skip_row"], **o, pad=PAD, **kw)
    return {**i, **o}


def _spelled_plan(inputs, *, A, S1, resumes, width, per_row, slots_base):
    """The law one row at a time, in Python ints (ops/absorb_plan's module doc)."""
    t = {k: v.cpu().tolist() for k, v in inputs.items()}
    B, cap, W = len(t["length"]), len(t["tokens"][0]), width
    out = {k: [] for k in ("ids", "pos", "valid", "src", "n", "skip_eff", "last_idx", "consumed", "skip", "row_pos",
                           "slot_dst")}
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
        out["slot_dst"].append([b if j == n - 1 else -1 for j in range(A)])  # committed slot b, last fed column
    return out


@pytest.mark.parametrize("resumes", [True, False])
@pytest.mark.parametrize("B,A,W,S1", [(7, 2, 1, 3), (5, 5, 3, 4), (4, 1, 2, 1), (3, 9, 1, 2)])
def test_absorb_plan_kernel_equals_twin_and_the_law(device, resumes, B, A, W, S1):
    kw = dict(resumes=resumes, width=W, per_row=max(S1, 1), slots_base=B)
    for seed in range(4):
        inputs, outs = _case(device, B=B, A=A, W=W, S1=S1, seed=seed)
        got = _run_plan(lambda *a, **k: absorb_plan(*a, **k, backend="triton"), inputs, outs, **kw)
        ref = _run_plan(absorb_plan_ref, inputs, outs, **kw)
        law = _spelled_plan(inputs, A=A, S1=S1, **kw)
        for name, want in law.items():
            assert got[name].cpu().tolist() == want, (name, seed)
            assert torch.equal(got[name], ref[name]), (name, seed)
        # the inputs it only reads are untouched
        for name in ("tokens", "length", "skip_row"):
            assert torch.equal(got[name], inputs[name])
        # slot_dst / n are the plan a snapshot call would make from valid and the committed slots (the draft engine
        # hands them over instead, so the strategy launches nothing for it)
        step = StepInputs(got["ids"], got["pos"], valid=got["valid"], dst_slot=torch.arange(B, device=device)[:, None])
        keep, dst = Snapshot._per_call(step)
        assert torch.equal(keep, got["n"]) and torch.equal(dst, got["slot_dst"]), seed


def test_absorb_plan_without_slot_dst_writes_the_same_plan(device):
    inputs, outs = _case(device, B=5, A=3, W=2, S1=2, seed=2)
    kw = dict(resumes=True, width=2, per_row=2, slots_base=5)
    without = {k: v for k, v in outs.items() if k != "slot_dst"}
    for fn in (lambda *a, **k: absorb_plan(*a, **k, backend="triton"), absorb_plan_ref):
        full, part = _run_plan(fn, inputs, outs, **kw), _run_plan(fn, inputs, without, **kw)
        assert all(torch.equal(full[k], part[k]) for k in part)


def test_absorb_plan_law_catches_a_plan_that_forgets_the_bound_on_skip(device):
    """The spelled law is not vacuous: a twin that trusts ``skip`` beyond the buffer differs from it."""
    import ssmspec.ops.step_glue.naive as naive
    inputs, outs = _case(device, B=6, A=2, W=1, S1=3, seed=1)
    inputs["length"] = inputs["consumed"] + 1  # one token behind: only the bonus, whatever skip says
    inputs["skip"] = torch.full_like(inputs["skip"], 2)
    kw = dict(resumes=True, width=1, per_row=3, slots_base=6)
    law = _spelled_plan(inputs, A=2, S1=3, **kw)
    assert _run_plan(absorb_plan_ref, inputs, outs, **kw)["src"].cpu().tolist() == law["src"] == list(range(6))

    def unbounded(tokens, length, consumed, skip, skip_row, **k):
        naive.absorb_plan_ref(tokens, length + skip, consumed, skip, skip_row, **k)  # as if skip always fit
    assert _run_plan(unbounded, inputs, outs, **kw)["src"].cpu().tolist() != law["src"]


def test_absorb_plan_refuses_bad_buffers_with_what_is_wrong(device):
    inputs, outs = _case(device, B=3, A=2, W=1, S1=2)
    kw = dict(pad=PAD, resumes=True, width=1, per_row=2, slots_base=3)
    bad = {**outs, "valid": outs["valid"].long()}
    with pytest.raises(ValueError, match="valid must be bool"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "n": outs["n"][:2]}
    with pytest.raises(ValueError, match=r"n has shape \(2,\), expected \(3,\)"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "slot_dst": outs["slot_dst"][:, :1]}
    with pytest.raises(ValueError, match=r"slot_dst has shape \(3, 1\), expected \(3, 2\)"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "row_pos": outs["row_pos"].int()}
    with pytest.raises(ValueError, match="row_pos must be int64"):
        absorb_plan(*inputs.values(), **bad, **kw)
    with pytest.raises(ValueError, match="needs B, A, width and per_row >= 1, got 3, 2, 1, 0"):
        absorb_plan(*inputs.values(), **outs, **{**kw, "per_row": 0})
    bad = {**outs, "src": torch.zeros(6, dtype=torch.long, device=device)[::2]}  # (3,), not contiguous
    with pytest.raises(ValueError, match="one device, and every output contiguous"):
        absorb_plan(*inputs.values(), **bad, **kw)
    bad = {**outs, "n": torch.zeros(3, dtype=torch.long, device="meta")}
    with pytest.raises(ValueError, match="one device, and every output contiguous"):
        absorb_plan(*inputs.values(), **bad, **kw)
    strided = {**inputs, "tokens": inputs["tokens"].repeat(1, 2)[:, ::2]}  # (B, cap), column stride 2
    with pytest.raises(ValueError, match=r"tokens must be \(B, capacity\) with unit column stride, got \(3, 12\)"):
        absorb_plan(*strided.values(), **outs, **kw)


@pytest.mark.gpu
def test_absorb_plan_at_batch_256_equals_twin():
    kw = dict(resumes=True, width=1, per_row=3, slots_base=256)
    inputs, outs = _case("cuda", B=256, A=2, W=1, S1=3, cap=1200, seed=3)
    got = _run_plan(lambda *a, **k: absorb_plan(*a, **k, backend="triton"), inputs, outs, **kw)
    ref = _run_plan(absorb_plan_ref, inputs, outs, **kw)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


# emit -------------------------------------------------------------------------------------------------------
def _state(device, *, B, T, S, D, cap=40, max_new=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)  # noqa: E731
    acc = r(0, S + 1, B)
    # a path per row: node numbers over [pending, drafts], depth k at column k, 0 past the accepted ones
    path = torch.zeros(B, 1 + S, dtype=torch.long)
    for b in range(B):
        nodes = torch.randperm(T, generator=g)[:S] + 1
        path[b, 1:1 + acc[b]] = nodes[:acc[b]]
    st = {"pending": r(3, 9, B), "drafts": r(3, 9, B, T), "path": path, "accepted": acc, "bonus": r(3, 9, B),
          "tokens": r(3, 9, B, cap), "length": r(2, 12, B), "emitted": r(0, max_new + 1, B),
          "done": r(0, 2, B).bool(), "seq_len": r(0, 20, B), "report": torch.full((B, 4 + D), -9)}
    return {k: v.to(device) for k, v in st.items()}


OUTS = ("pending", "tokens", "length", "emitted", "done", "seq_len", "report")


def _run_emit(fn, st, *, chain, max_new, eos, fold):
    s = {k: v.clone() for k, v in st.items()}
    d, p = (s["drafts"], s["path"]) if chain else (None, None)
    acc = s["accepted"] if chain else torch.zeros_like(s["accepted"])
    fn(s["pending"], d, p, acc, s["bonus"], tokens=s["tokens"], length=s["length"], emitted=s["emitted"],
       done=s["done"], seq_len=s["seq_len"], report=s["report"], max_new=max_new, eos=eos, fold=fold)
    return s


def _spelled_emit(st, *, chain, max_new, eos, fold):
    """The law one row at a time in Python ints (ops/emit's module doc)."""
    s = {k: v.cpu().tolist() for k, v in st.items()}
    B, D = len(s["pending"]), len(s["report"][0]) - 4
    for b in range(B):
        a = s["accepted"][b] if chain else 0
        nodes = [s["pending"][b], *s["drafts"][b]]
        C = len(s["path"][b]) if chain else 1
        toks = [nodes[s["path"][b][j + 1]] if j < a else s["bonus"][b] for j in range(C)]
        n = min(a + 1, max_new - s["emitted"][b])
        ended = False
        if eos is not None and eos in toks[:max(n, 0)]:
            n, ended = toks.index(eos) + 1, True
        if s["done"][b]:
            n = 0
        for j in range(n):
            s["tokens"][b][s["length"][b] + j] = toks[j]
        s["length"][b] += n
        s["emitted"][b] += n
        s["done"][b] = s["done"][b] or s["emitted"][b] >= max_new or ended
        s["report"][b] = [toks[j] if j < n else -1 for j in range(1 + D)] + [n, a, int(s["done"][b])]
        if fold:
            s["seq_len"][b] += a + 1
        s["pending"][b] = s["bonus"][b]
    return s


@pytest.mark.parametrize("chain", [True, False], ids=["drafts", "no-drafts"])
@pytest.mark.parametrize("eos", [EOS, None])
@pytest.mark.parametrize("B,T,S,D", [(6, 4, 4, 4), (5, 9, 3, 5), (3, 1, 1, 1)])
def test_emit_kernel_equals_twin_and_the_law(device, chain, eos, B, T, S, D):
    for seed in range(4):
        st = _state(device, B=B, T=T, S=S, D=D, seed=seed)
        fold = seed % 2 == 0
        kw = dict(chain=chain, max_new=9, eos=eos, fold=fold)
        got = _run_emit(lambda *a, **k: emit(*a, **k, backend="triton"), st, **kw)
        ref = _run_emit(emit_ref, st, **kw)
        law = _spelled_emit(st, **kw)
        for name in OUTS:
            assert got[name].cpu().tolist() == law[name], (name, seed)
            assert torch.equal(got[name], ref[name]), (name, seed)


def test_emit_law_sees_the_eos_and_the_budget(device):
    """The spelled law is not vacuous: rows that hit EOS or the budget emit fewer tokens than a + 1, and a
    twin that ignores EOS differs from it."""
    st = _state(device, B=8, T=4, S=4, D=4, seed=5)
    st["drafts"].fill_(EOS)
    st["done"].zero_()
    kw = dict(chain=True, max_new=9, eos=EOS, fold=True)
    law = _spelled_emit(st, **kw)
    n = law["report"]
    assert any(r[5] < a + 1 for r, a in zip(n, st["accepted"].tolist()))
    no_eos = _run_emit(lambda *a, **k: emit_ref(*a, **{**k, "eos": None}), st, **kw)
    assert no_eos["report"].cpu().tolist() != law["report"]


def test_emit_refuses_bad_buffers_with_what_is_wrong(device):
    st = _state(device, B=3, T=4, S=4, D=4)
    kw = dict(tokens=st["tokens"], length=st["length"], emitted=st["emitted"], done=st["done"],
              seq_len=st["seq_len"], report=st["report"], max_new=9, eos=None)
    with pytest.raises(ValueError, match="drafts and path together"):
        emit(st["pending"], st["drafts"], None, st["accepted"], st["bonus"], **kw)
    with pytest.raises(ValueError, match="done must be bool"):
        emit(st["pending"], None, None, st["accepted"], st["bonus"], **{**kw, "done": st["done"].long()})
    with pytest.raises(ValueError, match="report has 5 columns; a step of 5 tokens needs 8"):
        emit(st["pending"], st["drafts"], st["path"], st["accepted"], st["bonus"], **{**kw, "report": st["report"][:, :5]})
    with pytest.raises(ValueError, match=r"emit: length has shape \(2,\), expected \(3,\)"):
        emit(st["pending"], None, None, st["accepted"], st["bonus"], **{**kw, "length": st["length"][:2]})
    with pytest.raises(ValueError, match=r"emit: tokens must be \(3, n\) with unit column stride"):
        emit(st["pending"], None, None, st["accepted"], st["bonus"], **{**kw, "tokens": st["tokens"][:, ::2]})
    with pytest.raises(ValueError, match="emit: every tensor must be on one device"):
        emit(st["pending"], None, None, st["accepted"], st["bonus"],
             **{**kw, "seq_len": torch.zeros(3, dtype=torch.long, device="meta")})
    with pytest.raises(ValueError, match="emit: the per-sequence tensors must be contiguous"):
        emit(st["pending"], None, None, st["accepted"], st["bonus"],
             **{**kw, "emitted": torch.zeros(6, dtype=torch.long, device=device)[::2]})


@pytest.mark.gpu
def test_emit_at_batch_256_equals_twin():
    st = _state("cuda", B=256, T=6, S=6, D=6, cap=2000, seed=3)
    for chain in (True, False):
        kw = dict(chain=chain, max_new=9, eos=EOS, fold=True)
        got = _run_emit(lambda *a, **k: emit(*a, **k, backend="triton"), st, **kw)
        ref = _run_emit(emit_ref, st, **kw)
        for name in OUTS:
            assert torch.equal(got[name], ref[name]), name


# chain_verdict ----------------------------------------------------------------------------------------------
def _spelled_verdict(target, tokens, match):
    """Python ints: the leading run of matches, the path 0 .. a then 0, the target's token after node a."""
    t, d = target.cpu().tolist(), tokens.cpu().tolist()
    m = None if match is None else match.cpu().tolist()
    acc, path, bonus = [], [], []
    for b in range(len(t)):
        a = 0
        while a < len(d[b]) and (m[b][a] if m is not None else d[b][a] == t[b][a]):
            a += 1
        acc.append(a)
        path.append([k if k <= a else 0 for k in range(len(d[b]) + 1)])
        bonus.append(t[b][a])
    return acc, path, bonus


@pytest.mark.parametrize("oracle", [False, True], ids=["tokens", "match"])
@pytest.mark.parametrize("B,S", [(64, 6), (9, 1), (5, 13)])
def test_chain_verdict_kernel_equals_twin_and_the_law(device, oracle, B, S):
    g = torch.Generator().manual_seed(S)
    target = torch.randint(0, 3, (B, S + 1), generator=g)  # three tokens: every accepted length occurs
    tokens = torch.where(torch.rand(B, S, generator=g) < 0.8, target[:, :-1], torch.randint(0, 3, (B, S), generator=g))
    match = (torch.rand(B, S, generator=g) < 0.8).to(device) if oracle else None
    target, tokens = target.to(device), tokens.to(device)
    got = chain_verdict(target, tokens, match, backend="triton")
    ref = chain_verdict_ref(target, tokens, match)
    law = _spelled_verdict(target, tokens, match)
    for g_, r_, l_ in zip(got, ref, law):
        assert g_.dtype == torch.long and g_.cpu().tolist() == l_ and torch.equal(g_, r_)
    if B == 64:
        assert set(law[0]) == set(range(S + 1))


def test_chain_verdict_law_catches_a_count_of_all_matches(device):
    """The spelled law is not vacuous: counting every match instead of the leading run differs from it."""
    target = torch.tensor([[1, 2, 3, 4]], device=device)
    tokens = torch.tensor([[1, 9, 3]], device=device)  # a match after the first mismatch
    acc, _, _ = chain_verdict(target, tokens, backend="triton")
    assert acc.tolist() == [1] == _spelled_verdict(target, tokens, None)[0]
    assert int((tokens == target[:, :-1]).sum()) == 2


def test_chain_verdict_refuses_mismatched_shapes(device):
    with pytest.raises(ValueError, match=r"target has shape \(2, 3\), expected \(2, 4\)"):
        chain_verdict(torch.zeros(2, 3, dtype=torch.long, device=device), torch.zeros(2, 3, dtype=torch.long,
                                                                                          device=device))
    with pytest.raises(ValueError, match="match must be bool"):
        chain_verdict(torch.zeros(2, 4, dtype=torch.long, device=device), torch.zeros(2, 3, dtype=torch.long,
                      device=device), torch.zeros(2, 3, dtype=torch.long, device=device))


@pytest.mark.gpu
def test_chain_verdict_at_batch_256_equals_twin():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 2, (256, 7), generator=g).cuda()
    tokens = torch.randint(0, 2, (256, 6), generator=g).cuda()
    for got, ref in zip(chain_verdict(target, tokens, backend="triton"), chain_verdict_ref(target, tokens, None)):
        assert torch.equal(got, ref)
