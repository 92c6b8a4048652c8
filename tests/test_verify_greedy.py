"""Greedy verification against a brute-force walk: for random trees (duplicate siblings, ragged depths)
and chains, the verdict is the deepest path whose every token is the target's argmax at its parent
(first such node in topological order on ties), the bonus the argmax there."""
import pytest
import torch

from ssmspec.drafting.base import DraftTree
from ssmspec.verify import GreedyVerifier


def _brute(tokens: list[int], parents: list[int], argmax: list[int]):
    """Deepest accepted node (first on ties), its root-first path, and the bonus."""
    n = len(tokens) + 1
    ok, depth = [True] + [False] * (n - 1), [0] * n
    for i in range(1, n):
        p = parents[i - 1]
        depth[i] = depth[p] + 1
        ok[i] = ok[p] and tokens[i - 1] == argmax[p]
    best = max((i for i in range(n) if ok[i]), key=lambda i: (depth[i], -i))
    path, node = [], best
    while node:
        path.insert(0, node)
        node = parents[node - 1]
    return depth[best], [0] + path, argmax[best]


def _random_tree(T: int, g) -> list[int]:
    return [int(torch.randint(0, i, (), generator=g)) for i in range(1, T + 1)]


@pytest.mark.parametrize("kind", ["tree", "chains"])
def test_greedy_matches_brute_force(kind):
    g = torch.Generator().manual_seed(0 if kind == "tree" else 1)
    B, V = 48, 4  # small vocabulary: many accepted nodes and duplicate siblings
    if kind == "tree":
        T = 10
        parents = torch.tensor([_random_tree(T, g) for _ in range(B)])
        logits = torch.randn(B, T + 1, V, generator=g)
        tokens = torch.randint(0, V, (B, T), generator=g)
        drafts = DraftTree(tokens, parents)
    else:
        D, S = 3, 4
        tokens = torch.randint(0, V, (B, D, S), generator=g)
        drafts = DraftTree.from_chains(tokens)
        logits = torch.randn(B, D * S + 1, V, generator=g)
    # raise acceptance: make many tokens the argmax at their parent
    par = drafts.parents
    hit = torch.rand(par.shape, generator=g) < 0.6
    drafts.tokens = torch.where(hit, logits.argmax(-1).gather(1, par), drafts.tokens)
    v = GreedyVerifier().verify(logits, drafts)
    argmax = logits.argmax(-1)
    depth = drafts.max_depth()
    assert v.path.shape == (B, 1 + depth)
    for b in range(B):
        a, path, bonus = _brute(drafts.tokens[b].tolist(), drafts.parents[b].tolist(), argmax[b].tolist())
        assert v.accepted[b].item() == a
        assert v.path[b, :a + 1].tolist() == path and (v.path[b, a + 1:] == 0).all()
        assert v.bonus[b].item() == bonus
    assert v.accepted.max().item() >= 3


def test_greedy_without_drafts_is_argmax():
    logits = torch.randn(3, 1, 7, generator=torch.Generator().manual_seed(2))
    v = GreedyVerifier().verify(logits, None)
    assert torch.equal(v.bonus, logits[:, 0].argmax(-1)) and (v.accepted == 0).all()


def test_emitted_tokens_follow_the_path():
    tokens = torch.tensor([[5, 6, 7, 8]])
    drafts = DraftTree(tokens, torch.tensor([[0, 0, 2, 3]]), depth=3)
    logits = torch.full((1, 5, 10), -1.0)
    logits[0, 0, 6] = logits[0, 2, 7] = logits[0, 3, 1] = 1.0  # root -> 6 (node 2) -> 7 (node 3), then 1
    v = GreedyVerifier().verify(logits, drafts)
    assert v.accepted.tolist() == [2] and v.path.tolist() == [[0, 2, 3, 0]]
    assert v.emitted(drafts) == [[6, 7, 1]]


