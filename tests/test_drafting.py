"""Drafters without a model: PNG lookups on hand-made histories, prefix-tree merging, the oracle's
controlled acceptance, static shapes, the registry and its errors."""
from pathlib import Path

import pytest
import torch
import yaml

from ssmspec.drafting import DraftTree, drafter_names, make_drafter, merge_chains
from ssmspec.drafting.oracle import Oracle, expected_accepted
from ssmspec.drafting.base import TokenBuffer
from ssmspec.drafting.png import ngram_drafts, ngram_drafts_device
from ssmspec.drafting.static_tree import SHAPES, StaticTree, check_parents
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.paths import CONF_DIR
from ssmspec.verify import GreedyVerifier


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# PNG ----------------------------------------------------------------------------------------------
def test_png_finds_the_continuation_of_the_last_ngram():
    h = [1, 2, 3, 4, 9, 7, 1, 2, 3]
    assert ngram_drafts(h, ngram=3, num_drafts=1, draft_len=2) == [[4, 9]]
    assert ngram_drafts(h, ngram=3, num_drafts=1, draft_len=4) == [[4, 9, 7, 1]]


def test_png_multiple_drafts_most_recent_first_then_shorter_ngrams():
    h = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 0, 2, 3, 6, 6, 1, 2, 3]
    assert ngram_drafts(h, ngram=3, num_drafts=2, draft_len=2) == [[7, 8], [4, 5]]
    # a third draft comes from the 2-gram [2, 3] (at 11: -> 6, 6), after both 3-gram matches
    assert ngram_drafts(h, ngram=3, num_drafts=3, draft_len=2) == [[7, 8], [4, 5], [6, 6]]
    # identical continuations are kept once: 2-gram matches at 6 and 1 repeat the 3-gram drafts
    assert ngram_drafts(h, ngram=2, num_drafts=3, draft_len=2) == [[6, 6], [7, 8], [4, 5]]


def test_png_fill_rules():
    # no match at all: the pending token repeated
    assert ngram_drafts([4, 5, 6], ngram=2, num_drafts=2, draft_len=3) == [[6, 6, 6], [6, 6, 6]]
    # a continuation running into the end is padded with its last token; the rest is filled
    h = [8, 9, 8, 9]
    assert ngram_drafts(h, ngram=2, num_drafts=2, draft_len=4) == [[8, 9, 9, 9], [9, 9, 9, 9]]
    assert ngram_drafts([7], ngram=3, num_drafts=1, draft_len=2) == [[7, 7]]  # history of the pending token only


def test_png_drafter_chains_and_merged_tree():
    hist = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3], [5, 5, 5, 5]]
    d = make_drafter("png", ngram=3, num_drafts=2, draft_len=3)
    d.reset(hist, batch=2, device="cpu")
    tree = d.propose(hist, torch.tensor([3, 5]))
    assert d.spec.draft_len == 3 and d.spec.num_drafts == 2 and not d.is_tree
    assert tree.num_chains == 2 and tree.chains().tolist() == [[[4, 6, 1], [4, 5, 1]], [[5, 5, 5], [5, 5, 5]]]
    m = make_drafter("png", ngram=3, num_drafts=2, draft_len=3, merge=True)
    assert m.is_tree and m.spec.tree_size == 6
    mt = m.propose(hist, torch.tensor([3, 5]))
    assert mt.size == 6 and mt.max_depth() == 3
    assert mt.tokens[0, :4].tolist() == [4, 6, 1, 5] and mt.parents[0, :4].tolist() == [0, 1, 2, 1]
    assert d.describe() == {"name": "png", "ngram": 3, "num_drafts": 2, "draft_len": 3, "min_ngram": 1, "merge": False,
                            "on_device": d.on_device}


# merging ------------------------------------------------------------------------------------------
def _buffer(histories: list[list[int]], capacity: int) -> TokenBuffer:
    toks = torch.zeros(len(histories), capacity, dtype=torch.long)
    for b, h in enumerate(histories):
        toks[b, :len(h)] = torch.tensor(h)
        toks[b, len(h):] = torch.randint(0, 4, (capacity - len(h),))  # stale columns must not matter
    n = torch.tensor([len(h) for h in histories])
    return TokenBuffer(tokens=toks, length=n, prompt_len=n.clone())


