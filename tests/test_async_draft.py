"""Asynchronous speculation (``drafting/async_draft.py``, seed 002) on CPU: the speculation cache proposes exactly
what the synchronous ``draft_model`` drafter proposes on every round (hits and ``backup: draft`` misses), greedy
output equals autoregressive output for every draft family it takes, sampled output keeps the target's law with
cache hits and misses (and a mutant that verifies hits with the wrong q is caught), bad options end in one
ValueError, and the engine's speculate hook runs in the documented order."""
import dataclasses

import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.drafting.async_draft import AsyncDraft
from ssmspec.engine.engine import Engine
from ssmspec.engine.generate import _pad_left, generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.verify import SamplingConfig
from model_forward import parallel_logits

PROMPTS = [[5, 17, 33, 8, 5, 17], [9, 10, 11], [40, 41]]
NEW = 24
S = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pair(preset: str, pattern: str | None, *, noise: float, vocab: int | None = None, dtype=torch.float64):
    """A target and a draft that agrees with it often but not always: the target's weights, each scaled by
    1 + noise * N(0, 1) (fixed seed), so rounds see every accepted length and both cache hits and misses."""
    cfg = load_preset(preset)
    if pattern is not None:  # the family's mixers and MLPs without its attention layers
        cfg = dataclasses.replace(cfg, pattern=pattern, name=f"{cfg.name}-{pattern}")
    if vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    target = build_model(cfg, seed=0, dtype=dtype)
    draft = build_model(cfg, seed=0, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1 + noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return target, draft


FAMILIES = [pytest.param("tiny-mamba2", None, id="mamba2"),
            pytest.param("tiny-qwen3.5", "G-G-", id="gdn-qwen3.5"),
            pytest.param("tiny-hybrid", "M-ME", id="nemotron-h-no-attention"),
            pytest.param("tiny-hybrid", None, id="nemotron-h"),  # attention layers: drafting/async_kv.py
            pytest.param("tiny-qwen3.5", None, id="qwen3.5-hybrid"),
            pytest.param("tiny-mamba-in-llama", None, id="mamba-in-llama")]


@pytest.mark.parametrize("preset,pattern", FAMILIES)
@pytest.mark.parametrize("backup", ["draft", "ngram"])
def test_greedy_drafts_equal_the_synchronous_drafter(preset, pattern, backup):
    """Every round, every running row: a hit proposes the draft model's greedy continuation of the accepted
    prefix, exactly what ``draft_model`` proposes there (and so does a ``backup: draft`` miss); the output
    equals autoregressive decoding token for token; rounds saw both hits and misses."""
    target, draft = _pair(preset, pattern, noise=0.05)
    ref = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive").sequences
    d = make_drafter("async_draft", draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1], backup=backup)
    sync = make_drafter("draft_model", draft=draft, draft_len=S)
    seen, bufs = [], []

    def lookup(buf, inner=d.lookup):
        if not seen:
            sync.reset([list(p) for p in PROMPTS], batch=len(PROMPTS), device="cpu", max_new_tokens=NEW)
        bufs.append(buf)
        return inner(buf)

    def speculate(inner=d.speculate):  # the engine speculates after the lookup (and the backup, if a row missed)
        buf = bufs[-1]
        want = sync.propose(buf.to_lists(), buf.pending()).tokens
        running = (buf.length - buf.prompt_len) < NEW
        seen.append((d.drafts.clone(), want, d.hit.clone(), running))
        inner()

    d.lookup, d.speculate = lookup, speculate
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy="snapshot", drafter=d)
    assert out.sequences == ref
    rounds, hits = d.hit_counts()
    assert rounds == len(seen) - 1 and 0 < sum(hits) < rounds * len(PROMPTS), (rounds, hits)
    for got, want, hit, running in seen:
        rows = running & (hit if backup == "ngram" else torch.ones_like(hit))
        assert torch.equal(got[rows], want[rows])


@pytest.mark.parametrize("preset", ["tiny-mamba-in-llama", "tiny-hybrid", "tiny-qwen3.5"])
def test_every_draft_call_equals_a_parallel_forward_of_what_its_state_absorbed(preset):
    """Attention drafts (drafting/async_kv.py): each row of every draft call -- the chain, every branch, the
    backup -- gives the logits one parallel forward of the draft gives after the tokens its start slot has
    absorbed plus the row's own (float64): the keys it attends, their positions (RoPE) and the SSM / GDN state
    all match. Histories are tracked per state slot from the prompts, so a wrong position or a key seen too
    early or too late fails it even where the argmax would not move."""
    target, draft = _pair(preset, None, noise=0.05)
    d = make_drafter("async_draft", draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1], backup="draft")
    calls, inner = [], d._call

    def record(ids, src, dst, pos, kind, call=0):
        out = inner(ids, src, dst, pos, kind, call)
        calls.append((kind, ids.clone(), src.clone(), dst.clone(), out.double().clone()))
        return out

    d._call = record
    generate(target, PROMPTS, max_new_tokens=NEW, strategy="snapshot", drafter=d)
    hist = {b: list(p) for b, p in enumerate(PROMPTS)}  # slot -> tokens its state has absorbed
    memo, kinds, worst = {}, set(), 0.0
    for kind, ids, src, dst, out in calls[:40]:  # the first rounds: every sequence still has KV room
        for r in range(ids.shape[0]):
            seq = list(hist[int(src[r])])
            for t in range(ids.shape[1]):
                seq.append(int(ids[r, t]))
                key = tuple(seq)
                if key not in memo:
                    memo[key] = parallel_logits(draft, torch.tensor([seq]))[0, -1].double()
                worst = max(worst, float((out[r, t] - memo[key]).abs().max()))
                hist[int(dst[r, t if dst.shape[1] > 1 else 0])] = list(seq)
        kinds.add(kind)
    assert kinds == {"chain", "branch", "backup"}, kinds
    assert worst < 1e-5, f"largest logit difference {worst:.2e}"


def test_hits_and_misses_with_random_backup_stay_lossless():
    target, draft = _pair("tiny-mamba2", None, noise=0.05)
    ref = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive").sequences
    d = make_drafter("async_draft", draft=draft, draft_len=S, fanout=[1, 1, 0, 0, 1], backup="random")
    assert generate(target, PROMPTS, max_new_tokens=NEW, strategy="snapshot", drafter=d).sequences == ref
    rounds, hits = d.hit_counts()
    assert 0 < sum(hits) < rounds * len(PROMPTS)


# sampled: the target's law -------------------------------------------------------------------------
V_SMALL, B_LAW, NEW_LAW, BINS = 6, 48, 40, 20
PASS, FAIL = 1e-3, 1e-6  # an exact sampler's p-value stays above PASS; the mutant's falls below FAIL


class _UnscaledQ(AsyncDraft):
    """Mutant: drafts drawn from the lambda-scaled distribution, but verified with the unscaled one."""

    def _draw(self, logits, gen):
        tok, q = super()._draw(logits, gen)
        return tok, torch.softmax(logits / self.sampling.temperature, -1)


def _pit_pvalue(drafter, target, *, seed: int) -> tuple[float, int, int]:
    """Sample B_LAW sequences with speculative sampling and ``drafter``; each emitted token y_t, with the target's
    conditional law p_t (one fresh forward over the final sequence), gives u_t = P_t(tokens ranked above y_t) +
    U p_t(y_t), i.i.d.
    uniform exactly when every token follows the target's law. -> (chi-square p-value of BINS bins of u, rounds
    with a cache, hits)."""
    gen = torch.Generator().manual_seed(100 + seed)
    prompts = torch.randint(V_SMALL, (B_LAW, 3), generator=gen).tolist()
    sampling = SamplingConfig(temperature=1.0, seed=seed)
    out = generate(target, prompts, max_new_tokens=NEW_LAW, strategy="snapshot", drafter=drafter, sampling=sampling)
    seqs = torch.tensor([p + s for p, s in zip(prompts, out.sequences)])
    probs = torch.softmax(parallel_logits(target, seqs)[:, 2:-1].double(), -1)  # (B, NEW, V): law of token 3 + t
    y = seqs[:, 3:, None]
    # tokens ranked by p, most likely first: a sampler that favours or shuns the likely tokens moves u's mass
    # the same way at every position (a fixed token order would average such errors away)
    ranked, order = probs.sort(-1, descending=True)
    rank = order.argsort(-1).gather(2, y)
    below = (ranked.cumsum(-1) - ranked).gather(2, rank)[..., 0]
    u = below + torch.rand(below.shape, generator=gen, dtype=torch.float64) * probs.gather(2, y)[..., 0]
    counts = torch.bincount((u.flatten() * BINS).long().clamp(max=BINS - 1), minlength=BINS).double()
    exp = u.numel() / BINS
    stat = ((counts - exp) ** 2 / exp).sum()
    pval = float(torch.special.gammaincc(torch.tensor((BINS - 1) / 2, dtype=torch.float64), stat / 2))
    rounds, hits = drafter.hit_counts()
    return pval, rounds, sum(hits)


@pytest.fixture(scope="module")
def law_pair():
    return _pair("tiny-mamba2", None, noise=0.3, vocab=V_SMALL)


OPTS = dict(draft_len=3, fanout=[1, 1, 0, 1], temperature=1.0, residual_scale=0.1)


@pytest.mark.parametrize("backup", ["draft", "ngram"])
def test_sampled_output_keeps_the_target_law(law_pair, backup):
    target, draft = law_pair
    d = make_drafter("async_draft", draft=draft, backup=backup, **OPTS)
    pval, rounds, hits = _pit_pvalue(d, target, seed=1)
    assert 0 < hits < rounds * B_LAW, (rounds, hits)  # both hits and misses verified
    assert pval > PASS, f"p-value {pval:.2e}"


def test_mutant_verifying_hits_with_unscaled_q_is_caught(law_pair):
    target, draft = law_pair
    pval, rounds, hits = _pit_pvalue(_UnscaledQ(draft=draft, **OPTS), target, seed=1)
    assert hits > 0 and pval < FAIL, f"mutant passed: p-value {pval:.2e}"


# bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,match", [
    (dict(draft_len=2, fanout=[0, 0, 0]), "cannot hold one cache branch"),
    (dict(draft_len=2, fanout=[1, 1]), "one count per accepted length"),
    (dict(temperature=1.0, residual_scale=0.0), r"lambda\) must lie in \(0, 1\]"),
    (dict(temperature=1.0, residual_scale=1.5), r"lambda\) must lie in \(0, 1\]"),
    (dict(residual_scale=0.5), "changes only sampled drafts"),
    (dict(backup="eagle"), "unknown backup 'eagle'.*draft, ngram, random"),
    (dict(draft_len=2, fanout=[400, 0, 0]), "lower the fanout"),
])
def test_bad_options_fail_when_built(opts, match):
    with pytest.raises(ValueError, match=match):
        make_drafter("async_draft", **{"draft": "tiny-mamba2", **opts})


def test_vocabulary_mismatch_fails_when_paired():
    target = build_model(dataclasses.replace(load_preset("tiny-mamba2"), vocab_size=64), seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, PROMPTS, max_new_tokens=4, strategy="snapshot",
                 drafter=make_drafter("async_draft", draft="tiny-mamba2"))


# the engine ------------------------------------------------------------------------------------------------
def _prefilled_engine(target, drafter, sampling=SamplingConfig()) -> Engine:
    """An eager engine over PROMPTS with ``drafter``, prefilled."""
    eng = Engine(target, batch=len(PROMPTS), prefill_len=6, max_new_tokens=NEW, strategy="snapshot", drafter=drafter,
                 sampling=sampling, cuda_graph=False)
    ids, valid = _pad_left(PROMPTS, 0, "cpu")
    eng.prefill(ids, valid)
    return eng


def _sampled_engine(target, draft, sampling):
    """The sampled async drafter of the engine tests (lambda 0.5, backup draft) and its prefilled engine."""
    d = make_drafter("async_draft", draft=draft, draft_len=S, fanout=[2, 1, 1, 0, 1], temperature=1.0,
                     residual_scale=0.5, backup="draft")
    return d, _prefilled_engine(target, d, sampling)


def _hand_loop(target, draft, sampling, steps: int) -> list[list[int]]:
    """The documented order without the engine's driver: lookup -> backup (only if a row missed) -> speculate ->
    target step."""
    d, eng = _sampled_engine(target, draft, sampling)
    s = eng.step
    for _ in range(steps):
        s.set_drafts(d.lookup(s.buf))
        if d.missed():
            d.backup_drafts(s.buf)
        d.speculate()
        s.target_step()
    return s.buf.to_lists()


def test_engine_launch_runs_speculate_between_drafts_and_target():
    target, draft = _pair("tiny-mamba2", None, noise=0.1, dtype=torch.float32)
    sampling = SamplingConfig(temperature=1.0, seed=3)
    d, eng = _sampled_engine(target, draft, sampling)
    assert eng.speculation is not None
    for _ in range(5):
        eng.launch()
        eng.collect(keep=0)
    assert eng.step.buf.to_lists() == _hand_loop(target, draft, sampling, 5)
    assert eng.speculation.backups >= 1  # the first round has no cache: it misses


def test_backup_runs_only_in_rounds_where_a_row_missed():
    """A draft equal to the target (greedy) predicts every verdict: after the first round (no cache) every row
    hits, the engine never runs the backup again, and the output is still autoregressive's."""
    target, _ = _pair("tiny-mamba2", None, noise=0.0)
    ref = generate(target, PROMPTS, max_new_tokens=NEW, strategy="autoregressive").sequences
    d = make_drafter("async_draft", draft=target, draft_len=S, fanout=[1] * (S + 1), backup="draft")
    eng = _prefilled_engine(target, d)
    steps = NEW // (S + 1)  # every step emits S + 1 tokens: the budget is not reached
    for _ in range(steps):
        eng.launch()
        eng.collect(keep=0)
    rounds, hits = d.hit_counts()
    assert eng.speculation.backups == 1 and rounds == steps - 1 and hits == [rounds] * len(PROMPTS)
    for row, prompt, want in zip(eng.step.buf.to_lists(), PROMPTS, ref):
        assert row[len(prompt):] == want[:len(row) - len(prompt)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba-in-llama"])  # the second: an attention draft
def test_captured_two_streams_equal_eager_on_cuda(temperature, preset):
    """Draft graph, speculate graph on the side stream and target graph replayed == the same steps eagerly."""
    cfg = load_preset(preset)
    target = build_model(cfg, seed=0, device="cuda", dtype=torch.float32)
    draft = build_model(cfg, seed=1, device="cuda", dtype=torch.float32)
    opts = dict(draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1], temperature=temperature,
                residual_scale=0.5 if temperature else 1.0)
    sampling = SamplingConfig(temperature=temperature, seed=5)
    runs = []
    for graphed in (False, True):
        d = make_drafter("async_draft", **opts)
        out = generate(target, PROMPTS, max_new_tokens=40, strategy="snapshot", drafter=d, sampling=sampling,
                       cuda_graph=graphed)
        runs.append((out.sequences, d.hit_counts()))
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_forced_to_overlap_the_target_equals_eager(monkeypatch, temperature):
    """The one-GPU speculation graph and the target's graph started at the same instant (main held behind a
    sleeping gate, which also releases the side stream: it waits on main's event) in every round, three runs:
    each decodes what the eager run decodes. Guards the separate capture stream of the speculation
    (engine/graphs.py roles): graphs of one capture stream share cuBLAS's workspace, and this model's verify and
    branch calls (15-21 rows) are cuBLAS GEMMs. MambaInLlama: the preset whose two failures of
    test_draft_on_a_second_gpu_equals_one_gpu under load were never reproduced alone."""
    from ssmspec.engine import speculate

    overlap = speculate.Speculation.overlap

    def gated(self, target):
        if self.side is not None and self.spec_graph is not None and not self.remote:
            gate = torch.cuda.Stream(self.device)
            with torch.cuda.stream(gate):
                torch.cuda._sleep(100_000)
            torch.cuda.current_stream(self.device).wait_event(gate.record_event())
        return overlap(self, target)

    cfg = load_preset("tiny-mamba-in-llama")
    target = build_model(cfg, seed=0, device="cuda", dtype=torch.float32)
    draft = build_model(cfg, seed=1, device="cuda", dtype=torch.float32)
    opts = dict(draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1], temperature=temperature,
                residual_scale=0.5 if temperature else 1.0)
    sampling = SamplingConfig(temperature=temperature, seed=5)

    def run(graphed):
        d = make_drafter("async_draft", **opts)
        out = generate(target, PROMPTS, max_new_tokens=40, strategy="snapshot", drafter=d, sampling=sampling,
                       cuda_graph=graphed)
        return out.sequences, d.hit_counts()

    eager = run(False)
    monkeypatch.setattr(speculate.Speculation, "overlap", gated)
    for _ in range(3):
        assert run(True) == eager


