"""`stree` (seed 003): greedy output equals autoregressive greedy output token for token (float64), logits
agree with one full forward (float32), memory is one state + cached inputs, steps are graph-safe."""
import pytest
import torch

from ssmspec.drafting.base import DraftTree
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import MixerInputs, SpecConfig, StepInputs, make_strategy
from ssmspec.verify.base import Verdict
from model_forward import parallel_logits
from strategy_helpers import Recorder

PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13, 14, 15], [42, 7]]  # different lengths: left padding
NEW = 14
TREE = [0, 0, 1, 1, 2, 3, 5, 0]  # 8 nodes, depth 3, ragged (leaves at depth 1, 2 and 3)


class TreeOracle:
    """Test drafter: a reference greedy continuation, each draft token kept with probability p (else a
    different random token); chains (D of S) or a static tree whose true branch is picked at random."""

    name, is_tree = "test-oracle", True

    def __init__(self, ref, *, p, S=0, D=1, parents=None, seed=0, vocab=300):
        self.ref, self.p, self.S, self.D, self.vocab = ref, p, S, D, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.parents = parents
        if parents is None:
            self.spec = SpecConfig(draft_len=S, num_drafts=D)
        else:
            self.depth = [0]
            for q in parents:
                self.depth.append(self.depth[q] + 1)
            self.spec = SpecConfig(draft_len=max(self.depth), tree_size=len(parents))

    def reset(self, prompts, *, batch, device, max_new_tokens=None):
        self.plen = [len(p) for p in prompts]

    def _rand(self) -> int:
        return int(torch.randint(3, self.vocab, (), generator=self.gen))

    def _draft(self, true_tok: int) -> int:
        if torch.rand((), generator=self.gen).item() < self.p:
            return true_tok
        return 3 + (true_tok - 3 + 1 + int(torch.randint(self.vocab - 4, (), generator=self.gen))) % (self.vocab - 3)

    def _truth(self, b, hist, n):
        k = len(hist) - self.plen[b]  # tokens emitted so far, pending included
        seq = list(self.ref[b][k:k + n])
        return seq + [self._rand() for _ in range(n - len(seq))]

    def propose(self, history, pending):
        bsz = len(history)
        if self.parents is None:
            toks = torch.tensor([[[self._draft(t) for t in self._truth(b, history[b], self.S)] for _ in range(self.D)]
                                 for b in range(bsz)], dtype=torch.long)
            return DraftTree.from_chains(toks.reshape(bsz, self.D, self.S))
        T = len(self.parents)
        toks = torch.tensor([[self._rand() for _ in range(T)] for _ in range(bsz)], dtype=torch.long)
        for b in range(bsz):
            truth, node = self._truth(b, history[b], max(self.depth)), 0
            while kids := [i + 1 for i, q in enumerate(self.parents) if q == node]:
                node = kids[int(torch.randint(len(kids), (), generator=self.gen))]
                toks[b, node - 1] = self._draft(truth[self.depth[node] - 1])
        return DraftTree(toks, torch.tensor(self.parents).expand(bsz, T).clone())

    def observe(self, verdict):
        pass


@pytest.fixture(scope="module", params=["tiny-mamba2", "tiny-hybrid"])
def setup64(request):
    cfg = load_preset(request.param)
    model = build_model(cfg, seed=0, dtype=torch.float64)
    ref = generate(model, PROMPTS, max_new_tokens=NEW, strategy="autoregressive").sequences
    return model, ref


DRAFTS = {"S1": dict(S=1), "S3": dict(S=3), "S5": dict(S=5), "2xS3": dict(S=3, D=2), "tree": dict(parents=TREE)}


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("drafts", list(DRAFTS), ids=list(DRAFTS))
def test_greedy_equals_autoregressive(setup64, drafts, p):
    model, ref = setup64
    drafter = TreeOracle(ref, p=p, seed=3, **DRAFTS[drafts])
    out = generate(model, PROMPTS, max_new_tokens=NEW, strategy="stree", drafter=drafter)
    assert out.sequences == ref
    hist = out.accepted_histogram()
    if p == 0.0:
        assert set(hist) == {0}
    if p == 1.0 and drafts.startswith("S"):
        S = DRAFTS[drafts]["S"]
        assert out.model_calls <= -(-(NEW - 1) // (S + 1)) + 1  # (S+1) tokens per call except the tail
        assert max(hist) == S


@pytest.mark.parametrize("drafts", ["S3", "tree"])
def test_greedy_batch1_and_standard_decoding(setup64, drafts):
    model, ref = setup64
    one = generate(model, PROMPTS[1:2], max_new_tokens=NEW, strategy="stree",
                   drafter=TreeOracle(ref[1:2], p=0.5, seed=5, **DRAFTS[drafts]))
    assert one.sequences == ref[1:2]
    plain = generate(model, PROMPTS, max_new_tokens=6, strategy="stree")  # no drafter: one token per call
    assert plain.sequences == [r[:6] for r in ref] and plain.model_calls == 5


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid"])
def test_logits_match_full_forward_float32(preset):
    """float32: the logits stree produced for every emitted token equal one prefill forward over prompt +
    output within 1e-5 (absolute; logits are of order 1), for a tree drafter with partial acceptance."""
    cfg = load_preset(preset)
    model = build_model(cfg, seed=1, dtype=torch.float32)
    prompt = [[4, 99, 23, 61, 7]]
    ref = generate(model, prompt, max_new_tokens=10, strategy="autoregressive").sequences
    rec = Recorder()
    out = generate(model, prompt, max_new_tokens=10, strategy="stree", verifier=rec,
                   drafter=TreeOracle(ref, p=0.7, seed=2, parents=TREE))
    got = [logits[0, v.path[0, :int(v.accepted[0]) + 1]] for logits, v in rec.calls]  # (a+1, V) per call
    got = torch.cat(got)  # logits after the last prompt token (first call: prefill), then each output token
    ids = torch.tensor([prompt[0] + out.sequences[0]])
    ref_logits = parallel_logits(model, ids)[0]  # (T, V)
    P = len(prompt[0])
    n = len(out.sequences[0])  # one row of logits behind every emitted token
    assert got.shape[0] >= n == 10
    torch.testing.assert_close(got[:n], ref_logits[P - 1:P - 1 + n], rtol=0, atol=1e-5)


def test_cache_bytes_is_what_stree_allocated():
    cfg = load_preset("tiny-hybrid")
    spec = SpecConfig(draft_len=3, tree_size=8)
    s = make_strategy("stree")
    s.allocate(cfg, 3, spec, "cpu", torch.float64)
    n, bsz, L = len(cfg.mamba_layers), 3, 1 + 8
    H, P, N, C, W = cfg.ssm_heads, cfg.head_dim, cfg.state_size, cfg.conv_dim, cfg.conv_kernel
    state = n * bsz * H * P * N * 4  # one fp32 state per sequence and layer
    conv = n * bsz * C * (W - 1) * 8
    cache = n * bsz * L * (2 * C * 8 + H * 4)  # pre- and post-conv xBC (float64) + dt (fp32) per node
    pointers = bsz * L * 8 + bsz * 8  # accepted path columns + replay count
    assert s.cache_bytes() == state + conv + cache + pointers
    tensors = [t for t in vars(s).values() if isinstance(t, torch.Tensor)]
    assert s.cache_bytes() == sum(t.numel() * t.element_size() for t in tensors)
    # at paper size (meta device: nothing allocated) the tree cache is small next to the one state
    big = load_preset("mamba2-2.7b")
    s.allocate(big, 8, SpecConfig(draft_len=4, tree_size=13), "meta", torch.bfloat16)
    one_state = len(big.mamba_layers) * 8 * big.ssm_heads * big.head_dim * big.state_size * 4
    assert one_state < s.cache_bytes() < 1.5 * one_state


def test_step_is_device_side_meta():
    """mix and commit never read tensor data on the host (no .item(), no data-dependent Python branch):
    they run on meta tensors, which refuse any such read -- the CPU stand-in for CUDA-graph capture."""
    cfg = load_preset("tiny-hybrid")
    model = build_model(cfg).to("meta")
    s = make_strategy("stree")
    s.allocate(cfg, 2, SpecConfig(draft_len=3, tree_size=8), "meta", torch.float32)
    par = torch.tensor(TREE).expand(2, -1)
    step = s.layout(torch.zeros(2, dtype=torch.long), DraftTree(torch.zeros_like(par), par), torch.tensor([3, 5]))
    step = StepInputs(input_ids=step.input_ids.to("meta"), positions=step.positions.to("meta"),
                      tree_mask=step.tree_mask.to("meta"))
    p = next(b.mixer for b in model.layers if b.kind == "M").params()
    inp = MixerInputs(xbc=torch.empty(2, 9, cfg.conv_dim, device="meta"), dt=torch.empty(2, 9, cfg.ssm_heads, device="meta"))
    meta_long = dict(dtype=torch.long, device="meta")
    for _ in range(2):  # second call replays the first call's accepted path
        assert s.mix(p, inp, step).shape == (2, 9, cfg.d_inner)
        s.commit(Verdict(torch.empty(2, **meta_long), torch.empty(2, 4, **meta_long), torch.empty(2, **meta_long)), step)


def test_drafter_larger_than_allocated_is_refused():
    cfg = load_preset("tiny-mamba2")
    s = make_strategy("stree")
    s.allocate(cfg, 1, SpecConfig(draft_len=2), "cpu", torch.float32)
    toks = torch.zeros(1, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="drafter's spec"):
        s.layout(torch.zeros(1, dtype=torch.long), DraftTree.from_chains(toks), torch.tensor([3]))
