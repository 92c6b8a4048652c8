"""`replay` (ReplaySSM, seed 000): lossless greedy decoding (float64) for speculative and standard
decoding, fp32 logits against one full forward, the ring's pointer and flush bookkeeping over many steps
(boundary, smallest R, wrap-around, per-sequence flushes), memory accounting, graph-safety, bad input."""
import dataclasses

import pytest
import torch

from ssmspec.drafting.base import DraftTree
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import MixerInputs, SpecConfig, StepInputs, make_strategy, strategy_names
from ssmspec.verify.base import Verdict
from model_forward import parallel_logits
from strategy_helpers import Recorder

PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13, 14, 15], [42, 7]]  # different lengths: left padding
NEW = 16


class ChainOracle:
    """Test drafter: S tokens of a reference greedy continuation, each kept with probability p (per
    sequence: a list), else replaced by a different random token. With ``parents`` (a static tree, node
    numbers of each draft's parent) the truth goes down the first child at every level, random tokens
    elsewhere."""

    name = "test-oracle"

    def __init__(self, ref, *, p, S=0, seed=0, vocab=300, R=16, parents=None):
        self.ref, self.vocab, self.parents = ref, vocab, parents
        self.p = p if isinstance(p, list) else [p] * len(ref)
        self.gen = torch.Generator().manual_seed(seed)
        self.depth = [0]
        for q in parents or []:
            self.depth.append(self.depth[q] + 1)
        self.S = max(self.depth) if parents else S
        self.is_tree = parents is not None
        self.spec = SpecConfig(draft_len=self.S, tree_size=len(parents) if parents else 0, buffer_size=R)

    def reset(self, prompts, *, batch, device, max_new_tokens=None):
        self.plen = [len(p) for p in prompts]

    def _rand(self):
        return int(torch.randint(3, self.vocab, (), generator=self.gen))

    def _draft(self, b, t):
        if torch.rand((), generator=self.gen).item() < self.p[b]:
            return t
        return 3 + (t - 3 + 1 + int(torch.randint(self.vocab - 4, (), generator=self.gen))) % (self.vocab - 3)

    def propose(self, history, pending):
        rows = []
        for b, hist in enumerate(history):
            k = len(hist) - self.plen[b]  # emitted so far, pending included
            truth = list(self.ref[b][k:k + self.S])
            truth += [self._rand() for _ in range(self.S - len(truth))]
            if self.parents is None:
                rows.append([self._draft(b, t) for t in truth])
                continue
            first = {}  # first child of every node carries the truth
            for i, q in enumerate(self.parents):
                first.setdefault(q, i + 1)
            on_path = {first[0]}
            while (nxt := first.get(max(on_path))) is not None:
                on_path.add(nxt)
            rows.append([self._draft(b, truth[self.depth[i + 1] - 1]) if i + 1 in on_path else self._rand()
                         for i in range(len(self.parents))])
        toks = torch.tensor(rows, dtype=torch.long)
        if self.parents is None:
            return DraftTree.from_chains(toks[:, None])
        return DraftTree(toks, torch.tensor(self.parents).expand(len(rows), -1).clone())

    def observe(self, verdict):
        pass


@pytest.fixture(scope="module", params=["tiny-mamba2", "tiny-hybrid"])
def setup64(request):
    cfg = load_preset(request.param)
    model = build_model(cfg, seed=0, dtype=torch.float64)
    ref = generate(model, PROMPTS, max_new_tokens=NEW, strategy="autoregressive").sequences
    return model, ref


class RingWatch:
    """Generation hook: after every step, checks the ring bookkeeping against seed 000's rules, given the
    counts before the step -- flush iff h + 2L > R, flush folds the h committed entries (head += h,
    count = 0), commit adds accepted + 1, S0 is stored only on flush steps -- and records what happened."""

    def __init__(self, strat, L, R):
        self.s, self.L, self.R = strat, L, R
        self.flushes, self.wrapped, self.boundary_hits = [], False, 0

    def __call__(self, rec):
        s = self.s
        assert torch.equal(s.count, s.count[:1].expand_as(s.count)) and torch.equal(s.head, s.head[:1].expand_as(s.head))
        count, head, S0 = s.count[0].clone(), s.head[0].clone(), s.ssm_state.clone()
        if rec.index > 0:
            flush = self.count + 2 * self.L > self.R
            acc = torch.tensor(rec.accepted)
            assert torch.equal(count, torch.where(flush, 0, self.count) + acc + 1)
            assert torch.equal(head, torch.where(flush, (self.head + self.count) % self.R, self.head))
            stored = (S0 != self.S0).flatten(2).any(-1).any(0)  # (B,) any layer's checkpoint written
            assert torch.equal(stored, flush & (self.count > 0)), "S0 must be stored on flush steps only"
            self.flushes.append(flush)
            self.boundary_hits += int((self.count + 2 * self.L == self.R).sum())
        assert bool((count <= self.R).all())
        self.wrapped |= bool((head + count > self.R).any())  # the committed window runs past the ring end
        self.count, self.head, self.S0 = count, head, S0