def _cuda_pair(preset: str, *, noise: float, vocab: int | None = None):
    """``_pair`` on the GPU in float32."""
    cfg = load_preset(preset)
    if vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    target = build_model(cfg, seed=0, device="cuda", dtype=torch.float32)
    draft = build_model(cfg, seed=0, device="cuda", dtype=torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1 + noise * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype))
    return target, draft


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backup", ["draft", "ngram", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_captured_rounds_equal_eager_with_every_backup(backup, temperature):
    """Captured rounds equal eager ones for every backup, greedy and sampled: the tokens, the cache counters and the
    number of rounds whose backup ran (the backup graph replays only where the host read a miss, and its draws,
    the random backup's too, advance with it), with rounds that skipped the backup among them. A round skips it
    only when every row hits: sampled, a vocabulary of 3 with two bonus candidates cached at every depth, and 24
    rounds, make that near certain (on the CPU, with other draws: 9-14 of 24 rounds skip it, for each backup and
    three seeds; with 6 tokens and fanout 2, 2, 1, 1, 1 a row hit about a third of the time, and 12 rounds of 3
    rows once had no such round)."""
    vocab = None if temperature == 0.0 else 3
    target, draft = _cuda_pair("tiny-mamba2", noise=0.05 if vocab is None else 0.3, vocab=vocab)
    prompts = PROMPTS if vocab is None else [[t % vocab for t in p] for p in PROMPTS]
    sampling = SamplingConfig(temperature=temperature, seed=5)
    steps, runs = (12 if vocab is None else 24), []
    for graphed in (False, True):
        d = make_drafter("async_draft", draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1] if vocab is None else [2] * 5,
                         backup=backup, temperature=temperature, residual_scale=0.5 if temperature else 1.0)
        eng = Engine(target, batch=len(prompts), prefill_len=6, max_new_tokens=(S + 1) * steps, strategy="snapshot",
                     drafter=d, sampling=sampling, cuda_graph=graphed)
        ids, valid = _pad_left(prompts, 0, "cuda")
        eng.prefill(ids, valid, prompts)
        for _ in range(steps):
            eng.launch()
            eng.collect(keep=1)
        eng.collect(keep=0)
        runs.append((eng.step.buf.to_lists(), d.hit_counts(), eng.speculation.backups))
    assert runs[0] == runs[1]
    rounds, hits = runs[1][1]
    backups = runs[1][2]
    assert 0 < sum(hits) < rounds * len(prompts) and 1 <= backups < steps, (rounds, hits, backups)


# the draft on its own device ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backup", ["draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba-in-llama"])  # the second: an attention draft
def test_draft_device_path_equals_the_one_device_run(backup, temperature, preset):
    """``draft_device`` naming the target's own device runs every transfer of the two-device path (send, fetch_cache,
    fetch_backup, the merge) with the same draws in the same order: the output and the cache counters equal the
    one-device run token for token, hits and misses both seen (a transfer left out would change the drafts)."""
    if temperature == 0.0:
        (target, draft), prompts = _pair(preset, None, noise=0.05), PROMPTS
    else:  # a small vocabulary, so sampled rounds hit the cache too
        (target, draft), prompts = _pair(preset, None, noise=0.3, vocab=V_SMALL), [[t % V_SMALL for t in p]
                                                                                 for p in PROMPTS]
    sampling = SamplingConfig(temperature=temperature, seed=4)
    opts = dict(draft=draft, draft_len=S, fanout=[2, 2, 1, 1, 1], backup=backup, temperature=temperature,
                residual_scale=0.5 if temperature else 1.0)
    runs = []
    for device in (None, "cpu"):
        d = make_drafter("async_draft", draft_device=device, **opts)
        assert d.remote == (device is not None)
        out = generate(target, prompts, max_new_tokens=NEW, strategy="snapshot", drafter=d, sampling=sampling)
        runs.append((out.sequences, d.hit_counts()))
    assert runs[0] == runs[1]
    rounds, hits = runs[1][1]
    assert 0 < sum(hits) < rounds * len(prompts), (rounds, hits)
    if temperature == 0.0:
        assert runs[1][0] == generate(target, prompts, max_new_tokens=NEW, strategy="autoregressive").sequences


@pytest.mark.parametrize("device,match", [
    ("gpu1", "must name a device such as cuda:1"),
    ("cuda", "name the GPU, e.g. cuda:1"),
    (f"cuda:{torch.cuda.device_count() + 3}", r"does not exist: this machine has \d visible CUDA device"),
    ("meta", "only cpu and cuda devices"),
])
def test_bad_draft_device_fails_when_built(device, match):
    with pytest.raises(ValueError, match=match):
        make_drafter("async_draft", draft="tiny-mamba2", draft_device=device)


