"""A decode step's emit in one launch against its twin and against a per-row spelling of the law (``ops/emit``):
tokens written, lengths, emitted counts, finished flags, report, seq_len and the pending token, exactly, over
random verdicts of chains and trees, with and without EOS, rows at the budget, rows already finished."""
import pytest
import torch

from ssmspec.ops.emit import emit, emit_ref

EOS = 4


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


def _run(fn, st, *, chain, max_new, eos, fold):
    s = {k: v.clone() for k, v in st.items()}
    d, p = (s["drafts"], s["path"]) if chain else (None, None)
    acc = s["accepted"] if chain else torch.zeros_like(s["accepted"])
    fn(s["pending"], d, p, acc, s["bonus"], tokens=s["tokens"], length=s["length"], emitted=s["emitted"],
       done=s["done"], seq_len=s["seq_len"], report=s["report"], max_new=max_new, eos=eos, fold=fold)
    return s


def _spelled(st, *, chain, max_new, eos, fold):
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
        got = _run(lambda *a, **k: emit(*a, **k, backend="triton"), st, **kw)
        ref = _run(emit_ref, st, **kw)
        law = _spelled(st, **kw)
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
    law = _spelled(st, **kw)
    n = law["report"]
    assert any(r[5] < a + 1 for r, a in zip(n, st["accepted"].tolist()))
    no_eos = _run(lambda *a, **k: emit_ref(*a, **{**k, "eos": None}), st, **kw)
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


@pytest.mark.gpu
def test_emit_at_batch_256_equals_twin():
    st = _state("cuda", B=256, T=6, S=6, D=6, cap=2000, seed=3)
    for chain in (True, False):
        kw = dict(chain=chain, max_new=9, eos=EOS, fold=True)
        got = _run(lambda *a, **k: emit(*a, **k, backend="triton"), st, **kw)
        ref = _run(emit_ref, st, **kw)
        for name in OUTS:
            assert torch.equal(got[name], ref[name]), name
