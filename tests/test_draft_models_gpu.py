"""Draft models on the GPU (issue 23): every strategy with every draft-model drafter, draft and target of
every family, decodes what eager autoregressive decodes when both the drafter and the target step are
captured as CUDA graphs (Triton kernels, fp32), and the drafter's replays never synchronise the host."""
import pytest
import torch

from ssmspec.drafting import make_drafter
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import make_strategy, strategy_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = ["tiny-mamba2", "tiny-hybrid", "tiny-mamba-in-llama", "tiny-qwen3.5", "tiny-qwen3-next"]
DRAFTERS = [("draft_model", {"draft_len": 3}), ("beam_tree", {"beams": 2, "depth": 3}), ("static_tree", {"shape": "A"})]
PAIRS = [(s, n, o) for s in strategy_names() if s != "autoregressive" for n, o in DRAFTERS
         if n == "draft_model" or make_strategy(s).supports_trees]
PROMPTS = [[(7 * b + 3 * i) % 200 + 3 for i in range(5 + 4 * b)] for b in range(3)]
NEW = 20


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_draft_models_are_lossless(family):
    dev = torch.device("cuda")
    target = build_model(load_preset(family), seed=0, device=dev, dtype=torch.float32)
    draft = build_model(load_preset(family), seed=1, device=dev, dtype=torch.float32)
    want = generate(target, PROMPTS, max_new_tokens=NEW, cuda_graph=False).sequences
    for strategy, name, opts in PAIRS:
        d = make_drafter(name, draft=draft, **opts)
        out = generate(target, PROMPTS, max_new_tokens=NEW, strategy=strategy, drafter=d, cuda_graph=True)
        assert out.cuda_graph and out.sequences == want, (strategy, name)
    d = make_drafter("draft_model", draft=target, draft_len=3)  # the target drafting for itself
    out = generate(target, PROMPTS, max_new_tokens=NEW, strategy="replay", drafter=d, cuda_graph=True)
    assert out.sequences == want and out.mean_accepted() > 2.5


@pytest.mark.parametrize("draft_family,target_family", [("tiny-mamba2", "tiny-qwen3.5"),
                                                        ("tiny-qwen3.5", "tiny-mamba-in-llama")])
def test_captured_drafts_of_another_family_are_lossless(draft_family, target_family):
    dev = torch.device("cuda")
    target = build_model(load_preset(target_family), seed=0, device=dev, dtype=torch.float32)
    draft = build_model(load_preset(draft_family), seed=1, device=dev, dtype=torch.float32)
    want = generate(target, PROMPTS, max_new_tokens=NEW, cuda_graph=False).sequences
    for name, opts in DRAFTERS:
        out = generate(target, PROMPTS, max_new_tokens=NEW, strategy="stree", drafter=make_drafter(name, draft=draft, **opts),
                       cuda_graph=True)
        assert out.sequences == want, name