def test_the_targets_own_gpu_is_refused_before_anything_runs(monkeypatch):
    """``resolve_draft_device`` (the drafter's reset and saguaro_e2e's row planning both ask it) refuses the target's
    own GPU with the fix, by index or through a target named ``cuda`` (the current GPU); a second GPU is the draft's
    and a CUDA draft for a CPU target is refused. Two GPUs faked: nothing is allocated."""
    from ssmspec.drafting.draft_device import resolve_draft_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    own = "is the target's own GPU: set draft_device=null"
    with pytest.raises(ValueError, match=own):
        resolve_draft_device("cuda:0", torch.device("cuda:0"))
    with pytest.raises(ValueError, match=own):
        resolve_draft_device("cuda:1", torch.device("cuda"))
    assert resolve_draft_device("cuda:1", torch.device("cuda:0")) == torch.device("cuda:1")
    assert resolve_draft_device("cuda:0", torch.device("cuda")) == torch.device("cuda:0")
    assert resolve_draft_device("same", torch.device("cuda:0")) is None
    with pytest.raises(ValueError, match="cannot serve a target on cpu"):
        resolve_draft_device("cuda:1", torch.device("cpu"))
    assert resolve_draft_device("cpu", torch.device("cpu")) == torch.device("cpu")  # the CPU tests' transfer path


def test_remote_drafter_refuses_the_engine_less_proposal():
    d = make_drafter("async_draft", draft="tiny-mamba2", draft_device="cpu")
    with pytest.raises(ValueError, match="runs through the engine only"):
        d.propose_device(None)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backup", ["draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba-in-llama"])  # the second: an attention draft
