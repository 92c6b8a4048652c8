"""The `mtp` drafter on the GPU (issue 24): with the drafter and the target step captured as CUDA graphs
(Triton kernels, fp32) every speculative strategy decodes what eager autoregressive decodes, for heads of every
family with attention + MLP (and a Qwen3-Next MoE head); the drafter's captured replays equal its eager calls
and never synchronise the host."""
import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import strategy_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEADS = {"tiny-mamba2": "*-", "tiny-hybrid": "*-", "tiny-qwen3.5": "*-", "tiny-qwen3-next": "*E"}
PROMPTS = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(3)]
NEW, S = 20, 3


def _target(preset):
    cfg = load_preset(preset).replace(mtp_layers=1, mtp_pattern=HEADS[preset])
    return build_model(cfg, seed=0, device=torch.device("cuda"), dtype=torch.float32)


@pytest.mark.parametrize("preset", list(HEADS))
def test_captured_mtp_drafts_are_lossless(preset):
    target = _target(preset)
    want = generate(target, PROMPTS, max_new_tokens=NEW, cuda_graph=False).sequences
    for strategy in strategy_names():
        if strategy == "autoregressive":
            continue
        d = make_drafter("mtp", target=target, draft_len=S)
        out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=d, cuda_graph=True)
        assert out.cuda_graph and out.sequences == want, strategy


@pytest.mark.parametrize("preset", list(HEADS))
def test_captured_propose_device_equals_eager(preset):
    """Two drafters fed the same prompt and hidden states: ``eager`` runs every step under
    ``set_sync_debug_mode("error")``, ``graphed`` is captured after one warm-up call and replayed; their drafts
    agree step for step while the buffers grow by ragged acceptance."""
    from test_device_drafters import ACCEPT, emit, engine_buffer

    dev = torch.device("cuda")
    target = _target(preset)
    eager, graphed = (make_drafter("mtp", target=target, draft_len=S) for _ in range(2))
    T = max(len(p) for p in PROMPTS)
    ids = torch.zeros(3, T, dtype=torch.long, device=dev)
    valid = torch.zeros(3, T, dtype=torch.bool, device=dev)
    for b, p in enumerate(PROMPTS):
        ids[b, T - len(p):], valid[b, T - len(p):] = torch.tensor(p, device=dev), True
    hidden = torch.randn(3, T, target.cfg.d_model, device=dev, generator=torch.Generator(dev).manual_seed(0))
    for d in (eager, graphed):
        d.reset(PROMPTS, batch=3, device=dev, max_new_tokens=64)
        d.observe_prompt(ids, valid, hidden)
    bufs = [engine_buffer(PROMPTS, [7, 250, 0], S, dev) for _ in range(2)]
    want = eager.propose_device(bufs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = graphed.propose_device(bufs[1])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got.tokens, want.tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = graphed.propose_device(bufs[1])
    gen = torch.Generator(dev).manual_seed(1)
    for accept in ACCEPT:
        step_hidden = torch.randn(3, 1 + S, target.cfg.d_model, device=dev, generator=gen)
        for d, buf in zip((eager, graphed), bufs):
            emit(buf, want, accept, target.cfg.vocab_size)
            d.observe_hidden(step_hidden)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            want = eager.propose_device(bufs[0])
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(static.tokens, want.tokens)
        assert torch.equal(graphed.consumed, bufs[1].length - 1)