@pytest.mark.parametrize("ngram,min_ngram,num_drafts,draft_len", [
    pytest.param(3, 1, 1, 4, id="png3-d1-S4"), pytest.param(3, 1, 3, 2, id="png3-d3-S2"),
    pytest.param(6, 2, 2, 6, id="png6-min2-d2-S6"), pytest.param(1, 1, 4, 3, id="png1-d4-S3"),
    pytest.param(4, 4, 2, 5, id="png4-min4-d2-S5")])
def test_png_device_lookup_equals_the_host_lookup(ngram, min_ngram, num_drafts, draft_len):
    """Random histories over a 4-token vocabulary (many repeated n-grams, ties, duplicate continuations,
    continuations running off the end, histories of 1-3 tokens): the device op equals ngram_drafts."""
    g = torch.Generator().manual_seed(ngram * 100 + num_drafts)
    hists = [torch.randint(0, 4, (int(n),), generator=g).tolist()
             for n in torch.randint(1, 40, (48,), generator=g)] + [[2], [2, 2], [1, 2, 1]]
    buf = _buffer(hists, capacity=45)
    got = ngram_drafts_device(buf.tokens, buf.length, ngram=ngram, num_drafts=num_drafts, draft_len=draft_len,
                              min_ngram=min_ngram)
    want = [ngram_drafts(h, ngram=ngram, num_drafts=num_drafts, draft_len=draft_len, min_ngram=min_ngram)
            for h in hists]
    assert got.tolist() == want


def test_png_drafter_on_device_reads_the_token_buffer_without_host_syncs(monkeypatch):
    d = make_drafter("png", ngram=3, num_drafts=2, draft_len=3)
    assert d.on_device and not make_drafter("png", ngram=3, num_drafts=2, draft_len=3, merge=True).on_device
    hist = [[1, 2, 3, 4, 9, 7, 1, 2, 3], [5, 5, 6, 5, 5]]
    buf = _buffer(hist, capacity=16)
    want = d.propose(hist, torch.tensor([3, 5])).tokens
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("host sync in propose_device"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("host sync in propose_device"))
    assert torch.equal(d.propose_device(buf).tokens, want)


def test_merge_dedups_shared_prefixes_and_keeps_every_chain():
    chains = torch.tensor([[[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 2, 3]], [[9, 9, 9]] * 4])
    t = DraftTree.merge_chains(chains)
    assert t.size == 7  # 1-2-3, 4 under 2, 5-6-7; the repeated chain adds nothing
    assert t.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7] and t.parents[0].tolist() == [0, 1, 2, 2, 0, 5, 6]
    assert t.tokens[1, :3].tolist() == [9, 9, 9] and t.parents[1, :3].tolist() == [0, 1, 2]
    # padding: copies of node 1 under the root
    assert t.tokens[1, 3:].tolist() == [9] * 4 and t.parents[1, 3:].tolist() == [0] * 4
    # every chain is a root path of the merged tree
    toks = torch.cat([torch.zeros_like(t.tokens[:, :1]), t.tokens], 1)
    anc = t.ancestor_mask()
    for b in range(2):
        paths = {tuple(toks[b, anc[b, n]].tolist()[1:]) for n in range(1, t.size + 1)}
        for c in chains[b].tolist():
            assert tuple(c) in paths


def test_merged_tree_accepts_like_the_best_chain():
    g = torch.Generator().manual_seed(0)
    chains = torch.tensor([[[3, 1, 4], [3, 1, 5], [2, 7, 1]]]).expand(64, 3, 3).clone()
    B, D, S = chains.shape
    chains[:, 1, 2] = torch.randint(0, 8, (B,), generator=g)
    target = torch.randint(0, 8, (B, S + 1), generator=g)  # the target's argmax after k matched tokens
    target[:40, 0] = 3
    target[:20, 1] = 1
    merged = merge_chains(chains, size=D * S)
    assert merged.size == D * S
    # node logits: the target's next token depends only on the depth reached along a matching path
    logits = torch.nn.functional.one_hot(target, 8).float()
    node_logits = logits.gather(1, merged.depths_with_root()[..., None].expand(-1, -1, 8))
    v = GreedyVerifier().verify(node_logits, merged)
    best = torch.zeros(B, dtype=torch.long)
    for d in range(D):
        ok = (chains[:, d] == target[:, :S]).long().cumprod(1).sum(1)
        best = torch.maximum(best, ok)
    assert torch.equal(v.accepted, best) and best.max() >= 2


