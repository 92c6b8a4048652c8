"""The `mtp` drafter (issue 24, float64 CPU): its chains equal a from-scratch recomputation of the target's MTP
head over the whole sequence (one prefill of the target for its hidden states, then one fresh prefill of the head
per draft) through ragged acceptance, finished rows and bonus tokens it did not predict -- both driven by hand
(``propose`` and ``propose_device`` agree) and inside generate() under every speculative strategy, where the
engine hands the drafter the target's hidden states; greedy decoding stays lossless; ``propose_device`` never
synchronises the host; a target without a head is refused naming the fix."""
import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.drafting.mtp import MTPDrafter
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import strategy_names
from model_forward import mtp_drafts, parallel_hidden
from test_device_drafters import engine_buffer, no_host_sync

PROMPTS = [[5, 17, 33, 8, 5, 17], [9, 10, 11], [4, 4, 250, 7]]
NEW, S = 12, 3
# accepted drafts per sequence and step (-1: the sequence emits nothing, as a finished one)
ACCEPT = [(0, 3, 1), (2, 0, -1), (3, 1, 0), (1, -1, 2), (0, 2, 3), (3, 3, -1)]
HEADS = {"tiny-mamba2": "*-", "tiny-hybrid": "*-", "tiny-qwen3.5": "*-", "tiny-qwen3-next": "*E"}
SPECULATIVE = [s for s in strategy_names() if s != "autoregressive"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=list(HEADS))
def target(request):
    cfg = load_preset(request.param).replace(mtp_layers=1, mtp_pattern=HEADS[request.param])
    return build_model(cfg, seed=0, dtype=torch.float64)


def _prompt_hidden(model, prompts):
    """Left-padded ids, valid and the target's final hidden states, as the engine's prefill hands them over."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    hidden = torch.zeros(len(prompts), T, model.cfg.d_model, dtype=model.dtype)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], valid[b, T - len(p):] = torch.tensor(p), True
        hidden[b, T - len(p):] = parallel_hidden(model, torch.tensor([p]))[0]
    return ids, valid, hidden


def test_chains_equal_a_fresh_recomputation_through_ragged_acceptance(target):
    host, dev = (make_drafter("mtp", target=target, draft_len=S) for _ in range(2))
    assert dev.on_device and dev.wants_hidden and dev.spec.draft_len == S
    for d in (host, dev):
        d.reset(PROMPTS, batch=3, device="cpu", max_new_tokens=64)
        d.observe_prompt(*_prompt_hidden(target, PROMPTS))
    buf = engine_buffer(PROMPTS, [7, 250, 0], S, "cpu")
    buf.tokens = torch.cat([buf.tokens, torch.zeros(3, 3 * NEW, dtype=torch.long)], dim=1)  # room for 6 steps
    for step, accept in enumerate(ACCEPT):
        want = host.propose(buf.to_lists(), buf.pending())
        with no_host_sync():
            got = dev.propose_device(buf)
        assert torch.equal(got.tokens, want.tokens) and got.num_chains == 1 and got.q is None
        assert dev.consumed.tolist() == (buf.length - 1).tolist()  # every entry whose next token is known
        hist = buf.to_lists()
        for b, h in enumerate(hist):
            assert got.tokens[b].tolist() == mtp_drafts(target, h, S), (step, b)
        # the target accepts a drafts and adds a bonus the head did not propose; the engine then hands over the
        # hidden states of the pending token and the accepted drafts (one fresh prefill of the new history)
        hidden = torch.zeros(3, 1 + S, target.cfg.d_model, dtype=target.dtype)
        for b, a in enumerate(accept):
            if a < 0:
                continue
            bonus = (hist[b][-1] * 7 + 3 + a) % target.cfg.vocab_size
            new = got.tokens[b, :a].tolist() + [bonus]
            n = len(hist[b])
            buf.tokens[b, n:n + len(new)] = torch.tensor(new)
            buf.length[b] += len(new)
            full = parallel_hidden(target, torch.tensor([hist[b] + new[:-1]]))[0]
            hidden[b, :a + 1] = full[n - 1:]
        for d in (host, dev):
            d.observe_hidden(hidden)


class Forced(MTPDrafter):
    """The mtp drafter whose drafts the greedy verifier accepts as a schedule says (``DraftTree.match``, as the
    forced oracle), recording each step's history and chains: ragged acceptance inside generate()."""

    def __init__(self, *, schedule, **opts):
        super().__init__(**opts)
        self.schedule, self.log = schedule, []

    def propose_device(self, buf):
        tree = super().propose_device(buf)
        self.log.append((buf.to_lists(), tree.tokens.tolist()))
        a = torch.tensor(self.schedule[len(self.log) % len(self.schedule)])
        tree.match = torch.arange(self.S)[None] < a[:, None]
        return tree


@pytest.mark.parametrize("strategy", SPECULATIVE)
def test_every_strategy_with_the_mtp_drafter(target, strategy):
    """Lossless against autoregressive greedy decoding; then, with acceptance forced ragged, every step's chains
    equal the from-scratch recomputation over what the engine emitted (the hidden-state handoff is right)."""
    want = generate(target, PROMPTS, max_new_tokens=NEW, timing=False).sequences
    d = make_drafter("mtp", target=target, draft_len=S)
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=d, timing=False)
    assert out.sequences == want
    forced = Forced(target=target, draft_len=S, schedule=[(a % 4, (a + 1) % 4, (3 - a) % 4) for a in range(4)])
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=forced, timing=False)
    assert len({a for s in out.steps[1:] for a in s.accepted}) > 2
    for hist, chains in forced.log:
        for b, h in enumerate(hist):
            assert chains[b] == mtp_drafts(target, h, S), (strategy, b, len(h))


def test_a_target_without_a_head_is_refused_naming_the_fix():
    plain = build_model(load_preset("tiny-qwen3.5"), seed=0)
    with pytest.raises(ValueError, match=r"^model 'tiny-qwen3.5' has no MTP head \(mtp_layers=0\).*ships mtp\.\* "
                                         r"weights.*python -m ssmspec train \.\.\. mtp\.layers=1"):
        make_drafter("mtp", target=plain, draft_len=2)
    with pytest.raises(ValueError, match="pass target=<the target HybridLM>"):
        make_drafter("mtp", draft_len=2)
    head = build_model(load_preset("tiny-qwen3.5").replace(mtp_layers=1), seed=0)
    d = make_drafter("mtp", target=head, draft_len=2)
    with pytest.raises(ValueError, match="chains the MTP head of 'tiny-qwen3.5' but runs with target 'tiny-mamba2'"):
        generate(build_model(load_preset("tiny-mamba2"), seed=0), PROMPTS, max_new_tokens=3, strategy="snapshot",
                 drafter=d)
    with pytest.raises(ValueError, match="draft_len >= 1"):
        make_drafter("mtp", target=head, draft_len=0)


def test_a_synthetic_start_drafts_without_prompt_hidden_states():
    """Benchmarks start from synthetic caches: the head starts from zero keys and hidden states and still drafts
    S tokens a step through the engine (the step's shapes are those of a real run)."""
    from ssmspec.engine.engine import Engine

    model = build_model(load_preset("tiny-hybrid").replace(mtp_layers=1), seed=0)
    eng = Engine(model, batch=2, prefill_len=8, max_new_tokens=6, strategy="replay",
                 drafter=make_drafter("mtp", target=model, draft_len=S), prefill=False)
    eng.start_synthetic(8, torch.tensor([3, 4]))
    samples = eng.time_steps(warmup=1, iters=2)
    assert len(samples) == 2 and (eng.drafter.consumed > 7).all()  # the head absorbed what the steps emitted
