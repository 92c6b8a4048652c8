"""Draft-model drafters on the device (issue 7, item 1): ``propose_device`` over the engine's token buffer
gives the same drafts as ``propose`` over host lists, step after step with partial acceptance, finished
sequences and bonus tokens the draft did not predict; it never synchronises the host (CPU: the Python
sync points raise; GPU: ``set_sync_debug_mode("error")``); and captured in a CUDA graph its replays equal
eager calls."""
import contextlib

import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.registry import DrafterBase
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.verify.base import Verdict
from ssmspec.verify.distributions import target_probs
from model_forward import next_logits

PROMPTS = [[5, 17, 33, 8, 5, 17], [9, 10, 11], [4, 4, 250, 7]]
NEW = 16
# accepted draft tokens per sequence and step (-1: the sequence emits nothing, as a finished one)
ACCEPT = [(0, 3, 1), (2, 0, -1), (3, 1, 0), (1, -1, 2), (0, 2, 3), (3, 3, -1)]
DRAFTERS = {
    "draft_model": {"draft_len": 3},
    "draft_model_sampled": {"draft_len": 3, "num_drafts": 2, "temperature": 0.8, "top_k": 40, "sample_seed": 5},
    "static_tree": {"shape": [0, 0, 1, 1, 2, 3]},
    "beam_tree": {"beams": 2, "depth": 3},
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(case: str, draft):
    opts = dict(DRAFTERS[case])
    name = "draft_model" if case.startswith("draft_model") else case
    return make_drafter(name, draft=draft, **opts)


def engine_buffer(prompts, first: list[int], depth: int, device) -> TokenBuffer:
    """Rows as the engine keeps them: prompt from column 0, then the first token (pending)."""
    cap = max(len(p) for p in prompts) + NEW + depth + 2
    tokens = torch.zeros(len(prompts), cap, dtype=torch.long)
    for b, (p, t) in enumerate(zip(prompts, first)):
        tokens[b, :len(p) + 1] = torch.tensor(p + [t])
    n = torch.tensor([len(p) for p in prompts])
    return TokenBuffer(tokens.to(device), (n + 1).to(device), n.to(device))


def accepted_path(tree: DraftTree, b: int, a: int) -> tuple[list[int], list[int]]:
    """Tokens and node numbers of the first-child path under the root in sequence b's tree, ``a`` nodes or
    until a leaf (host)."""
    toks, pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
    path, nodes, node = [], [], 0
    for _ in range(a):
        node = next((i for i, p in enumerate(pars, start=1) if p == node), None)
        if node is None:  # a beam dropped after this layer: nothing deeper to accept
            break
        path.append(toks[node - 1])
        nodes.append(node)
    return path, nodes


def emit(buf: TokenBuffer, tree: DraftTree, accept, vocab: int) -> Verdict:
    """Append accepted drafts + a bonus to every row, in place (the bonus is one the draft did not propose
    when the row accepts nothing); returns the verdict the engine would hand the drafter (``observe``)."""
    length = buf.length.tolist()
    S = tree.max_depth()
    accepted, paths, bonuses = [], [], []
    for b, a in enumerate(accept):
        path, nodes = accepted_path(tree, b, max(a, 0))
        bonus = (buf.tokens[b, length[b] - 1].item() * 7 + 3 + a) % vocab
        accepted.append(len(path))
        paths.append([0, *nodes] + [0] * (S - len(nodes)))
        bonuses.append(bonus)
        if a < 0:  # a finished row: its verdict is masked, nothing is appended
            continue
        new = path + [bonus]
        buf.tokens[b, length[b]:length[b] + len(new)] = torch.tensor(new, device=buf.tokens.device)
        buf.length[b] += len(new)
    dev = buf.tokens.device
    return Verdict(accepted=torch.tensor(accepted, device=dev), path=torch.tensor(paths, device=dev),
                   bonus=torch.tensor(bonuses, device=dev))


def assert_same(got: DraftTree, want: DraftTree) -> None:
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.parents, want.parents)
    assert (got.q is None) == (want.q is None)
    if want.q is not None:
        torch.testing.assert_close(got.q, want.q, atol=1e-6, rtol=0)
    assert (got.num_chains, got.depth) == (want.num_chains, want.depth)


@pytest.fixture(scope="module", params=["tiny-mamba2", "tiny-hybrid", "tiny-mamba-in-llama", "tiny-qwen3.5",
                                          "tiny-qwen3-next"])
def draft(request):
    return build_model(load_preset(request.param), seed=1, dtype=torch.float64)