def test_draft_on_a_second_gpu_equals_one_gpu(backup, temperature, preset):
    """The draft on cuda:1 (captured graphs on both GPUs, transfers between them) decodes exactly what the draft on
    the target's GPU decodes, and greedy output equals autoregressive; a draft model loaded on the wrong GPU and a
    CUDA draft for a CPU target are refused."""
    cfg = load_preset(preset)
    target = build_model(cfg, seed=0, device="cuda:0", dtype=torch.float32)
    sampling = SamplingConfig(temperature=temperature, seed=5)
    opts = dict(draft_len=S, fanout=[2, 2, 1, 1, 1], backup=backup, temperature=temperature,
                residual_scale=0.5 if temperature else 1.0)
    runs = []
    for device in (None, "cuda:1"):
        draft = build_model(cfg, seed=1, device=device or "cuda:0", dtype=torch.float32)
        d = make_drafter("async_draft", draft=draft, draft_device=device, **opts)
        out = generate(target, PROMPTS, max_new_tokens=40, strategy="snapshot", drafter=d, sampling=sampling)
        runs.append((out.sequences, d.hit_counts()))
    assert runs[0] == runs[1]
    if temperature == 0.0:
        assert runs[0][0] == generate(target, PROMPTS, max_new_tokens=40, strategy="autoregressive").sequences
    wrong = make_drafter("async_draft", draft=build_model(cfg, seed=1, device="cuda:0"), draft_device="cuda:1")
    with pytest.raises(ValueError, match="lives on cuda:0 but draft_device is cuda:1"):
        generate(target, PROMPTS, max_new_tokens=4, strategy="snapshot", drafter=wrong)
    with pytest.raises(ValueError, match="must both be CUDA devices"):
        generate(build_model(cfg, seed=0), PROMPTS, max_new_tokens=4, strategy="snapshot",
                 drafter=make_drafter("async_draft", draft="tiny-mamba2", draft_device="cuda:1"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_first_round_on_a_second_gpu_waits_for_the_drafters_reset(monkeypatch):
    """The drafter's reset queues work on the draft GPU's current stream after its last cross-device copy (the slot
    tables of the branches, the zeroed transfer buffers), and the engine's streams there (non-blocking) never wait
    on that stream: the drafter must finish it before the first round. A sleep queued inside that window (after
    the host-synchronising computation of the branches' depths, before the kernel that gathers their slot table)
    makes a drafter that does not finish it read an unwritten slot table. Seen without the sleep as a sampled
    cuda:1 run that left the cuda:0 run at its second token, once in four runs on a loaded machine (2db93b9).
    The sleep must follow every host-synchronising call of the reset: one queued before the depths' computation
    (whose repeat_interleave reads a size on the host) delayed only the host, and the test passed with the
    synchronisation removed (H200, a880a86); this version failed twice with it removed (two H200s, 143db63)."""
    import ssmspec.drafting.async_draft as async_draft
    real = async_draft.branch_depths

    def late(fanout, device=None):  # the reset's call for the branches' slot table on the draft GPU
        out = real(fanout, device=device)  # its repeat_interleave reads a size on the host: a sync, then the sleep
        if device is not None and torch.device(device) == torch.device("cuda:1"):
            with torch.cuda.device("cuda:1"):
                torch.cuda._sleep(400_000_000)  # ~0.2 s of the draft GPU's current stream, before the gather
        return out

    cfg = load_preset("tiny-mamba2")
    target = build_model(cfg, seed=0, device="cuda:0", dtype=torch.float32)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    opts = dict(draft_len=S, fanout=[2, 2, 1, 1, 1], backup="draft", temperature=1.0, residual_scale=0.5)
    runs = []
    for device in (None, "cuda:1"):
        draft = build_model(cfg, seed=1, device=device or "cuda:0", dtype=torch.float32)
        d = make_drafter("async_draft", draft=draft, draft_device=device, **opts)
        if device is not None:
            monkeypatch.setattr(async_draft, "branch_depths", late)
        out = generate(target, PROMPTS, max_new_tokens=40, strategy="snapshot", drafter=d, sampling=sampling)
        runs.append((out.sequences, d.hit_counts()))
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_draft_gpu_graphs_read_their_own_random_offsets(monkeypatch):
    """A captured graph on the draft GPU draws from the philox offset that its replay refills, on the draft GPU,
    before it runs. The engine once registered the draft's generators with the target's GPU current, so torch
    kept (and refilled at every replay) their seed and offset on the target's GPU, unordered with the draft GPU's
    stream: loaded by a second pytest worker, sampled runs on cuda:1 drew earlier rounds' random numbers again
    (two H200s, torch 2.11). A sleep queued on the target GPU after each send (before the draft backup's replay,
    whose refill would queue behind it) makes that read stale every time: the captured run must still equal the
    eager one, which keeps its offsets on the host."""
    cfg = load_preset("tiny-mamba2")
    target = build_model(cfg, seed=0, device="cuda:0", dtype=torch.float32)
    opts = dict(draft_len=S, fanout=[2, 2, 1, 1, 1], backup="draft", temperature=1.0, residual_scale=0.5)
    runs = []
    for graph in (False, True):
        draft = build_model(cfg, seed=1, device="cuda:1", dtype=torch.float32)
        d = make_drafter("async_draft", draft=draft, draft_device="cuda:1", **opts)
        if graph:
            real = d.send

            def send_then_stall(real=real):
                real()
                with torch.cuda.device("cuda:0"):  # the target GPU's current stream (main, or the send stream)
                    torch.cuda._sleep(50_000_000)

            monkeypatch.setattr(d, "send", send_then_stall)
        out = generate(target, PROMPTS, max_new_tokens=40, strategy="snapshot", drafter=d,
                       sampling=SamplingConfig(temperature=1.0, seed=5), cuda_graph=graph)
        runs.append((out.sequences, d.hit_counts()))
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_targets_own_gpu_as_draft_device_is_refused():
    """On one GPU the transfer path's streams would not be ordered (a copy within a GPU fences one stream): naming
    the target's GPU as the draft device fails with the fix; the same-device draft (draft_device=null) runs."""
    cfg = load_preset("tiny-mamba2")
    target = build_model(cfg, seed=0, device="cuda:0", dtype=torch.float32)
    draft = build_model(cfg, seed=1, device="cuda:0", dtype=torch.float32)
    d = make_drafter("async_draft", draft=draft, draft_device="cuda:0", draft_len=S)
    with pytest.raises(ValueError, match="is the target's own GPU: set draft_device=null"):
        generate(target, PROMPTS, max_new_tokens=4, strategy="snapshot", drafter=d)
    d = make_drafter("async_draft", draft=draft, draft_device=None, draft_len=S)
    out = generate(target, PROMPTS, max_new_tokens=8, strategy="snapshot", drafter=d)
    assert out.sequences == generate(target, PROMPTS, max_new_tokens=8, strategy="autoregressive").sequences
