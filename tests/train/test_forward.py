"""The training forward (TrainStrategy + CausalAttention through the model's strategy hook) equals the model's
inference prefill and carries gradients to every parameter, for every trainable family (float64, tiny presets)."""
import pytest
import torch

from ssmspec.engine.context import RunContext
from ssmspec.models.config import load_preset
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import build_model
from ssmspec.strategies import SpecConfig, StepInputs, make_strategy
from ssmspec.train.forward import train_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prefill_logits(model, ids):
    cfg = model.cfg
    ar = make_strategy("autoregressive")
    ar.allocate(cfg, ids.shape[0], SpecConfig(), "cpu", model.dtype)
    kv = [KVCache(ids.shape[0], cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=ids.shape[0],
                  max_new=ids.shape[1], device="cpu", dtype=model.dtype) for _ in cfg.attention_layers]
    step = StepInputs(input_ids=ids, positions=torch.arange(ids.shape[1])[None].expand_as(ids), prefill=True)
    with torch.no_grad():
        return model(ids, RunContext(strategy=ar, kv=kv, step=step))


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid", "tiny-qwen3.5"])
def test_training_forward_equals_prefill_and_reaches_every_parameter(preset):
    model = build_model(load_preset(preset), seed=3, dtype=torch.float64)
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(0))  # crosses scan chunks
    ref = prefill_logits(model, ids)
    got = train_logits(model.train(), ids)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    got.logsumexp(-1).mean().backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []
