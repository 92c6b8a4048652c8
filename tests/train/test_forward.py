"""The training forward (TrainStrategy + CausalAttention through the model's strategy hook) equals the model's
inference prefill and carries gradients to every parameter, for every trainable family (float64, tiny presets);
with the Mamba-2 scan on its Triton forward + backward (the interpreter on CPU) it gives the reference's logits
and gradients."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton module is imported (see tests/ops/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"

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


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = train_logits(model, ids)
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid"])
def test_training_scan_runs_the_triton_backward(preset, monkeypatch):
    """``SSMSPEC_OPS_BACKEND=triton`` (as CUDA's ``auto`` does): every Mamba-2 mixer's scan goes through the Triton
    forward + backward, and the logits and every parameter's gradient equal the reference path's (fp32)."""
    import ssmspec.ops.ssd_grad.triton as kernel_mod
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(load_preset(preset), seed=4, dtype=torch.float32, device=device).train()
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(1)).to(device)
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "reference")
    ref, ref_grads = _logits_and_grads(model, ids)
    calls = []
    orig = kernel_mod.ssd_chunk_scan_grad_triton
    monkeypatch.setattr(kernel_mod, "ssd_chunk_scan_grad_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    got, got_grads = _logits_and_grads(model, ids)
    assert len(calls) == len(model.cfg.mamba_layers)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=1e-4 * g.abs().max().item() + 1e-7, rtol=1e-3,
                                   msg=lambda m, name=name: f"{name}: {m}")
