"""The engine (engine/step.py, engine/engine.py): the token buffer and reports say what generate() returns,
runs that cannot fit are refused before allocation, and -- on a GPU -- the captured step equals the eager
loop token for token for every strategy with chain and tree drafters, without a host sync inside a step."""
import pytest
import torch

from ssmspec.drafting.oracle import Oracle
from ssmspec.drafting.png import PromptNgram
from ssmspec.engine import Engine, generate
from ssmspec.engine.memory import plan_bytes, strategy_bytes
from ssmspec.models import build_model, load_preset
from ssmspec.strategies import SpecConfig, make_strategy, strategy_names

CUDA = torch.cuda.is_available()
PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13, 14, 15], [42, 7]]
TREE = [0, 0, 1, 1, 2, 3, 5, 0]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _decode(eng, ids, valid, prompts) -> list[list[int]]:
    """Prefill, then launch and collect steps until every sequence is done: the tokens each one emitted."""
    got = [list(t) for t in eng.prefill(ids, valid, prompts).tokens]
    while not all(eng.step.done.tolist()):
        eng.launch()
        for rep, _ in eng.collect(keep=0):
            for b, toks in enumerate(rep.tokens):
                got[b].extend(toks)
    return got


def test_token_buffer_holds_prompts_then_outputs_and_reports_match():
    model = build_model(load_preset("tiny-hybrid"), seed=0)
    out = generate(model, PROMPTS, max_new_tokens=6, drafter=PromptNgram(ngram=2, num_drafts=1, draft_len=3),
                   strategy="replay")
    eng = Engine(model, batch=3, prefill_len=7, max_new_tokens=6, strategy="replay",
                 drafter=PromptNgram(ngram=2, num_drafts=1, draft_len=3))
    from ssmspec.engine.generate import _pad_left

    ids, valid = _pad_left(PROMPTS, 0, "cpu")
    got = _decode(eng, ids, valid, PROMPTS)
    buf = eng.step.buf
    rows = [r[:n] for r, n in zip(buf.tokens.tolist(), buf.length.tolist())]
    assert rows == [p + s for p, s in zip(PROMPTS, out.sequences)]
    assert got == out.sequences and all(len(s) == 6 for s in got)
    assert out.drafter_on_device and not out.cuda_graph


def test_prefill_without_prompt_lists_reads_the_valid_tokens_of_left_padded_rows():
    """A drafter gets the prompts prefill hands it: without ``prompts=`` they come from the mask (before,
    ``row[:n]`` took the left padding for the prompt)."""
    from ssmspec.engine.generate import _pad_left

    class Seen(PromptNgram):
        def reset(self, prompts, **kw):
            self.seen = [list(p) for p in prompts]
            return super().reset(prompts, **kw)

    model = build_model(load_preset("tiny-hybrid"), seed=0)
    ids, valid = _pad_left(PROMPTS, 0, "cpu")
    d = Seen(ngram=2, num_drafts=1, draft_len=3)
    Engine(model, batch=3, prefill_len=7, max_new_tokens=6, strategy="replay", drafter=d).prefill(ids, valid)
    assert d.seen == PROMPTS


@pytest.mark.parametrize("drafter", ["draft_model", "async_draft", "mtp"])
def test_prompts_shorter_than_the_prefill_width_with_an_attention_draft(drafter):
    """Every prompt shorter than the engine's prefill width (a benchmark pads a set's prompts to ``prompt_len``):
    the token buffer holds the padded width, and a drafter with attention layers, which sizes its KV cache for its
    longest prompt, still holds every slot the buffer may fill (before, the reset refused the run: 292 slots
    against a 309-token buffer on the gpu profile's HumanEval prompts); greedy output equals autoregressive."""
    from ssmspec.bench.prompt_groups import pad_group
    from ssmspec.drafting import make_drafter

    target = build_model(load_preset("tiny-hybrid"), seed=0)
    draft = build_model(load_preset("tiny-hybrid", pattern="M*"), seed=1)
    if drafter == "mtp":  # the head of a hybrid target: an attention block (its KV cache is the drafter's)
        target = build_model(load_preset("tiny-hybrid").replace(mtp_layers=1, mtp_pattern="*-"), seed=0)
    opts = {"draft_model": dict(draft=draft, draft_len=3),
            "async_draft": dict(draft=draft, draft_len=3, fanout=[2, 1, 1, 1], backup="draft"),
            "mtp": dict(target=target, draft_len=3)}[drafter]
    prompts = [[5, 17, 33, 8], [42, 7]]
    ids, valid = pad_group(prompts, 11, target.cfg.pad_token_id, "cpu")
    eng = Engine(target, batch=2, prefill_len=11, max_new_tokens=12, strategy="snapshot",
                 drafter=make_drafter(drafter, **opts), spec=SpecConfig(draft_len=3))
    got = _decode(eng, ids, valid, prompts)
    assert got == generate(target, prompts, max_new_tokens=12, strategy="autoregressive").sequences


