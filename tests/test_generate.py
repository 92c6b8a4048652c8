"""generate(): greedy is the argmax chain of one parallel forward, a left-padded batch equals each prompt
alone, seeded sampling (temperature / top-p / top-k) is reproducible and follows the target
distribution, EOS and max_new_tokens stop sequences, step hooks see every step, a padded (B, T) tensor with
its attention mask equals the lists, bad inputs fail clearly.
Greedy agreement is asserted on float64 models (exact token equality)."""
import pytest
import torch

from ssmspec.engine.generate import generate
from ssmspec.models import build_model, load_preset
from ssmspec.verify.distributions import SamplingConfig, target_probs
from model_forward import parallel_logits


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


PRESETS = ["tiny-mamba2", "tiny-hybrid", "tiny-mamba-in-llama"]
PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [42, 7]]  # lengths 4, 11, 2
NEW = 10



@pytest.fixture(scope="module", params=PRESETS)
def model64(request):
    return build_model(load_preset(request.param), seed=1, dtype=torch.float64)


def test_greedy_is_the_argmax_chain_of_a_parallel_forward(model64):
    out = generate(model64, [PROMPTS[1]], max_new_tokens=NEW).sequences[0]
    ids = torch.tensor([PROMPTS[1] + out])
    pred = parallel_logits(model64, ids)[0].argmax(-1)  # (L,) next-token argmax at every position
    assert pred[len(PROMPTS[1]) - 1:-1].tolist() == out
    assert len(set(out)) > 2  # not a constant sequence


def test_batch_of_different_lengths_equals_each_prompt_alone(model64):
    batch = generate(model64, PROMPTS, max_new_tokens=NEW).sequences
    alone = [generate(model64, [p], max_new_tokens=NEW).sequences[0] for p in PROMPTS]
    assert batch == alone
    assert len({tuple(s) for s in batch}) == len(PROMPTS)


def _padded(prompts, side, pad):
    """(B, T) ids padded with ``pad`` on ``side`` and their 0/1 attention mask, as a tokenizer returns them."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[b, cols], mask[b, cols] = torch.tensor(p), 1
    return ids, mask


def test_tensor_prompts_equal_list_prompts(model64):
    """A (B, T) LongTensor with an attention mask (either padding side; pad ids never read, even out of the
    vocabulary) and a 1-D tensor give the list-of-lists output token for token."""
    ref = generate(model64, PROMPTS, max_new_tokens=NEW).sequences
    for side in ("left", "right"):
        ids, mask = _padded(PROMPTS, side, pad=-100)
        assert generate(model64, ids, attention_mask=mask, max_new_tokens=NEW).sequences == ref, side
        assert generate(model64, ids, attention_mask=mask.bool(), max_new_tokens=NEW).sequences == ref, side
    same = [PROMPTS[0], [3, 4, 5, 6]]  # equal lengths: no mask needed
    assert generate(model64, torch.tensor(same), max_new_tokens=NEW).sequences == \
        generate(model64, same, max_new_tokens=NEW).sequences
    assert generate(model64, torch.tensor(PROMPTS[1]), max_new_tokens=NEW).sequences == [ref[1]]


@pytest.mark.parametrize("prompts,kwargs,error,match", [
    pytest.param(["hello"], {}, TypeError, r"generate takes token ids, not text: tokenize first, e.g\. tok = "
                 r"ssmspec\.load_tokenizer\(model\).*tok\.encode\(text\)", id="strings"),
    pytest.param("hello", {}, TypeError, "not text: tokenize first", id="one-string"),
    pytest.param(torch.tensor([[5.0, 6.0, 7.0]]), {}, TypeError, r"dtype torch\.float32; token ids are integers: pass "
                 r"a \(B, T\) LongTensor", id="float-tensor"),
    pytest.param(torch.ones(1, 3, 4, dtype=torch.long), {}, ValueError, r"shape \(1, 3, 4\); generate takes token ids "
                 r"of shape \(T,\) \(one prompt\) or \(B, T\)", id="3-d"),
    pytest.param(torch.tensor([[5, 6, 7]]), {"attention_mask": torch.ones(1, 4)}, ValueError,
                 r"attention_mask has shape \(1, 4\) but the prompt tensor \(1, 3\); they must match", id="mask-shape"),
    pytest.param(torch.tensor([[5, 6, 7, 8]]), {"attention_mask": torch.tensor([[1, 0, 1, 1]])}, ValueError,
                 r"attention_mask row 0 has 0s between its 1s \(\[1, 0, 1, 1\]\).*left or the right only",
                 id="mask-hole"),
    pytest.param(torch.tensor([[5, 6], [7, 8]]), {"attention_mask": torch.tensor([[1, 1], [0, 0]])}, ValueError,
                 "attention_mask row 1 is all 0; every prompt needs at least one token", id="mask-empty-row"),
    pytest.param(torch.tensor([[5, 6]]), {"attention_mask": torch.tensor([[2, 1]])}, ValueError,
                 r"attention_mask holds \[2\]; it must be 0 \(padding\) or 1", id="mask-values"),
    pytest.param([[5, 6]], {"attention_mask": torch.tensor([[1, 1]])}, TypeError,
                 "attention_mask goes with a .B, T. tensor", id="mask-with-lists"),
    pytest.param([5, 6, 7], {}, TypeError, r"prompt 0 is 5, not a list of token ids.*\[\[5, 6, 7\]\] for one prompt",
                 id="flat-list"),
    pytest.param([[5, 6.5]], {}, TypeError, r"prompt 0 holds 6\.5, not a token id", id="float-in-list"),
    pytest.param({"input_ids": torch.tensor([[5, 6]])}, {}, TypeError, r"enc\['input_ids'\], "
                 r"attention_mask=enc\['attention_mask'\]", id="tokenizer-output"),
])
def test_prompt_forms_refused(prompts, kwargs, error, match):
    model = build_model(load_preset("tiny-mamba2"), seed=0)
    with pytest.raises(error, match=match):
        generate(model, prompts, max_new_tokens=4, **kwargs)


@pytest.fixture(scope="module")
def peaky():
    """tiny-hybrid with a sharpened LM head (a few tokens carry the mass), float32, short KV cache."""
    model = build_model(load_preset("tiny-hybrid", max_seq_len=32), seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def test_sampling_is_seeded(peaky):
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=3)
    a = generate(peaky, PROMPTS, max_new_tokens=NEW, sampling=cfg).sequences
    assert generate(peaky, PROMPTS, max_new_tokens=NEW, sampling=cfg).sequences == a
    other = generate(peaky, PROMPTS, max_new_tokens=NEW, sampling=SamplingConfig(temperature=0.8, top_p=0.95, seed=4))
    assert other.sequences != a
    greedy = generate(peaky, PROMPTS, max_new_tokens=NEW).sequences
    assert a != greedy  # temperature 0.8 does sample
    # a nucleus below the top token's mass, or top-k 1, keeps only the argmax: greedy again
    for tight in (SamplingConfig(temperature=1.0, top_p=1e-6, seed=3), SamplingConfig(temperature=2.0, top_k=1)):
        assert generate(peaky, PROMPTS, max_new_tokens=NEW, sampling=tight).sequences == greedy


def test_sampling_follows_the_target_distribution(peaky):
    """1000 independent first tokens after one prompt: all inside the top-p nucleus, and their empirical
    distribution is within total variation 0.08 of temperature/top-p target probabilities (the expected
    TV for a 3-token nucleus and 1000 draws is about 0.02)."""
    prompt, n = [5, 17, 33, 8], 1000
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=0)
    probs = target_probs(parallel_logits(peaky, torch.tensor([prompt]))[0, -1], cfg)
    assert 2 <= int((probs > 0).sum()) <= 10  # the test sees a real nucleus, not a one-hot
    toks = torch.tensor([s[0] for s in generate(peaky, [prompt] * n, max_new_tokens=1, sampling=cfg).sequences])
    assert bool((probs[toks] > 0).all())
    emp = torch.bincount(toks, minlength=probs.numel()).double() / n
    assert 0.5 * (emp - probs.double()).abs().sum() < 0.08


def test_eos_and_max_new_tokens(model64):
    ref = generate(model64, PROMPTS[:2], max_new_tokens=NEW).sequences
    k = next(i for i in range(2, NEW) if ref[0][i] not in ref[0][:i])  # a token first emitted at step k >= 2
    eos = ref[0][k]
    out = generate(model64, PROMPTS[:2], max_new_tokens=NEW, eos_token_id=eos)
    assert out.sequences[0] == ref[0][:k + 1]  # stops right after EOS, EOS included
    stop1 = ref[1].index(eos) + 1 if eos in ref[1] else NEW
    assert out.sequences[1] == ref[1][:stop1]  # the other sequence runs on to its own end
    assert len(out.steps) == max(k + 1, stop1)  # the loop ends when every sequence is done
    for n in (1, 3):
        assert [len(s) for s in generate(model64, PROMPTS, max_new_tokens=n).sequences] == [n] * 3


def test_step_hooks_and_progress(model64):
    seen, ticks = [], []
    out = generate(model64, PROMPTS, max_new_tokens=5, hooks=[seen.append], progress=ticks.append)
    assert seen == out.steps and [r.index for r in seen] == list(range(5))
    assert seen[0].emitted == [1, 1, 1] and seen[0].tokens_in_call == 3 * 11  # prefill, left-padded
    assert all(r.seconds >= 0 for r in seen) and all(r.tokens_in_call == 3 for r in seen[1:])
    assert [sum(r.emitted[b] for r in seen) for b in range(3)] == [len(s) for s in out.sequences] == [5] * 3
    assert sum(ticks) == out.model_calls == 4
    assert out.prefill_seconds == seen[0].seconds and out.accepted_histogram() == {0: 12}
    assert out.cache_bytes > 0


def test_prompt_longer_than_the_kv_cache():
    model = build_model(load_preset("tiny-hybrid", max_seq_len=32), seed=0)
    with pytest.raises(ValueError, match=r"prompt of 30 tokens \+ 8 new tokens .* needs 39 KV slots but tiny-hybrid "
                                         r"allocates max_seq_len=32; shorten the prompt, lower max_new_tokens, or "
                                         r"raise model.max_seq_len"):
        generate(model, [list(range(3, 33))], max_new_tokens=8)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
])
def test_sampling_parameters_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("prompts,new,match", [
    ([[5, 6], []], 4, "every prompt needs at least one token"),
    ([], 4, "every prompt needs at least one token"),
    ([[5, 6]], 0, "max_new_tokens must be >= 1"),
    ([[5, 300]], 4, r"token ids must lie in \[0, 300\)"),
    ([[-1, 5]], 4, r"token ids must lie in \[0, 300\)"),
])
def test_bad_generate_arguments(prompts, new, match):
    model = build_model(load_preset("tiny-mamba2"), seed=0)
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, max_new_tokens=new)
