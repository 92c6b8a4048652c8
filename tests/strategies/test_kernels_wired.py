"""The strategies run on the Triton kernels: every strategy with the ops forced to ``backend=triton``
(``SSMSPEC_OPS_BACKEND``) is still lossless, and the kernels were really called.

On CPU the kernels run under the Triton interpreter (tiny float32 models, a few steps); on a CUDA machine
the real kernels run, and the ``gpu`` test repeats the check at a published size (mamba2-130m, random
weights) where the kernels take their real block shapes. Greedy agreement in float32 is exact here
because the logit margins of these random models are far above the kernels' rounding (about 1e-6), which
``_clear_model`` checks so that a near-tie could never make the test pass or fail by luck.
"""
from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before any Triton module of ssmspec is imported (they are imported lazily by the ops)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from ssmspec.drafting.oracle import Oracle  # noqa: E402
from ssmspec.engine.generate import generate  # noqa: E402
from ssmspec.models.config import load_preset  # noqa: E402
from ssmspec.models.model import build_model  # noqa: E402
from ssmspec.strategies import make_strategy, strategy_names  # noqa: E402
from ssmspec.strategies.base import SpecConfig  # noqa: E402
from ssmspec.verify.greedy import GreedyVerifier  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TRITON_MODULES = {
    "ssmspec.ops.multistep.triton": ("ssm_multistep_triton", "ssm_multistep_snapshot_triton"),
    "ssmspec.ops.selective_state_update.triton": ("selective_state_update_triton",),
    "ssmspec.ops.causal_conv1d.triton": ("causal_conv1d_update_triton", "conv_state_advance_triton"),
    "ssmspec.ops.conv_ssm_update.triton": ("conv_ssm_update_triton",),
    "ssmspec.ops.replay.triton": ("replay_verify_triton",),
    "ssmspec.ops.replay.fused": ("replay_verify_fused_triton",),
    "ssmspec.ops.tree_scan.triton": ("tree_scan_triton", "tree_conv1d_triton"),
    "ssmspec.ops.gdn.recurrent": ("gdn_multistep_triton", "gdn_multistep_snapshot_triton"),
    "ssmspec.ops.gdn.replay": ("gdn_replay_verify_triton",),
    "ssmspec.ops.step_glue.triton": ("absorb_plan_triton", "emit_triton", "chain_verdict_triton"),
    "ssmspec.ops.gemv.triton": ("linear_small_triton",),
}
GEMV_STRATEGY = "replay"  # the one strategy whose CPU run keeps the decode GEMV (see kernel_calls)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Force the Triton backend and count the calls of every kernel entry point.

    Under the CPU interpreter the decode projections stay on the reference matmul (``SSMSPEC_DECODE_FUSION=none``):
    the GEMV of ops/gemv ran every linear layer of both models and was half of this file's time, while it is not
    what these tests are about (tests/ops/test_gemv.py runs it in a model's decode); the ``GEMV_STRATEGY`` case
    turns it back on, so one speculative strategy still verifies through it. On CUDA everything is the default."""
    import importlib

    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    if not CUDA:
        monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "none")
    calls: dict[str, int] = {}
    for mod_name, fns in TRITON_MODULES.items():
        mod = importlib.import_module(mod_name)
        for fn in fns:
            orig = getattr(mod, fn)

            def spy(*a, _orig=orig, _fn=fn, **k):
                calls[_fn] = calls.get(_fn, 0) + 1
                return _orig(*a, **k)

            monkeypatch.setattr(mod, fn, spy)
    return calls


class _MarginVerifier(GreedyVerifier):
    """Greedy verifier that keeps the smallest top-1 minus top-2 logit it saw."""

    fp32_logits = True  # the margin of the fp32 logits

    def __init__(self):
        self.margin = float("inf")

    def verify(self, node_logits, drafts, generator=None):
        top = node_logits.float().topk(2, dim=-1).values
        self.margin = min(self.margin, float((top[..., 0] - top[..., 1]).min()))
        return super().verify(node_logits, drafts, generator)


def _run(model, prompts, strategy, new, drafter=None):
    return generate(model, prompts, max_new_tokens=new, strategy=strategy, drafter=drafter, timing=False)


def _reference(model, prompts, new) -> tuple[list[list[int]], float]:
    """Autoregressive greedy on the reference ops and the smallest top-1 minus top-2 logit along the way."""
    os.environ["SSMSPEC_OPS_BACKEND"] = "reference"
    rec = _MarginVerifier()
    ref = generate(model, prompts, max_new_tokens=new, strategy="autoregressive", verifier=rec,
                   timing=False, cuda_graph=False).sequences  # the margin is read on the host every step
    os.environ["SSMSPEC_OPS_BACKEND"] = "triton"
    return ref, rec.margin


def _clear_model(preset: str, prompts, new, *, dtype=torch.float32, seeds=range(20), margin=1e-3, **cfg):
    """The first seeded random model whose reference run never comes within ``margin`` of a tie, so that
    kernel rounding (about 1e-6) can neither flip a token nor hide a wrong one; the seed is found on this
    device (its matmuls round differently from the CPU's). ``cfg``: overrides of the preset."""
    for seed in seeds:
        model = build_model(load_preset(preset, **cfg), seed=seed, device=DEVICE, dtype=dtype)
        ref, m = _reference(model, prompts, new)
        if m > margin:
            return model, ref
    raise AssertionError(f"no seed in {seeds} gives {preset} a top-2 logit margin above {margin}")


def _expected_kernels(name: str) -> set[str]:
    """Kernels a strategy must reach in decode (besides the conv ops every strategy uses)."""
    return {"autoregressive": {"selective_state_update_triton"},  # conv_ssm_update is opt-in (SSMSPEC_DECODE_FUSION)
            "snapshot": {"ssm_multistep_snapshot_triton"},
            "activation_replay": {"ssm_multistep_triton"},
            "joint_attainment": {"ssm_multistep_triton"},
            "stree": {"ssm_multistep_triton", "tree_scan_triton", "tree_conv1d_triton"},
            "replay": {"replay_verify_triton", "replay_verify_fused_triton"}}.get(name, set())  # small grid: one launch


@pytest.mark.parametrize("strategy", strategy_names())
def test_strategy_on_triton_kernels_is_lossless(strategy, kernel_calls, monkeypatch):
    prompts = [[5, 17, 33, 8, 90], [9, 10, 11]]
    new = 8
    gemv = CUDA or strategy == GEMV_STRATEGY
    if gemv:
        monkeypatch.setenv("SSMSPEC_DECODE_FUSION", "gemv")  # the default
    model, ref = _clear_model("tiny-hybrid", prompts, new)
    kernel_calls.clear()
    drafter = None
    if make_strategy(strategy).speculative:
        drafter = Oracle(p=0.6, draft_len=3, num_drafts=1, reference=ref, vocab_size=model.cfg.vocab_size, seed=1)
    out = _run(model, prompts, strategy, new, drafter)
    assert out.sequences == ref
    assert {"causal_conv1d_update_triton"} <= set(kernel_calls) or strategy == "stree"  # stree: tree conv
    assert "emit_triton" in kernel_calls  # every step emits its tokens in one launch (ops/step_glue)
    assert ("chain_verdict_triton" in kernel_calls) == (drafter is not None)  # one chain's greedy verdict
    assert _expected_kernels(strategy) <= set(kernel_calls), f"{strategy} reached {sorted(kernel_calls)}"
    if not CUDA:
        assert ("linear_small_triton" in kernel_calls) == gemv, sorted(kernel_calls)


def test_replay_on_its_four_launch_form_is_lossless(kernel_calls, monkeypatch):
    """The replay strategy with every verify call on the four-launch form (the default where the call's state is
    large), so both forms of ``replay_verify`` are checked token for token inside a real decode."""
    import ssmspec.ops.replay.triton as rt

    monkeypatch.setattr(rt, "FUSED_MAX_STATE", 0)
    prompts = [[5, 17, 33, 8, 90], [9, 10, 11]]
    new = 8
    model, ref = _clear_model("tiny-hybrid", prompts, new)
    kernel_calls.clear()
    drafter = Oracle(p=0.6, draft_len=3, num_drafts=1, reference=ref, vocab_size=model.cfg.vocab_size, seed=1)
    assert _run(model, prompts, "replay", new, drafter).sequences == ref
    assert "replay_verify_triton" in kernel_calls and "replay_verify_fused_triton" not in kernel_calls


@pytest.mark.parametrize("draft_seed", [None, 7], ids=["draft-is-target", "other-draft"])
def test_draft_model_drafter_on_triton_kernels_is_lossless(draft_seed, kernel_calls):
    """A draft model (tiny-hybrid: Mamba-2 and attention layers) drafting through the draft engine on the
    kernels, its absorb planned by ``ops/step_glue``'s one launch: the target's own weights as the draft
    (every chain accepted: each absorb resumes at the deepest depth, the resumed row's keys join the cache) and
    another, smaller model's (mostly rejected: absorbs from the committed state)."""
    from ssmspec.drafting import make_drafter

    prompts = [[5, 17, 33, 8, 90], [9, 10, 11]]
    new = 5
    model, ref = _clear_model("tiny-hybrid", prompts, new)
    # the other draft is smaller (one Mamba-2 and one attention layer), as drafts are: a third of the kernel launches
    draft = model if draft_seed is None else build_model(load_preset("tiny-hybrid", pattern="M*"), seed=draft_seed,
                                                         device=DEVICE, dtype=torch.float32)
    kernel_calls.clear()
    out = _run(model, prompts, "replay", new, make_drafter("draft_model", draft=draft, draft_len=3))
    assert out.sequences == ref
    assert {"absorb_plan_triton", "replay_verify_triton", "emit_triton"} <= set(kernel_calls), sorted(kernel_calls)
    if draft_seed is None:
        assert out.mean_accepted() > 1.5, out.mean_accepted()


def _expected_gdn_kernels(name: str) -> set[str]:
    """GDN kernels a strategy must reach in decode (stree's GDN tree solve is PyTorch: no kernel yet)."""
    return {"autoregressive": {"gdn_multistep_triton"}, "snapshot": {"gdn_multistep_snapshot_triton"},
            "activation_replay": {"gdn_multistep_triton"}, "joint_attainment": {"gdn_multistep_triton"},
            "stree": {"gdn_multistep_triton"}, "replay": {"gdn_replay_verify_triton"}}.get(name, set())


@pytest.mark.parametrize("strategy", strategy_names())
def test_strategy_on_triton_kernels_is_lossless_on_gdn(strategy, kernel_calls):
    """The same on tiny-qwen3.5 (Gated DeltaNet + gated attention): the GDN kernels of ops/gdn."""
    prompts = [[5, 17, 33, 8, 90]]  # one sequence, few steps: the interpreter runs every program on the CPU
    new = 5
    model, ref = _clear_model("tiny-qwen3.5", prompts, new)
    kernel_calls.clear()
    drafter = None
    if make_strategy(strategy).speculative:
        drafter = Oracle(p=0.6, draft_len=3, num_drafts=1, reference=ref, vocab_size=model.cfg.vocab_size, seed=1)
    out = _run(model, prompts, strategy, new, drafter)
    assert out.sequences == ref
    assert _expected_gdn_kernels(strategy) <= set(kernel_calls), f"{strategy} reached {sorted(kernel_calls)}"


class _LogitRecorder(GreedyVerifier):
    """Greedy verifier that keeps every step's logits (eager runs only: it copies them on the host's order)."""

    fp32_logits = True  # compare the fp32 logits, not their model-dtype rounding

    def __init__(self):
        self.logits = []

    def verify(self, node_logits, drafts, generator=None):
        self.logits.append(node_logits.float().clone())
        return super().verify(node_logits, drafts, generator)


def _replay_decode_on_gdn(preset: str, prompts, new: int, R: int, kernel_calls, **cfg_kw) -> None:
    """`replay` without drafts (S = 0: one-token calls, the split decode of ops/gdn/replay_split.py) equals
    autoregressive on the reference ops: the tokens (through a captured step on CUDA) and every step's
    logits within 1e-4 (an eager run); R is small enough that every sequence flushes several times."""
    model, ref = _clear_model(preset, prompts, new, seeds=range(5), **cfg_kw)
    kernel_calls.clear()
    spec = SpecConfig(buffer_size=R)
    out = generate(model, prompts, max_new_tokens=new, strategy="replay", spec=spec, timing=False)
    assert out.sequences == ref
    assert "gdn_replay_verify_triton" in kernel_calls, sorted(kernel_calls)
    logits = []
    for strategy, backend in (("autoregressive", "reference"), ("replay", "triton")):
        os.environ["SSMSPEC_OPS_BACKEND"] = backend
        rec = _LogitRecorder()
        generate(model, prompts, max_new_tokens=new, strategy=strategy, spec=spec, verifier=rec, timing=False,
                 cuda_graph=False)
        logits.append(torch.stack(rec.logits))
    os.environ["SSMSPEC_OPS_BACKEND"] = "triton"
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_replay_standard_decode_on_gdn_kernels(kernel_calls):
    _replay_decode_on_gdn("tiny-qwen3.5", [[5, 17, 33, 8, 90]], 6, 3, kernel_calls)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_replay_standard_decode_on_gdn_kernels_at_published_size(kernel_calls):
    """Qwen3.5's mixer sizes (4 layers of qwen3.5-0.8b, batch 4, CUDA graph): the split decode at its real
    launch (128 columns x 4 warps) through the engine."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (37, 64, 5, 20)]
    _replay_decode_on_gdn("qwen3.5-0.8b", prompts, 24, 8, kernel_calls, pattern="G-G-G-*-", vocab_size=4096,
                          max_seq_len=256)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("strategy", [s for s in strategy_names() if make_strategy(s).speculative])
def test_strategy_on_kernels_at_published_size(strategy, kernel_calls):
    """mamba2-130m sizes (24 layers, H=24, P=64, N=128), random float32 weights, batch 4, S=5: the real
    block shapes of every kernel."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50000, (n,), generator=gen).tolist() for n in (37, 64, 5, 20)]
    model, ref = _clear_model("mamba2-130m", prompts, 24, seeds=range(5))
    kernel_calls.clear()
    drafter = Oracle(p=0.7, draft_len=5, num_drafts=1, reference=ref, vocab_size=model.cfg.vocab_size, seed=2)
    out = _run(model, prompts, strategy, 24, drafter)
    assert out.sequences == ref
    assert _expected_kernels(strategy) <= set(kernel_calls)



@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("strategy", [s for s in strategy_names() if make_strategy(s).speculative])
def test_strategy_on_gdn_kernels_at_published_size(strategy, kernel_calls):
    """Qwen3.5's mixer sizes (GDN H=32, G=16, N=P=128; attention 8 x 2 heads of 256, partial RoPE), 4 decoder
    layers of qwen3.5-0.8b with a 4096-token vocabulary, random float32 weights, batch 4, S=5: the GDN
    kernels at their real block shapes."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (37, 64, 5, 20)]
    model, ref = _clear_model("qwen3.5-0.8b", prompts, 16, seeds=range(5), pattern="G-G-G-*-", vocab_size=4096,
                              max_seq_len=256)
    kernel_calls.clear()
    drafter = Oracle(p=0.7, draft_len=5, num_drafts=1, reference=ref, vocab_size=model.cfg.vocab_size, seed=2)
    out = _run(model, prompts, strategy, 16, drafter)
    assert out.sequences == ref
    assert _expected_gdn_kernels(strategy) <= set(kernel_calls)
