"""Autoregressive decoding through the fused conv + SSM kernel (``ops.conv_ssm_update``, one launch per Mamba-2
layer and token) equals decoding on the reference ops: the tokens, and every step's fp32 logits within 1e-4.

On CPU the kernel runs under the Triton interpreter (a tiny float32 Mamba-2, batch 2 with prompts of different
lengths, a few steps); on CUDA the real kernel. The spy checks the fused kernel really ran and the unfused pair
did not.
"""
from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before any Triton module of ssmspec is imported (they are imported lazily by the ops)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from ssmspec.engine.generate import generate  # noqa: E402
from ssmspec.models.config import load_preset  # noqa: E402
from ssmspec.models.model import build_model  # noqa: E402
from ssmspec.verify.greedy import GreedyVerifier  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


class _LogitRecorder(GreedyVerifier):
    """Greedy verifier that keeps every step's fp32 logits (eager runs)."""

    fp32_logits = True

    def __init__(self):
        self.logits = []

    def verify(self, node_logits, drafts, generator=None):
        self.logits.append(node_logits.float().clone())
        return super().verify(node_logits, drafts, generator)


@pytest.fixture
def calls(monkeypatch):
    """Count the calls of the fused kernel and of the unfused pair's kernels."""
    import importlib

    seen: dict[str, int] = {}
    for mod_name, fn in (("ssmspec.ops.conv_ssm_update.triton", "conv_ssm_update_triton"),
                         ("ssmspec.ops.selective_state_update.triton", "selective_state_update_triton"),
                         ("ssmspec.ops.causal_conv1d.triton", "causal_conv1d_update_triton")):
        mod = importlib.import_module(mod_name)
        orig = getattr(mod, fn)

        def spy(*a, _orig=orig, _fn=fn, **k):
            seen[_fn] = seen.get(_fn, 0) + 1
            return _orig(*a, **k)

        monkeypatch.setattr(mod, fn, spy)
    return seen


def _decode(model, prompts, new, backend, monkeypatch):
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", backend)
    monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "conv_ssm")  # opt-in (ops.dispatch.decode_fusion)
    rec = _LogitRecorder()
    out = generate(model, prompts, max_new_tokens=new, strategy="autoregressive", verifier=rec, timing=False,
                   cuda_graph=False)
    return out.sequences, torch.stack(rec.logits)


def test_fused_decode_equals_reference_decode(calls, monkeypatch):
    cfg = load_preset("tiny-mamba2")
    model = build_model(cfg, seed=0, device=DEVICE, dtype=torch.float32)
    prompts, new = [[5, 17, 33, 8, 90], [9, 10, 11]], 5
    ref_tokens, ref_logits = _decode(model, prompts, new, "reference", monkeypatch)
    assert not calls, "the reference backend must not reach a kernel"
    tokens, logits = _decode(model, prompts, new, "triton", monkeypatch)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens == ref_tokens
    decode_calls = (new - 1) * len(cfg.mamba_layers)  # the first token comes from the prompt pass
    assert calls.get("conv_ssm_update_triton") == decode_calls, calls
    assert "selective_state_update_triton" not in calls and "causal_conv1d_update_triton" not in calls, calls