def test_eos_stops_a_sequence_inside_a_window_and_finished_rows_emit_nothing():
    model = build_model(load_preset("tiny-mamba2"), seed=1, dtype=torch.float64)
    ref = generate(model, PROMPTS, max_new_tokens=12).sequences
    eos = ref[1][4]  # a token the second sequence emits at its fifth position
    d = Oracle(p=1.0, draft_len=4, reference=ref, vocab_size=model.cfg.vocab_size)
    out = generate(model, PROMPTS, max_new_tokens=12, drafter=d, strategy="snapshot", eos_token_id=eos)
    for r, s in zip(ref, out.sequences):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert s == r[:cut]
    assert out.steps[-1].emitted[1] == 0  # the second sequence finished earlier


def test_runs_that_cannot_fit_are_refused_before_anything_is_allocated():
    model = build_model(load_preset("tiny-hybrid"), seed=0)
    strat = make_strategy("snapshot")
    with pytest.raises(ValueError, match=r"needs [\d.]+ [KMGT]iB \(.*state.*kv_cache.*\) but only [\d.]+ [KMGT]iB "
                                         r"are free on cpu.*lower the batch"):
        Engine(model, batch=10_000_000, prefill_len=64, max_new_tokens=64, strategy=strat,
               drafter=PromptNgram(ngram=2, num_drafts=1, draft_len=3))
    assert strat.conv_state is None  # nothing was allocated


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-qwen3.5"])
@pytest.mark.parametrize("name", strategy_names())
def test_planned_state_bytes_equal_what_the_strategy_allocates(name, preset):
    cfg = load_preset(preset)
    spec = SpecConfig() if not make_strategy(name).speculative else SpecConfig(draft_len=3, buffer_size=8)
    want = strategy_bytes(make_strategy(name), cfg, 3, spec, torch.float32)
    s = make_strategy(name)
    s.allocate(cfg, 3, spec, "cpu", torch.float32)
    assert want == s.cache_bytes() > 0
    parts = plan_bytes(cfg, make_strategy(name), batch=3, spec=spec, kv_capacity=40, prefill_len=8,
                       dtype=torch.float32)
    assert parts["state"] == want and parts["kv_cache"] > 0
    if cfg.gdn_layers:  # the GDN states are in the plan, and its prefill's chunk tiles in the activations
        gdn = sum(t.numel() * t.element_size() for k, t in vars(s).items() if isinstance(t, torch.Tensor) and "gdn" in k)
        assert 0 < gdn <= want
        longer = plan_bytes(cfg, make_strategy(name), batch=3, spec=spec, kv_capacity=40, prefill_len=64,
                            dtype=torch.float32)
        assert longer["activations"] > parts["activations"]


def test_plan_counts_the_logits_as_the_verifier_reads_them(monkeypatch):
    """A greedy run holds one bounded chunk of model-dtype logits (``HybridLM.argmax``) where a sampling run
    holds fp32 logits and probabilities at every position of the call; the plan follows the verifier the
    engine will use (its own default at the given sampling, or the one passed)."""
    from ssmspec.models import model as model_mod
    from ssmspec.verify import make_verifier
    from ssmspec.verify.distributions import SamplingConfig

    cfg = load_preset("tiny-hybrid")
    spec = SpecConfig(draft_len=3, buffer_size=8)
    batch, V = 5, cfg.vocab_size
    tok = batch * (1 + 3)  # replay: one row a sequence, the pending token and 3 drafts
    kw = dict(batch=batch, spec=spec, kv_capacity=40, prefill_len=8, dtype=torch.bfloat16, prefill=False)
    greedy = plan_bytes(cfg, make_strategy("replay"), **kw)["activations"]
    sampled = plan_bytes(cfg, make_strategy("replay"), sampling=SamplingConfig(temperature=1.0), **kw)["activations"]
    passed = plan_bytes(cfg, make_strategy("replay"), verifier=make_verifier("speculative", sampling=SamplingConfig(
        temperature=1.0)), **kw)["activations"]
    assert sampled == passed and sampled - greedy == 2 * 4 * V * tok - (2 * V * tok + 8 * tok)
    monkeypatch.setattr(model_mod, "ARGMAX_CHUNK_BYTES", 2 * V * 3)  # three bf16 rows of logits a chunk
    chunked = plan_bytes(cfg, make_strategy("replay"), **kw)["activations"]
    assert greedy - chunked == 2 * V * (tok - 3)


# GPU: the captured step is the eager step --------------------------------------------------------
def _cases():
    out = []
    for name in strategy_names():
        s = make_strategy(name)
        if not s.speculative:
            out.append(pytest.param(name, "none", id=f"{name}-none"))
            continue
        out.append(pytest.param(name, "oracle-S3", id=f"{name}-oracle-S3"))
        out.append(pytest.param(name, "png-2xS3", id=f"{name}-png-2xS3"))
        if s.supports_trees:
            out.append(pytest.param(name, "oracle-tree", id=f"{name}-oracle-tree"))
    return out


def _drafter(kind: str, ref, vocab: int):
    if kind == "none":
        return None
    if kind == "png-2xS3":
        return PromptNgram(ngram=2, num_drafts=2, draft_len=3)
    if kind == "oracle-tree":
        return Oracle(p=0.6, tree=TREE, reference=ref, vocab_size=vocab, seed=5)
    return Oracle(p=0.6, draft_len=3, reference=ref, vocab_size=vocab, seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-hybrid", "mamba2-130m", "tiny-qwen3.5"])  # qwen: GDN state
@pytest.mark.parametrize("name,kind", _cases())
def test_captured_step_equals_the_eager_loop(preset, name, kind):
    model = build_model(load_preset(preset), seed=0, device="cuda", dtype=torch.float32)
    prompts = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(4)]
    ref = generate(model, prompts, max_new_tokens=24, cuda_graph=False).sequences
    runs = []
    for graph in (False, True):
        d = _drafter(kind, ref, model.cfg.vocab_size)
        runs.append(generate(model, prompts, max_new_tokens=24, strategy=name, drafter=d, cuda_graph=graph))
    eager, graphed = runs
    assert graphed.cuda_graph and not eager.cuda_graph
    assert graphed.sequences == eager.sequences
    assert graphed.accepted_histogram() == eager.accepted_histogram()
    if kind != "png-2xS3":  # fp32 on the GPU: the oracle's drafts keep the greedy path of the reference
        assert graphed.sequences == ref


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["replay", "snapshot", "stree"])  # one row a sequence, a row a node, a tree
def test_captured_chunked_argmax_equals_the_whole_call(name, monkeypatch):
    """The greedy verify's argmax over chunks of a few positions (``HybridLM.argmax``, forced small here) inside
    the captured step emits what the whole call's argmax emits, eagerly and captured, and the autoregressive
    reference's tokens."""
    from ssmspec.models import model as model_mod

    model = build_model(load_preset("mamba2-130m"), seed=0, device="cuda", dtype=torch.float32)
    prompts = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(4)]
    ref = generate(model, prompts, max_new_tokens=16, cuda_graph=False).sequences
    kind = "oracle-tree" if name == "stree" else "oracle-S3"
    whole = generate(model, prompts, max_new_tokens=16, strategy=name, drafter=_drafter(kind, ref, model.cfg.vocab_size),
                     cuda_graph=True).sequences
    monkeypatch.setattr(model_mod, "ARGMAX_CHUNK_BYTES", 3 * 4 * model.cfg.vocab_size)  # three fp32 rows a chunk
    for graph in (False, True):
        out = generate(model, prompts, max_new_tokens=16, strategy=name,
                       drafter=_drafter(kind, ref, model.cfg.vocab_size), cuda_graph=graph)
        assert out.sequences == whole == ref


