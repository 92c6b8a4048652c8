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


@pytest.mark.gpu
def test_fla_gdn_scan_trains_like_the_reference(monkeypatch):
    """On CUDA the GDN scan of the training forward runs fla's chunk kernels: same loss and gradients as the
    PyTorch WY form (SSMSPEC_TRAIN_GDN=reference), in fp32, through several chunks."""
    pytest.importorskip("fla")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = load_preset("tiny-qwen3.5")
    ids = torch.randint(3, 300, (2, 150), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for mode in ("fla", "reference"):
        monkeypatch.setenv("SSMSPEC_TRAIN_GDN", mode)
        model = build_model(cfg, seed=3, dtype=torch.float32, device="cuda").train()
        loss = train_logits(model, ids).logsumexp(-1).mean()
        loss.backward()
        out[mode] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["fla"][0], out["reference"][0], atol=1e-4, rtol=1e-4)
    for name, grad in out["reference"][1].items():
        torch.testing.assert_close(out["fla"][1][name], grad, atol=2e-3, rtol=2e-2, msg=name)
