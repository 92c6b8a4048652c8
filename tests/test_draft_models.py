"""Model-based drafters (float64, tiny presets): the draft-model drafter proposes exactly the draft
model's own greedy continuation, also after partial acceptance and after a bonus it did not predict;
beam-search and static trees equal a brute-force search over independent full forwards; every drafter
runs inside generate() and keeps greedy decoding lossless."""
import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.drafting.model_drafter import token_buffer
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import make_strategy, strategy_names
from ssmspec.verify import SamplingConfig
from model_forward import next_logits

PROMPTS = [[5, 17, 33, 8, 5, 17], [9, 10, 11]]
NEW = 14


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tiny-mamba2", "tiny-hybrid", "tiny-mamba-in-llama", "tiny-qwen3.5",
                                          "tiny-qwen3-next"])
def models(request):
    cfg = load_preset(request.param)
    draft = build_model(cfg, seed=1, dtype=torch.float64)
    target = build_model(cfg, seed=0, dtype=torch.float64)
    ref = generate(draft, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    return draft, target, ref



def test_draft_model_chain_is_its_greedy_continuation_after_partial_acceptance(models):
    draft, _, ref = models
    S = 4
    d = make_drafter("draft_model", draft=draft, draft_len=S)
    d.reset(PROMPTS, batch=2, device="cpu")
    k = [1, 1]  # tokens emitted so far (pending included), both along the reference
    for accept in [(0, 4), (2, 1), (4, 0), (1, 3)]:  # accepted drafts per sequence, then a correct bonus
        hist = [p + r[:n] for p, r, n in zip(PROMPTS, ref, k)]
        tree = d.propose(hist, torch.tensor([h[-1] for h in hist]))
        assert tree.num_chains == 1 and tree.q is None and tree.max_depth() == S
        assert tree.chains()[:, 0].tolist() == [r[n:n + S] for r, n in zip(ref, k)]
        k = [n + a + 1 for n, a in zip(k, accept)]
    # a bonus the draft did not predict: the drafts continue the new history greedily
    hist = [p + r[:n] for p, r, n in zip(PROMPTS, ref, k)]
    hist = [h + [(h[-1] * 7 + 3) % 300] if b == 0 else h for b, h in enumerate(hist)]
    tree = d.propose(hist, torch.tensor([h[-1] for h in hist]))
    expect = generate(draft, [hist[0]], max_new_tokens=S, strategy="autoregressive", timing=False).sequences[0]
    assert tree.chains()[0, 0].tolist() == expect


def test_engine_logits_match_fresh_forwards(models):
    """The draft engine's absorb and depth logits equal one fresh prefill of each row's path: ragged catch-ups
    (right padding masked; a sequence with nothing new keeps its root), rows moving to other parents (beam
    reordering, both slot parities), several steps in a row."""
    draft, _, ref = models
    W, S = 2, 4
    d = make_drafter("beam_tree", draft=draft, beams=W, depth=S)
    d.reset(PROMPTS, batch=2, device="cpu")
    eng = d.engine
    for r_i, k in enumerate([(1, 1), (2, 6), (7, 7), (8, 12), (13, 12)]):  # catch-ups of 0 .. A tokens
        hist = [p + r[:n] for p, r, n in zip(PROMPTS, ref, k)]
        root = eng.absorb(token_buffer(hist, [len(p) for p in PROMPTS], "cpu"))
        for b in range(2):
            torch.testing.assert_close(root[b], next_logits(draft, hist[b]), atol=1e-6, rtol=0)
        paths = [[[3 + r_i], [4]], [[5], [6 + r_i]]]  # rows (b, w) = 2b + w
        out = eng.step(torch.tensor([3 + r_i, 4, 5, 6 + r_i]), depth=1)
        swap = torch.tensor([1, 0, 2, 2])  # sequence 0's rows swap parents, sequence 1's both follow its row 0
        paths = [[paths[0][1], paths[0][0]], [paths[1][0], paths[1][0]]]
        nxt = torch.tensor([7, 8, 9, 10 + r_i])
        out = eng.step(nxt, depth=2, parents=swap)
        paths = [[p + [int(nxt[2 * b + w])] for w, p in enumerate(ps)] for b, ps in enumerate(paths)]
        out = eng.step(torch.tensor([11, 12, 13, 14]), depth=3, parents=torch.tensor([0, 0, 3, 2]))
        paths = [[paths[0][0], paths[0][0]], [paths[1][1], paths[1][0]]]
        for r in range(4):
            b, w = divmod(r, 2)
            torch.testing.assert_close(out[r], next_logits(draft, hist[b] + paths[b][w] + [11 + r]), atol=1e-6, rtol=0)


def test_sampled_draft_model_records_q(models):
    draft, _, _ = models
    d = make_drafter("draft_model", draft=draft, draft_len=3, num_drafts=2, temperature=1.0, top_k=20, sample_seed=4)
    d.reset(PROMPTS, batch=2, device="cpu")
    hist = [p + [7] for p in PROMPTS]
    tree = d.propose(hist, torch.tensor([7, 7]))
    assert tree.q.shape == (2, 6, draft.cfg.vocab_size) and tree.num_chains == 2
    assert torch.allclose(tree.q.sum(-1), torch.ones(2, 6, dtype=tree.q.dtype))
    assert ((tree.q > 0).sum(-1) == 20).all()  # top-k 20
    assert (tree.q.gather(2, tree.tokens[..., None]) > 0).all()  # every token drawn from its q
    first = torch.softmax(next_logits(draft, hist[1]).float(), -1)
    top = first.topk(20)
    expect = torch.zeros_like(first).scatter(0, top.indices, top.values / top.values.sum())
    assert torch.allclose(tree.q[1, 0].float(), expect, atol=1e-5)


def test_beam_tree_is_an_n_by_m_beam_search(models):
    draft, _, ref = models
    M, N = 3, 3
    d = make_drafter("beam_tree", draft=draft, beams=M, depth=N)
    assert d.is_tree and d.spec.tree_size == M * N and d.spec.draft_len == N
    d.reset(PROMPTS, batch=2, device="cpu")
    hist = [p + r[:2] for p, r in zip(PROMPTS, ref)]
    tree = d.propose(hist, torch.tensor([h[-1] for h in hist]))
    assert tree.tokens.shape == (2, M * N) and tree.max_depth() == N
    layer = torch.arange(M * N) // M  # layer of each node - 1
    assert (tree.parents[:, :M] == 0).all()
    lo, hi = 1 + (layer[M:] - 1) * M, 1 + layer[M:] * M  # parents lie in the previous layer
    assert ((tree.parents[:, M:] >= lo) & (tree.parents[:, M:] < hi)).all()
    assert torch.equal(tree.depths_with_root()[:, 1:] - 1, layer.expand(2, -1))
    for b in range(2):  # brute force: beam search over independent forwards
        beams = [([], 0.0)]
        nodes = []
        for k in range(N):
            cand = []
            for j, (path, score) in enumerate(beams):
                lp = torch.log_softmax(next_logits(draft, hist[b] + path).float(), -1)
                cand += [(score + lp[t].item(), j, t) for t in range(lp.numel())]
            cand.sort(key=lambda c: -c[0])
            top = cand[:M]
            nodes += [(0 if k == 0 else 1 + (k - 1) * M + j, t) for _, j, t in top]
            beams = [(beams[j][0] + [t], s) for s, j, t in top]
        assert tree.tokens[b].tolist() == [t for _, t in nodes]
        assert tree.parents[b].tolist() == [p for p, _ in nodes]


def test_static_tree_takes_ranked_tokens(models):
    draft, _, ref = models
    parents = [0, 0, 1, 1, 1, 2, 3]
    d = make_drafter("static_tree", draft=draft, shape=parents)
    d.reset(PROMPTS, batch=2, device="cpu")
    hist = [p + r[:3] for p, r in zip(PROMPTS, ref)]
    tree = d.propose(hist, torch.tensor([h[-1] for h in hist]))
    assert tree.parents.tolist() == [parents] * 2
    for b in range(2):
        toks = [None] + tree.tokens[b].tolist()
        rank = {}
        for i, p in enumerate(parents, start=1):
            path, n = [], p
            while n:
                path.insert(0, toks[n])
                n = parents[n - 1]
            r = rank[p] = rank.get(p, -1) + 1
            assert toks[i] == next_logits(draft, hist[b] + path).topk(r + 1).indices[r].item()


DRAFTERS = [("draft_model", {"draft_len": 3}), ("beam_tree", {"beams": 2, "depth": 3}), ("static_tree", {"shape": "A"})]
# every speculative strategy with the chain drafter, the tree-verifying ones with the tree drafters too
PAIRS = [pytest.param(s, n, o, id=f"{s}-{n}") for s in strategy_names() if s != "autoregressive"
         for n, o in DRAFTERS if n == "draft_model" or make_strategy(s).supports_trees]


@pytest.mark.parametrize("strategy,name,opts", PAIRS)
def test_every_strategy_with_every_draft_model_drafter_is_lossless(models, strategy, name, opts):
    """Greedy output of the target equals its autoregressive output token for token, for every strategy that
    verifies what the drafter drafts, with the draft model of every family (float64 CPU)."""
    draft, target, _ = models
    d = make_drafter(name, draft=draft, **opts)
    want = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=d, timing=False)
    assert out.sequences == want
    if name == "draft_model":  # the target drafting for itself: every draft accepted
        d = make_drafter(name, draft=target, **opts)
        out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=d, timing=False)
        assert out.sequences == want and all(a == 3 for s in out.steps[1:-1] for a in s.accepted)