def test_a_capture_stream_is_asked_of_a_gpu_only():
    from ssmspec.engine.graphs import capture_stream

    with pytest.raises(ValueError, match="a CUDA graph captures on a GPU; got device cpu"):
        capture_stream("cpu")
    with pytest.raises(ValueError, match="unknown capture role 'side'; choose one of main, speculate"):
        capture_stream("cuda:0", "side")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graphs_replayed_at_once_on_two_streams_keep_their_gemms_apart():
    """Graphs that replay at the same time are captured on streams of their own (engine/graphs.py roles): torch
    gives cuBLAS a workspace per capture stream, and a captured GEMM keeps it. Two graphs of fp32 GEMMs at the
    shapes of a small model's verify and speculation calls (15-21 rows, K up to 1024), one captured as ``main``
    and one as ``speculate``, released together on two streams behind a sleeping gate 200 times, give their
    sequential results bit for bit."""
    from ssmspec.engine.graphs import capture_on, capture_stream

    dev = torch.device("cuda:0")
    assert capture_stream(dev, "speculate") is not capture_stream(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(15, 64, 32), (21, 64, 128), (15, 128, 64), (21, 1024, 64), (15, 1024, 384)]  # (M, K, N)
    xs = [[torch.randn(m, k, device=dev, generator=g) for m, k, _ in shapes] for _ in range(2)]
    ws = [[torch.randn(n, k, device=dev, generator=g) / k ** 0.5 for _, k, n in shapes] for _ in range(2)]
    graphs, outs = [], []
    for i, role in enumerate(("main", "speculate")):
        torch.nn.functional.linear(xs[i][0], ws[i][0])  # cuBLAS initialised outside the capture
        graph = torch.cuda.CUDAGraph()
        with capture_on(graph, dev, role=role):
            outs.append([torch.nn.functional.linear(x, w).sum(0) for x, w in zip(xs[i], ws[i])])
        graphs.append(graph)
    refs = []
    for graph, out in zip(graphs, outs):
        graph.replay()
        torch.cuda.synchronize(dev)
        refs.append([o.clone() for o in out])
    gate, s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    for _ in range(200):
        with torch.cuda.stream(gate):
            torch.cuda._sleep(200_000)
        opened = gate.record_event()
        for stream, graph in ((s1, graphs[0]), (s2, graphs[1])):
            stream.wait_event(opened)
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize(dev)
        for out, ref in zip(outs, refs):
            assert all(torch.equal(o, r) for o, r in zip(out, ref))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_capture_on_the_second_gpu_first_leaves_the_first_gpus_captures_there(monkeypatch):
    """torch makes its default capture stream once, on the GPU current at the process's first capture: after a
    captured run on cuda:1, a captured run on cuda:0 was captured on cuda:1's stream, so its random draws failed
    ("Offset increment outside graph capture") and its kernels were missing from the graph (engine/graphs.py).
    From a fresh default stream, a captured cuda:1 run first, then captured cuda:0 runs with random oracle drafts
    decode what their eager twins decode."""
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)  # as in a process that never captured
    cfg = load_preset("tiny-hybrid")
    prompts = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(3)]

    def run(dev, graph, kind="oracle-S3", strategy="replay"):
        model = build_model(cfg, seed=0, device=dev, dtype=torch.float32)
        ref = generate(model, prompts, max_new_tokens=24, cuda_graph=False).sequences
        out = generate(model, prompts, max_new_tokens=24, strategy=strategy,
                       drafter=_drafter(kind, ref, cfg.vocab_size), cuda_graph=graph)
        assert out.cuda_graph == graph
        return out.sequences, out.accepted_histogram()

    first = run("cuda:1", True)
    assert torch.cuda.current_device() == 0
    for strategy, kind in (("replay", "oracle-S3"), ("stree", "oracle-tree")):
        assert run("cuda:0", True, kind, strategy) == run("cuda:0", False, kind, strategy)
    assert run("cuda:0", True) == first  # the same model, prompts and drafts on either GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_on_the_second_gpu_decodes_there_with_the_first_current(temperature):
    """A model on cuda:1 while cuda:0 is the current device: the engine makes its GPU current for its launches
    (Triton launches on the current device's stream, graphs capture on one), so captured speculative decoding
    with a draft model on cuda:1 decodes exactly what the same run on cuda:0 decodes, and cuda:0 stays current."""
    from ssmspec.drafting import make_drafter
    from ssmspec.verify import SamplingConfig

    cfg = load_preset("tiny-hybrid")
    prompts = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(3)]
    runs = []
    for dev in ("cuda:0", "cuda:1"):
        model = build_model(cfg, seed=0, device=dev, dtype=torch.float32)
        draft = build_model(cfg, seed=1, device=dev, dtype=torch.float32)
        d = make_drafter("draft_model", draft=draft, draft_len=3, temperature=temperature)
        assert torch.cuda.current_device() == 0
        out = generate(model, prompts, max_new_tokens=24, strategy="replay", drafter=d, cuda_graph=True,
                       sampling=SamplingConfig(temperature=temperature, seed=3))
        runs.append((out.sequences, out.accepted_histogram()))
        assert torch.cuda.current_device() == 0
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_replayed_steps_do_not_synchronise_the_host():
    model = build_model(load_preset("tiny-hybrid"), seed=0, device="cuda", dtype=torch.bfloat16)
    eng = Engine(model, batch=2, prefill_len=8, max_new_tokens=40, strategy="replay",
                 drafter=PromptNgram(ngram=2, num_drafts=1, draft_len=3))
    ids = torch.randint(3, 200, (2, 8), device="cuda")
    eng.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
    eng.launch()  # eager + capture
    eng.collect(keep=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            eng.launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(eng.collect(keep=0)) == 5


def test_kernel_grids_refuse_a_batch_that_cannot_fit_before_building_inputs():
    from omegaconf import OmegaConf

    from ssmspec.bench.kernels import mixer_grid

    bench = OmegaConf.create({"presets": ["tiny-mamba2"], "batch": [1, 10**9]})
    with pytest.raises(ValueError, match=r"tiny-mamba2 mixer at batch 1000000000 needs .* are free on cpu"):
        next(mixer_grid(bench, device="cpu"))  # the check runs before the first point is yielded
    assert [b for _, _, b in mixer_grid(OmegaConf.create({"presets": ["tiny-mamba2"], "batch": [1, 4]}),
                                        device="cpu")] == [1, 4]