def _run(model, drafter, R, S, bsz=3, new=NEW, prompts=PROMPTS):
    strat = make_strategy("replay")
    spec = SpecConfig(draft_len=S, buffer_size=R) if drafter is None else dataclasses.replace(drafter.spec, buffer_size=R)
    watch = RingWatch(strat, 1 + spec.nodes, R)
    out = generate(model, prompts[:bsz], max_new_tokens=new, strategy=strat, drafter=drafter, spec=spec, hooks=[watch])
    return out, watch


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("S,R", [(1, 2), (1, 5), (3, 4), (3, 11), (5, 6), (5, 16)],
                         ids=["S1-Rmin", "S1-R5", "S3-Rmin", "S3-R11", "S5-Rmin", "S5-R16"])
def test_greedy_equals_autoregressive(setup64, S, R, p):
    model, ref = setup64
    out, watch = _run(model, ChainOracle(ref, p=p, S=S, seed=7), R, S)
    assert out.sequences == ref
    hist = out.accepted_histogram()
    if p == 0.0:  # all drafts rejected every step
        assert set(hist) == {0}
    if p == 1.0:  # all accepted (but the tail, where fewer tokens were left)
        assert max(hist) == S and hist[S] >= sum(hist.values()) - len(PROMPTS)
    if R == S + 1:  # the smallest ring the rule allows: every call flushes
        assert all(bool(f.all()) for f in watch.flushes)


@pytest.mark.parametrize("R", [1, 2, 5, 16])
def test_standard_decoding_is_output_only(setup64, R):
    """S = 0 (no drafter): one token per call, S0 untouched between flushes (RingWatch), lossless."""
    model, ref = setup64
    out, watch = _run(model, None, R, 0)
    assert out.sequences == ref and out.model_calls == NEW - 1
    flushes = torch.stack(watch.flushes)  # (steps, B)
    assert flushes.sum() <= flushes.numel() // max(R - 1, 1) + len(PROMPTS)  # a flush every R-1 tokens


def test_boundary_wraparound_and_per_sequence_flushes():
    """Many steps with a small odd ring and different acceptance per sequence: the committed window wraps
    around the ring end, h + 2L == R is hit exactly (no flush there), sequences flush on different steps."""
    cfg = load_preset("tiny-hybrid")
    model = build_model(cfg, seed=0, dtype=torch.float64)
    ref = generate(model, PROMPTS, max_new_tokens=40, strategy="autoregressive").sequences
    out, watch = _run(model, ChainOracle(ref, p=[1.0, 0.0, 0.6], S=2, seed=11), 9, 2, new=40)
    assert out.sequences == ref
    assert watch.wrapped and watch.boundary_hits > 0
    flushes = torch.stack(watch.flushes)  # (steps, B)
    assert bool((flushes.any(1) & ~flushes.all(1)).any()), "some step must flush some sequences only"


def test_batch1(setup64):
    model, ref = setup64
    out, _ = _run(model, ChainOracle(ref[1:2], p=0.5, S=3, seed=2), 6, 3, bsz=1, prompts=PROMPTS[1:])
    assert out.sequences == ref[1:2]


TREE = [0, 0, 1, 1, 2, 3, 5, 0]  # 8 nodes, depth 3, ragged
TWO_CHAINS = [0, 1, 2, 0, 4, 5]  # two chains of 3 under the pending token


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("parents,R", [(TREE, 9), (TREE, 20), (TWO_CHAINS, 7)], ids=["tree-Rmin", "tree-R20", "2xS3-Rmin"])
def test_tree_greedy_equals_autoregressive(setup64, parents, R, p):
    """Beyond seed 000: replay verifying a token tree (tree mask over the ring window, accepted path
    gathered into the ring at commit) is lossless too; the ring bookkeeping follows the same rules."""
    model, ref = setup64
    out, watch = _run(model, ChainOracle(ref, p=p, parents=parents, seed=4), R, 0)
    assert out.sequences == ref
    if p == 1.0:
        assert max(out.accepted_histogram()) == 3


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid"])
def test_logits_match_full_forward_float32(preset):
    """float32, a small ring (R = 5, S = 2: flushes and wrap-around): the logits behind every emitted token
    equal one prefill forward over prompt + output within 1e-5 (absolute; logits are of order 1)."""
    cfg = load_preset(preset)
    model = build_model(cfg, seed=1, dtype=torch.float32)
    prompt = [[4, 99, 23, 61, 7]]
    ref = generate(model, prompt, max_new_tokens=14, strategy="autoregressive").sequences
    rec = Recorder()
    out = generate(model, prompt, max_new_tokens=14, strategy="replay", verifier=rec,
                   drafter=ChainOracle(ref, p=0.7, S=2, seed=2, R=5))
    got = torch.cat([logits[0, v.path[0, :int(v.accepted[0]) + 1]] for logits, v in rec.calls])  # prefill first
    ids = torch.tensor([prompt[0] + out.sequences[0]])
    ref_logits = parallel_logits(model, ids)[0]  # (T, V)
    P = len(prompt[0])
    n = len(out.sequences[0])  # one row of logits behind every emitted token
    assert got.shape[0] >= n == 14
    torch.testing.assert_close(got[:n], ref_logits[P - 1:P - 1 + n], rtol=0, atol=1e-5)


def test_cache_bytes_one_state_plus_ring():
    cfg = load_preset("tiny-hybrid")
    s = make_strategy("replay")
    bsz, S, R = 3, 3, 10
    s.allocate(cfg, bsz, SpecConfig(draft_len=S, buffer_size=R), "cpu", torch.float64)
    n, L = len(cfg.mamba_layers), S + 1
    H, P, N, G, C, W = cfg.ssm_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, cfg.conv_dim, cfg.conv_kernel
    state = n * bsz * H * P * N * 4  # the checkpoint, fp32
    ring = n * bsz * R * (H * P * 8 + H * 4 + G * N * 8)  # x, B in the activation dtype, dt fp32
    expected = state + ring + n * bsz * C * (W - 1) * 8 + 2 * n * bsz * 8 + n * bsz * L * C * 8  # + conv, ptrs, conv in
    expected += n * bsz * 4  # the one-launch verify's int32 program counters
    assert s.cache_bytes() == expected
    assert s.cache_bytes() == sum(t.numel() * t.element_size() for t in vars(s).values() if isinstance(t, torch.Tensor))
    # paper size (meta: nothing allocated), seed 000 Fig. 11 setting S = 4, R = 8: one state + small vectors,
    # against the (1 + S) full states a per-draft snapshot keeps
    big = load_preset("nemotron-h-8b")
    s.allocate(big, 16, SpecConfig(draft_len=4, buffer_size=8), "meta", torch.bfloat16)
    one = make_strategy("autoregressive")
    one.allocate(big, 16, SpecConfig(), "meta", torch.bfloat16)
    assert 1.0 < s.cache_bytes() / one.cache_bytes() < 1.1
    if "snapshot" in strategy_names():
        snap = make_strategy("snapshot")
        snap.allocate(big, 16, SpecConfig(draft_len=4), "meta", torch.bfloat16)
        assert snap.cache_bytes() / s.cache_bytes() > 4.0


def test_step_is_device_side_meta():
    """flush decision, verify and commit never read tensor data on the host: they run on meta tensors,
    which refuse .item() and data-dependent branches (the CPU stand-in for CUDA-graph capture)."""
    cfg = load_preset("tiny-hybrid")
    model = build_model(cfg).to("meta")
    s = make_strategy("replay")
    s.allocate(cfg, 2, SpecConfig(draft_len=3, buffer_size=6), "meta", torch.float32)
    ml = dict(dtype=torch.long, device="meta")
    step = StepInputs(input_ids=torch.empty(2, 4, **ml), positions=torch.empty(2, 4, **ml))
    p = next(b.mixer for b in model.layers if b.kind == "M").params()
    inp = MixerInputs(xbc=torch.empty(2, 4, cfg.conv_dim, device="meta"), dt=torch.empty(2, 4, cfg.ssm_heads, device="meta"))
    for _ in range(2):
        assert s.mix(p, inp, step).shape == (2, 4, cfg.d_inner)
        s.commit(Verdict(torch.empty(2, **ml), torch.empty(2, 4, **ml), torch.empty(2, **ml)), step)


def test_bad_input_clear_errors(setup64):
    model, ref = setup64
    with pytest.raises(ValueError, match="raise buffer_size to at least 6 or lower S to at most 4"):
        generate(model, PROMPTS, max_new_tokens=4, strategy="replay", drafter=ChainOracle(ref, p=1.0, S=5, R=5))
    with pytest.raises(ValueError, match="raise buffer_size to at least 9 or draft fewer nodes"):
        generate(model, PROMPTS, max_new_tokens=4, strategy="replay", drafter=ChainOracle(ref, p=1.0, parents=TREE, R=8))
    s = make_strategy("replay")
    s.allocate(model.cfg, 1, SpecConfig(draft_len=2), "cpu", torch.float64)
    with pytest.raises(ValueError, match="drafter's spec"):  # more drafts than the spec allocated for
        s.layout(torch.zeros(1, dtype=torch.long), DraftTree.from_chains(torch.zeros(1, 1, 3, dtype=torch.long)),
                 torch.tensor([3]))
    chain_only = type("ChainOnlyReplay", (type(s),), {"supports_trees": False})()  # e.g. snapshot's contract
    with pytest.raises(ValueError, match="verifies chains only; use a chain drafter or a tree strategy"):
        chain_only.allocate(model.cfg, 1, SpecConfig(draft_len=3, tree_size=8), "cpu", torch.float64)
    with pytest.raises(ValueError, match="unknown strategy 'replay-ssm'; choose one of: .*replay"):
        generate(model, PROMPTS, max_new_tokens=2, strategy="replay-ssm")
    with pytest.raises(ValueError, match="takes no options"):
        make_strategy("replay", buffer=8)