@pytest.mark.parametrize("draft_preset,target_preset", [("tiny-mamba2", "tiny-qwen3.5"), ("tiny-qwen3.5", "tiny-hybrid"),
                                                         ("tiny-qwen3-next", "tiny-mamba-in-llama")])
def test_a_draft_of_another_family_is_lossless(draft_preset, target_preset):
    draft = build_model(load_preset(draft_preset), seed=1, dtype=torch.float64)
    target = build_model(load_preset(target_preset), seed=0, dtype=torch.float64)
    want = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    for name, opts in DRAFTERS:
        out = generate(target, PROMPTS, max_new_tokens=NEW, strategy="replay", drafter=make_drafter(name, draft=draft, **opts),
                       timing=False)
        assert out.sequences == want


def test_png_in_generate_is_lossless(models):
    _, target, _ = models
    want = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    d = make_drafter("png", num_drafts=2, draft_len=3)
    assert generate(target, PROMPTS, max_new_tokens=NEW, strategy="stree", drafter=d, timing=False).sequences == want


@pytest.mark.skipif("stree" not in strategy_names(), reason="needs a tree-verifying strategy")
def test_oracle_from_target_and_sampled_drafts_in_generate(models):
    draft, target, _ = models
    want = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    o = make_drafter("oracle", p=1.0, draft_len=3, target=target, horizon=NEW + 4)
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy="stree", drafter=o, timing=False)
    assert out.sequences == want and out.mean_accepted() > 2.5
    d = make_drafter("draft_model", draft=draft, draft_len=2, num_drafts=2, temperature=1.0)
    out = generate(target, PROMPTS, max_new_tokens=6, strategy="stree", drafter=d,
                   sampling=SamplingConfig(temperature=1.0, seed=3), timing=False)
    assert [len(s) for s in out.sequences] == [6, 6]


def test_a_draft_of_another_vocabulary_is_refused_naming_both_models():
    target = build_model(load_preset("tiny-mamba2"), seed=0)
    draft = build_model(load_preset("tiny-mamba2").replace(name="tiny-mamba2-v512", vocab_size=512), seed=0)
    for name, opts in [("draft_model", {"draft_len": 2}), ("beam_tree", {"beams": 2, "depth": 2}),
                       ("static_tree", {"shape": "A"})]:
        d = make_drafter(name, draft=draft, **opts)
        with pytest.raises(ValueError, match=r"^draft model tiny-mamba2-v512 has a vocabulary of 512 tokens but "
                                             r"target tiny-mamba2 has 300; draft with a model of the target's"):
            generate(target, PROMPTS, max_new_tokens=4, strategy="stree", drafter=d, timing=False)


def test_a_draft_strategy_that_cannot_roll_back_is_refused_naming_both_models():
    target = build_model(load_preset("tiny-hybrid"), seed=0)
    d = make_drafter("draft_model", draft="tiny-mamba2", draft_len=2, draft_strategy="replay")
    with pytest.raises(ValueError, match=r"^draft model tiny-mamba2 \(drafting for tiny-hybrid\): strategy 'replay' "
                                         r"keeps one state per sequence and verify window.*draft_strategy=snapshot$"):
        generate(target, PROMPTS, max_new_tokens=4, strategy="snapshot", drafter=d, timing=False)
    with pytest.raises(ValueError, match="unknown draft_strategy 'nope'"):
        make_drafter("beam_tree", draft="tiny-mamba2", draft_strategy="nope")


