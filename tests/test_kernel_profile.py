"""``bench/kernel_profile.py`` on a GPU: the kernels of a captured decode step are seen inside the graph replays,
counted per step, and the table's shares add up to at most the whole."""
import pytest
import torch

from ssmspec.bench.kernel_profile import profile_steps
from ssmspec.bench.throughput import decode_engine
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_counts_the_kernels_of_a_captured_step():
    model = build_model(load_preset("tiny-mamba2"), seed=0, device="cuda", dtype=torch.bfloat16)
    pending = torch.ones(2, dtype=torch.long, device="cuda")
    eng, _ = decode_engine(model, "autoregressive", pending, 16, steps=16, graph=True)
    eng.time_steps(warmup=1, iters=2)
    n, table = profile_steps(eng, steps=3, top=50)
    layers = len(model.cfg.pattern)
    assert n >= layers  # at least one kernel per Mamba-2 layer, seen inside the graph replays
    assert sum(r["per_step"] for r in table) <= n + 1e-9 and 0.99 <= sum(r["share"] for r in table) <= 1.0 + 1e-9
    assert all(r["us_per_step"] > 0 for r in table)
    with pytest.raises(ValueError, match="steps >= 1"):
        profile_steps(eng, steps=0)