def test_merge_bad_input():
    with pytest.raises(ValueError, match="deterministic drafts only"):
        merge_chains(torch.zeros(1, 2, 2, dtype=torch.long), q=torch.ones(1, 2, 2, 4))
    with pytest.raises(ValueError, match="size >= 4"):
        merge_chains(torch.tensor([[[1, 2], [3, 4]]]), size=3)


# static shapes ------------------------------------------------------------------------------------
# seed 003 Table 4: max width, depth and tokens (root included) of configurations A-E
TABLE4 = {"A": (3, 4, 13), "B": (16, 3, 29), "C": (6, 3, 16), "D": (4, 4, 13), "E": (3, 5, 16)}


@pytest.mark.parametrize("name", sorted(TABLE4))
def test_static_shapes_match_seed_003_table4(name):
    depth = check_parents(SHAPES[name])
    width = max(depth.count(d) for d in range(1, max(depth) + 1))
    assert (width, max(depth), len(depth)) == TABLE4[name]
    d = StaticTree(draft="tiny-mamba2", shape=name)  # built lazily: no model yet
    assert d.is_tree and d.spec.tree_size == len(depth) - 1 and d.spec.draft_len == max(depth)


# oracle -------------------------------------------------------------------------------------------
REF = [[int(x) for x in torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(b))] for b in range(3)]
PROMPTS = [[1, 2], [3], [4, 5, 6]]


def _oracle_steps(oracle, steps, advance=1):
    """Proposals at emitted counts 1, 1+advance, ...: yields (truth (B, S), drafts)."""
    oracle.reset(PROMPTS, batch=3, device="cpu")
    S = oracle.spec.draft_len
    for i in range(steps):
        k = 1 + i * advance
        hist = [p + r[:k] for p, r in zip(PROMPTS, REF)]
        yield torch.tensor([r[k:k + S] for r in REF]), oracle.propose(hist, torch.tensor([r[k - 1] for r in REF]))


def test_oracle_p1_is_the_truth_and_p0_never():
    for truth, drafts in _oracle_steps(Oracle(p=1.0, draft_len=5, num_drafts=2, reference=REF, vocab_size=50), 20):
        assert torch.equal(drafts.chains(), truth[:, None].expand(-1, 2, -1))
    for truth, drafts in _oracle_steps(Oracle(p=0.0, draft_len=5, reference=REF, vocab_size=50), 20):
        assert (drafts.chains()[:, 0] != truth).all()
        assert ((drafts.tokens >= 0) & (drafts.tokens < 50)).all()


def test_oracle_acceptance_rate_is_p():
    """Per-token agreement ~ p, and greedy acceptance is the truncated geometric P(a >= k) = p^k."""
    p, S, steps = 0.6, 4, 300
    agree, accepted = [], []
    for truth, drafts in _oracle_steps(Oracle(p=p, draft_len=S, reference=REF, vocab_size=50, seed=3), steps, 1):
        agree.append(drafts.tokens == truth)
        # the target's argmax at node i is the true token i (a greedy target that the reference came from)
        logits = torch.nn.functional.one_hot(torch.cat([truth, truth[:, -1:]], 1), 50).float()
        accepted.append(GreedyVerifier().verify(logits, drafts).accepted)
    n = 3 * S * steps
    rate = torch.cat(agree).double().mean().item()
    assert abs(rate - p) < 4 * (p * (1 - p) / n) ** 0.5
    acc = torch.cat(accepted).double()
    expect = sum(p ** k for k in range(1, S + 1))  # E[a] = sum_k P(a >= k)
    assert abs(acc.mean().item() - expect) < 4 * acc.std().item() / len(acc) ** 0.5
    for k in range(1, S + 1):
        assert abs((acc >= k).double().mean().item() - p ** k) < 0.06


