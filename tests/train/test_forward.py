"""The training forward (TrainStrategy + CausalAttention through the model's strategy hook) equals the model's
inference prefill and carries gradients to every parameter, for every trainable family (float64, tiny presets)."""
import pytest
import torch

from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.train.forward import train_logits
from model_forward import parallel_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid", "tiny-qwen3.5"])
def test_training_forward_equals_prefill_and_reaches_every_parameter(preset):
    model = build_model(load_preset(preset), seed=3, dtype=torch.float64)
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0))  # crosses scan chunks
    ref = parallel_logits(model, ids)
    got = train_logits(model.train(), ids)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    got.logsumexp(-1).mean().backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []

