"""Our HybridLM equals transformers 5's Mamba2ForCausalLM and NemotronHForCausalLM (CPU, float32).

Tiny random models are built with transformers (n_groups = 2; NemotronH with M, *, - and E blocks and
group-limited MoE routing), saved with save_pretrained, read back with ``load_model`` and compared:
full forward, prefill followed by token-by-token decode (teacher-forced), greedy generation (single
prompts and a left-padded batch), and a mamba_ssm-format checkpoint. Weights are re-drawn at O(1)
scale so logits are far from flat and greedy paths are not degenerate.

Tolerances (float32 everywhere; both sides run the SSD scan in fp32):
  logits vs transformers: atol 1e-4, rtol 1e-4 (observed ~2e-6 on logits of magnitude ~10)
  our decode vs our own parallel forward: atol 2e-5, rtol 1e-5
  greedy tokens: exact
"""
import inspect
import json
import math

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

from ssmspec.engine.generate import generate
from ssmspec.models import load_model
from ssmspec.verify.base import Verdict
from model_forward import parallel_logits


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


TOL = {"atol": 1e-4, "rtol": 1e-4}  # ours vs transformers
SELF_TOL = {"atol": 2e-5, "rtol": 1e-5}  # our decode vs our parallel forward
VOCAB = 100
PROMPT = [5, 17, 33, 8, 9, 12, 40, 41, 3, 77, 21, 60, 2]  # 13 tokens: crosses a chunk boundary (chunk 8)
FORCED = [7, 91, 3, 45, 45, 12, 0, 64]  # teacher-forced continuation


@torch.no_grad()
def randomize(model, seed: int, *, dt_bias=(-1.0, 0.0)):
    """O(1) random weights: projections ~ N(0, 1/fan_in), norms 1 ± 0.2, A in [1, 8], D in [0.5, 1.5],
    dt_bias uniform in ``dt_bias``, router correction bias ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
        elif name.endswith("dt_bias"):
            lo, hi = dt_bias
            p.copy_(torch.rand(p.shape, generator=g) * (hi - lo) + lo)
        elif name.endswith(".D"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def mamba2_config(**kw):
    base = {"hidden_size": 32, "num_heads": 4, "head_dim": 16, "expand": 2, "state_size": 8, "n_groups": 2,
            "conv_kernel": 4, "chunk_size": 8, "num_hidden_layers": 2, "vocab_size": VOCAB,
            "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": None}
    return Mamba2Config(**{**base, **kw})


def nemotron_config(**kw):
    base = {"hidden_size": 32, "hybrid_override_pattern": "M*-EM", "vocab_size": VOCAB, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "mamba_num_heads": 4,
            "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "chunk_size": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24,
            "n_group": 2, "topk_group": 1, "eos_token_id": None, "time_step_min": 1e-4}
    return NemotronHConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, checkpoint dir)."""
    out = {}
    for name, model in (("mamba2", Mamba2ForCausalLM(mamba2_config())),
                        ("nemotron_h", NemotronHForCausalLM(nemotron_config()))):
        randomize(model, seed=len(out))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out



class Forcing:
    """Verifier that emits a fixed continuation and records the logits of every call (teacher forcing
    through our real prefill + decode loop)."""

    name = "forcing"

    def __init__(self, tokens):
        self.tokens, self.logits = list(tokens), []

    def verify(self, node_logits, drafts, generator=None):
        self.logits.append(node_logits[:, 0].clone())
        tok = torch.tensor([self.tokens[len(self.logits) - 1]])
        zero = torch.zeros(1, dtype=torch.long)
        return Verdict(accepted=zero, path=zero[:, None], bonus=tok)


def ours_decode_logits(model, prompt, forced):
    """Logits after the prompt (prefill) and after each forced token (one-token decode steps): (1+n, V)."""
    rec = Forcing(forced)
    generate(model, [prompt], max_new_tokens=len(forced), verifier=rec)
    return torch.cat(rec.logits)[: len(forced)]


@torch.no_grad()
def hf_decode_logits(hf, prompt, forced):
    """transformers: prefill with a cache, then one forced token per call. (n, V) like ours_decode_logits."""
    # the forward's cache argument (and output field): ``cache`` in transformers from 5.2x on, which warns that the
    # older names go in 5.40; those names below it
    if "cache" in inspect.signature(hf.forward).parameters:
        key = "cache"
    else:
        key = "cache_params" if isinstance(hf, Mamba2ForCausalLM) else "past_key_values"
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, logits = getattr(out, key), [out.logits[:, -1]]
    for tok in forced[:-1]:
        out = hf(torch.tensor([[tok]]), use_cache=True, **{key: cache})
        logits.append(out.logits[:, -1])
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_full_forward_matches_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    ours = load_model(path)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.no_grad():
        ref = hf(ids).logits
    got = parallel_logits(ours, ids)
    assert ref.abs().max() > 1.0  # O(1) logits: the comparison is not vacuous
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_prefill_then_decode_matches_transformers_and_parallel_forward(checkpoints, name):
    hf, path = checkpoints[name]
    ours = load_model(path)
    got = ours_decode_logits(ours, PROMPT, FORCED)
    torch.testing.assert_close(got, hf_decode_logits(hf, PROMPT, FORCED), **TOL)
    # step-by-step decode equals one parallel forward over prompt + forced tokens
    full = parallel_logits(ours, torch.tensor([PROMPT + FORCED]))[0, len(PROMPT) - 1:-1]
    torch.testing.assert_close(got, full, **SELF_TOL)


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_greedy_generation_matches_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    ours = load_model(path)
    prompts, new = [PROMPT, [9, 10, 11]], 12
    for p in prompts:
        ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):]
        assert generate(ours, [p], max_new_tokens=new).sequences == [ref.tolist()]
    # a left-padded batch (transformers with an attention mask; ours pads internally)
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)[:, T:]
    out = generate(ours, prompts, max_new_tokens=new).sequences
    assert out == ref.tolist()
    assert len({tuple(s) for s in out}) == 2 and all(len(set(s)) > 3 for s in out)  # not degenerate


def test_nemotron_time_step_min_is_applied_in_every_path(tmp_path):
    """transformers' NemotronH clamps dt to time_step_min in its chunk scan (prefill) but not in its
    one-token decode path (shared/MODELS.md 1b), so its decode disagrees with its own full forward once
    softplus(dt) < time_step_min. We clamp in every path: our full forward and our decode both equal
    transformers' chunk path. Weights with dt_bias = -10 (softplus ~ 5e-5 < time_step_min 1e-2)."""
    hf = randomize(NemotronHForCausalLM(nemotron_config(time_step_min=1e-2)), seed=5, dt_bias=(-10.0, -10.0))
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.cfg.dt_min_limit == pytest.approx(1e-2)
    ids = torch.tensor([PROMPT + FORCED])
    with torch.no_grad():
        hf_full = hf(ids).logits[0, len(PROMPT) - 1:-1]  # chunk path: clamped
    hf_dec = hf_decode_logits(hf, PROMPT, FORCED)  # decode path: not clamped
    assert (hf_dec[1:] - hf_full[1:]).abs().max() > 3e-2  # transformers disagrees with itself (~0.1)
    torch.testing.assert_close(hf_dec[0], hf_full[0], **TOL)  # (the prefill logits are both chunk path)
    torch.testing.assert_close(parallel_logits(ours, ids)[0, len(PROMPT) - 1:-1], hf_full, **TOL)
    torch.testing.assert_close(ours_decode_logits(ours, PROMPT, FORCED), hf_full, **TOL)


def test_mamba_ssm_checkpoint_loads_and_matches(tmp_path):
    """A MambaLMHeadModel checkpoint (config.json with d_model / n_layer / ssm_cfg, pytorch_model.bin with
    backbone.embedding.weight and a tied lm_head, vocab padded to pad_vocab_size_multiple) loads and
    equals transformers' Mamba2 with the same weights (shared/MODELS.md section 4)."""
    hf = randomize(Mamba2ForCausalLM(mamba2_config(vocab_size=112)), seed=3)  # 100 padded to a multiple of 16
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone() for k, v in hf.state_dict().items()}
    assert "lm_head.weight" in sd and "backbone.embedding.weight" in sd
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": 100,
        "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 16, "tie_embeddings": True}))
    ours = load_model(tmp_path)
    assert ours.cfg.vocab_size == 112 and ours.cfg.ssm_heads == 4 and ours.cfg.n_groups == 2
    assert ours.lm_head.weight is ours.embeddings.weight
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(parallel_logits(ours, ids), ref, **TOL)
    torch.testing.assert_close(ours_decode_logits(ours, PROMPT, FORCED), hf_decode_logits(hf, PROMPT, FORCED), **TOL)