def test_draft_engine_refuses_calls_outside_its_shape():
    draft = build_model(load_preset("tiny-mamba2"), seed=1)
    chains = make_drafter("draft_model", draft=draft, draft_len=3)
    chains.reset(PROMPTS, batch=2, device="cpu")
    tok = torch.zeros(2, dtype=torch.long)
    for depth in (0, 3):
        with pytest.raises(ValueError, match=rf"draft depth {depth} outside 1 .. 2"):
            chains.engine.step(tok, depth=depth)
    with pytest.raises(ValueError, match="built with reorders=False: its rows cannot change parents"):
        chains.engine.step(tok, depth=1, parents=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="token buffer has 3 sequences but the drafter was reset for 2"):
        chains.propose_device(token_buffer([[1, 2], [3, 4], [5, 6]], [1, 1, 1], "cpu"))


def test_costed_oracle_needs_the_drafters_spec():
    from ssmspec.drafting.costed import CostedOracle
    from ssmspec.drafting.oracle import Oracle

    oracle = Oracle(p=0.5, draft_len=3, reference=[[1, 2, 3]] * 2, vocab_size=300)
    with pytest.raises(ValueError, match=r"the oracle drafts SpecConfig\(draft_len=3.*but the costed drafter "
                                         r"draft_model drafts SpecConfig\(draft_len=2.*same draft_len"):
        CostedOracle(oracle, make_drafter("draft_model", draft="tiny-mamba2", draft_len=2))


def test_resume_without_a_row_names_row_zero_of_one_row_engines(models):
    """``resume(None, accepted)`` (one chain: its row is row 0) keeps the resumed row at 0; an engine of several
    drafting rows per sequence refuses it, since it cannot know which row the target accepted, and changes nothing."""
    from ssmspec.engine.draft import DraftEngine

    draft = models[0]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    one = DraftEngine(draft, width=1, depth=4, reorders=False, resumes=True)
    one.reset(prompts, max_new_tokens=16)
    one.resume(None, torch.tensor([2, 9]))
    assert one.skip.tolist() == [2, 3] and one.skip_row.tolist() == [0, 0]  # clamped at S - 1
    two = DraftEngine(draft, width=2, depth=4, reorders=False, resumes=True)
    two.reset(prompts, max_new_tokens=16)
    before = two.skip.clone()
    with pytest.raises(ValueError, match="names row 0"):
        two.resume(None, torch.tensor([1, 1]))
    assert torch.equal(two.skip, before)  # refused before anything changed