def test_greedy_steps_read_the_argmax_in_chunks_with_the_same_verdicts(monkeypatch):
    """The engine hands a greedy verifier the LM head's argmax (``verify_argmax``), made over chunks of positions
    (``HybridLM.argmax``), never the (rows, L, V) logits. The argmax of bf16 values is the argmax of their exact
    fp32 upcast, ties included, so a verifier that ranks the bf16 logits, or reads their fp32 copy, emits the same
    tokens; so does a chunk of two positions (every call of the LM head then sees at most two rows) -- replay spec
    with oracle drafts and autoregressive alike."""
    from ssmspec.drafting.oracle import Oracle
    from ssmspec.engine.generate import generate
    from ssmspec.models import build_model, load_preset
    from ssmspec.models import model as model_mod
    from ssmspec.strategies import SpecConfig

    class Argmax(GreedyVerifier):
        def __init__(self):
            self.dtypes = set()

        def verify(self, node_logits, drafts, generator=None):
            raise AssertionError("a greedy step must hand its verifier the argmax, not logits")

        def verify_argmax(self, target, drafts):
            self.dtypes.add(target.dtype)
            return super().verify_argmax(target, drafts)

    class Ranks(GreedyVerifier):
        argmax_only = False  # asks for the logits themselves, in the model dtype

        def __init__(self):
            self.dtypes = set()

        def verify(self, node_logits, drafts, generator=None):
            self.dtypes.add(node_logits.dtype)
            return super().verify(node_logits, drafts, generator)

    class Fp32(Ranks):
        fp32_logits = True

    model = build_model(load_preset("tiny-hybrid"), seed=0, device="cpu", dtype=torch.bfloat16)
    V, full = model.cfg.vocab_size, model_mod.ARGMAX_CHUNK_BYTES
    rows_seen = []
    logits = model.logits

    def spy(h, **kw):
        rows_seen.append(h.numel() // h.shape[-1])
        return logits(h, **kw)

    monkeypatch.setattr(model, "logits", spy)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 5, 12)]
    ref = generate(model, prompts, max_new_tokens=12, strategy="autoregressive", timing=False).sequences
    for strategy, S in (("autoregressive", 0), ("replay", 3)):
        runs = []
        for rec, chunk in ((Argmax(), None), (Argmax(), 2 * V * 2), (Ranks(), None), (Fp32(), None)):
            if chunk is not None:
                monkeypatch.setattr(model_mod, "ARGMAX_CHUNK_BYTES", chunk)  # two bf16 rows of logits
            rows_seen.clear()
            drafter = Oracle(p=0.7, draft_len=S, reference=ref, vocab_size=V, seed=2) if S else None
            out = generate(model, prompts, max_new_tokens=12, strategy=strategy, drafter=drafter, verifier=rec,
                           spec=SpecConfig(draft_len=S, buffer_size=16), timing=False)
            if chunk is not None:
                assert max(rows_seen) == 2 and len(rows_seen) > 12, rows_seen  # chunked: never more than 2 rows
                monkeypatch.setattr(model_mod, "ARGMAX_CHUNK_BYTES", full)
            else:
                assert max(rows_seen) == len(prompts) * (1 + S)  # the whole call at once
            runs.append((out.sequences, rec.dtypes))
        assert [d for _, d in runs] == [{torch.int64}, {torch.int64}, {torch.bfloat16}, {torch.float32}]
        assert all(seq == runs[0][0] for seq, _ in runs)


@pytest.mark.parametrize("oracle", [False, True], ids=["tokens", "match"])
def test_single_chain_closed_form_equals_the_tree_walk(oracle):
    """One chain (the common case) takes a closed form (matches' leading run); the same drafts given as a plain
    tree (num_chains 0) take the general walk: every verdict field is equal, and equal to the brute force."""
    g = torch.Generator().manual_seed(3)
    B, S, V = 64, 6, 3  # tiny vocabulary: every accepted length 0 .. S occurs
    logits = torch.randn(B, S + 1, V, generator=g)
    argmax = logits.argmax(-1)
    tokens = torch.where(torch.rand(B, S, generator=g) < 0.75, argmax[:, :-1], torch.randint(0, V, (B, S), generator=g))
    chain = DraftTree.from_chains(tokens[:, None])
    assert chain.is_single_chain
    tree = DraftTree(tokens.clone(), chain.parents.clone())  # the same drafts, not declared a chain
    if oracle:  # the forced oracle's word replaces the comparison, in both forms
        match = torch.rand(B, S, generator=g) < 0.7
        chain.match, tree.match = match, match.clone()
    fast, walk = GreedyVerifier().verify(logits, chain), GreedyVerifier().verify(logits, tree)
    assert torch.equal(fast.accepted, walk.accepted) and torch.equal(fast.path, walk.path)
    assert torch.equal(fast.bonus, walk.bonus)
    assert set(fast.accepted.tolist()) == set(range(S + 1))
    if not oracle:
        for b in range(B):
            a, path, bonus = _brute(tokens[b].tolist(), chain.parents[b].tolist(), argmax[b].tolist())
            assert (fast.accepted[b].item(), fast.path[b, :a + 1].tolist(), fast.bonus[b].item()) == (a, path, bonus)


def test_chain_layout_is_the_tree_rule_and_shared():
    """Chains' parents and depths come from one constant per (D, S, device) -- what the general rules compute for
    the same trees -- built once outside a graph capture, so a drafter's step launches nothing for them."""
    from ssmspec.drafting.base import chain_layout

    for D, S in ((1, 1), (1, 5), (3, 4)):
        toks = torch.randint(0, 9, (2, D, S))
        chains = DraftTree.from_chains(toks)
        plain = DraftTree(chains.tokens, chains.parents.contiguous())  # general rules (num_chains 0)
        assert torch.equal(chains.depths_with_root(), plain.depths_with_root())
        for i in range(D * S):  # node 1 + i: first of its chain -> root, else the node before it
            assert chains.parents[0, i].item() == (0 if i % S == 0 else i)
        assert chain_layout(D, S, "cpu")[0] is chain_layout(D, S, "cpu")[0]


def test_chain_layout_keeps_nothing_made_during_a_graph_capture(monkeypatch):
    """A tensor made during a CUDA graph capture is filled only when that graph replays, so a constant first built
    inside a capture must not be kept for later readers: the layout computes its own there and caches nothing;
    outside a capture it is kept (``ops/capture.py:kept``)."""
    import ssmspec.drafting.base as base
    import ssmspec.ops.capture as capture

    monkeypatch.setattr(base, "_CHAIN_LAYOUTS", {})
    monkeypatch.setattr(capture, "capturing", lambda device: True)
    parents, depths = base.chain_layout(2, 3, "cpu")
    assert parents.tolist() == [[0, 1, 2, 0, 4, 5]] and depths.tolist() == [[0, 1, 2, 3, 1, 2, 3]]
    assert not base._CHAIN_LAYOUTS
    monkeypatch.setattr(capture, "capturing", lambda device: False)
    assert base.chain_layout(2, 3, "cpu")[0] is base.chain_layout(2, 3, "cpu")[0]