@pytest.mark.parametrize("tree", [None, "A"])
def test_forced_oracle_keeps_its_acceptance_when_the_target_disagrees_with_the_reference(tree):
    """A target whose argmax is never the reference's token (a bf16 run that left it): compared drafts are
    never accepted; forced drafts are accepted exactly along their kept nodes -- the counts of a target that
    agrees -- and the bonus is still the target's own argmax."""
    kw = dict(tree=tree) if tree else dict(draft_len=4)
    V = 50
    counts, bonus = {}, {}
    for forced, agree in ((False, False), (True, False), (True, True), (False, True)):
        acc, bon = [], []
        for truth, drafts in _oracle_steps(Oracle(p=0.7, reference=REF, vocab_size=V, seed=5, forced=forced, **kw),
                                           60, 1):
            assert (drafts.match is not None) == forced
            depth = drafts.depths_with_root()  # (B, 1+T): node i is followed by the true token of depth d_i + 1
            nxt = torch.cat([truth, truth[:, -1:]], 1).gather(1, depth)
            # agreeing target: argmax = the reference's next token; disagreeing: token V, which no draft holds
            logits = torch.nn.functional.one_hot(nxt if agree else torch.full_like(nxt, V), V + 1).float()
            v = GreedyVerifier().verify(logits, drafts)
            acc.append(v.accepted)
            bon.append(v.bonus)
        counts[forced, agree], bonus[forced, agree] = torch.cat(acc), torch.cat(bon)
    assert counts[False, False].sum() == 0
    assert torch.equal(counts[True, False], counts[True, True])
    assert torch.equal(counts[True, True], counts[False, True])  # forced == compared when the target agrees
    assert counts[True, False].double().mean() > 0.5
    assert (bonus[True, False] == V).all()  # the target's own argmax, not the reference's