@pytest.mark.parametrize("case", list(DRAFTERS))
def test_propose_device_equals_propose(draft, case):
    """Two drafters with the same options: one fed host lists, one the engine's buffer; the buffer grows by
    partially accepted drafts, bonuses and nothing (finished rows), as the engine appends them."""
    host, dev = make(case, draft), make(case, draft)
    assert dev.on_device
    for d in (host, dev):
        d.reset(PROMPTS, batch=len(PROMPTS), device="cpu", max_new_tokens=NEW)
    buf = engine_buffer(PROMPTS, [7, 250, 0], dev.spec.draft_len, "cpu")
    for accept in ACCEPT:
        want = host.propose(buf.to_lists(), buf.pending())
        got = dev.propose_device(buf)
        assert_same(got, want)
        assert dev.engine.consumed.tolist() == buf.length.tolist()  # the engine followed the buffer
        for b, h in enumerate(buf.to_lists()):  # ground truth at the root: one fresh prefill of the history
            logits = next_logits(draft, h)
            roots = got.tokens[b][got.parents[b] == 0]
            if case == "draft_model":  # greedy drafts: the draft model's own greedy continuation
                ref = generate(draft, [h], max_new_tokens=3, strategy="autoregressive", timing=False).sequences[0]
                assert got.chains()[b, 0].tolist() == ref
            elif case == "draft_model_sampled":
                q = target_probs(logits, dev.sampling)
                for c in range(2):
                    torch.testing.assert_close(got.q[b, 3 * c], q, atol=1e-6, rtol=0)
            else:  # the root's children are the draft's top tokens, most likely first
                assert roots.tolist() == logits.topk(roots.numel()).indices.tolist()
        dev.observe(emit(buf, got, accept, draft.cfg.vocab_size))  # as the engine's step does



@contextlib.contextmanager
def no_host_sync():
    """Every Python-level way a tensor reaches the host raises (the CPU stand-in for sync debug mode)."""
    names = ["tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(name):
        def f(self, *a, **k):
            raise RuntimeError(f"host sync: Tensor.{name}")
        return f

    try:
        for n in names:
            setattr(torch.Tensor, n, boom(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba-in-llama", "tiny-qwen3.5"])
@pytest.mark.parametrize("case", list(DRAFTERS))
def test_propose_device_never_syncs_the_host(preset, case):
    model = build_model(load_preset(preset), seed=1, dtype=torch.float32)
    d = make(case, model)
    d.reset(PROMPTS, batch=len(PROMPTS), device="cpu", max_new_tokens=NEW)
    buf = engine_buffer(PROMPTS, [7, 250, 0], d.spec.draft_len, "cpu")
    for accept in ACCEPT[:3]:
        with no_host_sync():
            tree = d.propose_device(buf)
        verdict = emit(buf, tree, accept, model.cfg.vocab_size)
        with no_host_sync():
            d.observe(verdict)
    with no_host_sync(), pytest.raises(RuntimeError, match="host sync"):  # the guard catches a host drafter
        DrafterBase().propose_device(buf)


def test_buffer_beyond_the_kv_budget_is_refused():
    model = build_model(load_preset("tiny-mamba-in-llama"), seed=1, dtype=torch.float32)
    d = make("draft_model", model)
    d.reset(PROMPTS, batch=len(PROMPTS), device="cpu", max_new_tokens=4)
    buf = engine_buffer(PROMPTS, [7, 250, 0], 3, "cpu")  # room for NEW = 16 new tokens
    with pytest.raises(ValueError, match=r"max_new_tokens=1\d"):
        d.propose_device(buf)
    with pytest.raises(ValueError, match="max_seq_len=512"):
        d.reset(PROMPTS, batch=len(PROMPTS), device="cpu", max_new_tokens=600)


# GPU: no sync under the debug mode, and CUDA-graph replays equal eager calls ------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba-in-llama", "tiny-qwen3.5"])
@pytest.mark.parametrize("case", list(DRAFTERS))
def test_captured_propose_device_equals_eager(preset, case):
    """Drafter ``eager`` runs every step under ``set_sync_debug_mode("error")``; drafter ``graphed`` runs the
    first step eagerly (warm-up: Triton compilation), is captured, then replayed over its own static buffer.
    Both see the same tokens appended; their drafts agree step for step."""
    dev = torch.device("cuda")
    model = build_model(load_preset(preset), seed=1, device=dev, dtype=torch.float32)
    eager, graphed = make(case, model), make(case, model)
    for d in (eager, graphed):
        d.reset(PROMPTS, batch=len(PROMPTS), device=dev, max_new_tokens=NEW)
    bufs = [engine_buffer(PROMPTS, [7, 250, 0], eager.spec.draft_len, dev) for _ in range(2)]
    want = eager.propose_device(bufs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = graphed.propose_device(bufs[1])
    torch.cuda.current_stream().wait_stream(side)
    assert_same(got, want)
    graph = torch.cuda.CUDAGraph()
    for g in graphed.generators():
        if hasattr(graph, "register_generator_state"):
            graph.register_generator_state(g)
    with torch.cuda.graph(graph):
        static = graphed.propose_device(bufs[1])
    for accept in ACCEPT:
        for d, buf in zip((eager, graphed), bufs):
            d.observe(emit(buf, want, accept, model.cfg.vocab_size))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            want = eager.propose_device(bufs[0])
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same(static, want)
        assert torch.equal(graphed.engine.consumed, bufs[1].length)