def test_oracle_tree_and_seeding():
    o = Oracle(p=1.0, tree="A", reference=REF, vocab_size=50)
    assert o.is_tree and o.spec.tree_size == 12 and o.spec.draft_len == 4
    for truth, drafts in _oracle_steps(o, 3):
        depth = drafts.depths_with_root()[:, 1:]
        assert torch.equal(drafts.tokens, truth.gather(1, depth - 1))
    a = [d.tokens for _, d in _oracle_steps(Oracle(p=0.5, draft_len=3, reference=REF, vocab_size=50, seed=9), 5)]
    b = [d.tokens for _, d in _oracle_steps(Oracle(p=0.5, draft_len=3, reference=REF, vocab_size=50, seed=9), 5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_expected_accepted_closed_forms():
    """Chains: sum_k p^k; D chains: sum_k 1 - (1 - p^k)^D; p = 1 reaches the tree's depth, p = 0 nothing."""
    for p in (0.0, 0.3, 0.7, 1.0):
        assert expected_accepted(p, draft_len=4) == pytest.approx(sum(p ** k for k in range(1, 5)))
        assert expected_accepted(p, draft_len=3, num_drafts=2) == pytest.approx(
            sum(1 - (1 - p ** k) ** 2 for k in range(1, 4)))
    assert expected_accepted(1.0, tree="E") == pytest.approx(5.0)
    assert expected_accepted(0.0, tree="B") == 0.0
    # a node with 3 children at p = 0.5: the first layer alone is accepted with 1 - 0.5^3
    assert expected_accepted(0.5, tree=[0, 0, 0]) == pytest.approx(0.875)
    # wider beats the chain of the same depth at p < 1
    assert expected_accepted(0.6, tree="A") > expected_accepted(0.6, draft_len=4)
    # rank_decay: the second and third children at 0.5 * 0.5 and 0.5 * 0.25
    assert expected_accepted(0.5, tree=[0, 0, 0], rank_decay=0.5) == pytest.approx(1 - 0.5 * 0.75 * 0.875)
    assert expected_accepted(0.5, tree="A", rank_decay=0.0) == pytest.approx(expected_accepted(0.5, draft_len=4))
    with pytest.raises(ValueError, match="rank_decay ranks the children of a tree"):
        Oracle(p=0.5, draft_len=3, rank_decay=0.5)


@pytest.mark.parametrize("tree,decay", [("A", 1.0), ("B", 1.0), ("D", 0.5), ([0, 1, 1, 0, 4], 1.0), ("E", 0.5)])
def test_tree_oracle_accepts_per_branch_as_expected(tree, decay):
    """Forced tree oracle under greedy verification: the mean accepted length matches the exact recursion
    (children kept with p * decay^rank), and a single chain of the same depth would not."""
    p, steps = 0.6, 400
    o = Oracle(p=p, tree=tree, reference=REF, vocab_size=50, seed=11, forced=True, rank_decay=decay)
    acc = []
    for _, drafts in _oracle_steps(o, steps, 0):
        logits = torch.zeros(3, 1 + drafts.size, 50)  # forced: the kept nodes are accepted, whatever the target
        acc.append(GreedyVerifier().verify(logits, drafts).accepted)
    acc = torch.cat(acc).double()
    expect = o.expected_accepted()
    assert abs(acc.mean().item() - expect) < 4 * acc.std().item() / len(acc) ** 0.5
    depth = o.spec.draft_len
    assert abs(expect - sum(p ** k for k in range(1, depth + 1))) > 8 * acc.std().item() / len(acc) ** 0.5


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_oracle_p_outside_unit_interval(p):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        make_drafter("oracle", p=p)


def test_oracle_needs_a_reference():
    with pytest.raises(ValueError, match="reference= .* or target="):
        Oracle(p=0.5).reset(PROMPTS, batch=3, device="cpu")
    with pytest.raises(ValueError, match="3 sequences"):
        Oracle(p=0.5, reference=REF, vocab_size=50).reset(PROMPTS[:2], batch=2, device="cpu")


# registry and bad input ---------------------------------------------------------------------------
def test_registry():
    assert set(drafter_names()) == {"none", "async_draft", "png", "draft_model", "static_tree", "beam_tree", "oracle", "mtp"}
    assert make_drafter("none") is None
    with pytest.raises(ValueError, match="unknown drafter 'ngram'.*png"):
        make_drafter("ngram")
    with pytest.raises(ValueError, match="'none' takes no options"):
        make_drafter("none", draft_len=3)
    with pytest.raises(ValueError, match="no option.*'n'.*ngram"):
        make_drafter("png", n=3)


@pytest.mark.parametrize("name,opts", [("beam_tree", {"num_drafts": 2}), ("static_tree", {"draft_len": 3}),
                                       ("oracle", {"tree": "A", "num_drafts": 2}),
                                       ("oracle", {"tree": [0, 0, 1], "draft_len": 3})])
def test_tree_drafter_refuses_chain_settings(name, opts):
    with pytest.raises(ValueError, match="chain setting"):
        make_drafter(name, draft="tiny-mamba2", **opts) if name != "oracle" else make_drafter(name, **opts)


def test_other_bad_options():
    with pytest.raises(ValueError, match="greedy chains .* identical"):
        make_drafter("draft_model", draft="tiny-mamba2", num_drafts=2)
    with pytest.raises(ValueError, match="unknown static tree shape 'Z'"):
        make_drafter("static_tree", draft="tiny-mamba2", shape="Z")
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        make_drafter("static_tree", draft="tiny-mamba2", shape=[0, 2])
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        make_drafter("beam_tree", draft="nope")
    with pytest.raises(ValueError, match="no speculation"):
        make_drafter("png", draft_len=0)


def test_every_drafter_config_builds():
    files = sorted((CONF_DIR / "drafter").glob("*.yaml"))
    assert {f.stem for f in files} == set(drafter_names())
    for f in files:
        cfg = yaml.safe_load(Path(f).read_text())
        name = cfg.pop("name")
        assert name == f.stem
        if name == "mtp":  # the run passes the target whose head drafts (config.build_drafter's extra options)
            cfg["target"] = build_model(load_preset("tiny-qwen3.5").replace(mtp_layers=1), seed=0)
        d = make_drafter(name, **cfg)
        assert (d is None) == (name == "none")
        if d is not None:
            assert d.describe()["name"] == name and d.spec.draft_len >= 1
