"""Every strategy keeps Gated DeltaNet state: on tiny Qwen3.5 / Qwen3-Next hybrids (GDN + gated attention,
dense MLP or MoE) its greedy output equals autoregressive token for token (float64; batch 3 with left
padding; oracle chains at p 0 / 0.5 / 1, several chains, a token tree where the strategy verifies trees, PNG).
Strategies registered later are covered without editing this file. replay verifies GDN layers on one chain
only (its GDN kernel takes a causal window) and says so."""
import pytest

from conftest import DRAFT_CASES, NEW, PROMPTS, reference_run, speculative_strategies, supports_trees
from ssmspec.engine.generate import generate
from ssmspec.strategies import strategy_names

QWEN = ["tiny-qwen3.5", "tiny-qwen3-next"]
CASES = [c for c in DRAFT_CASES if c.id in ("S1-p0.5", "S3-p0", "S3-p0.5", "S5-p1", "2xS3-p0.5", "tree-p0.5",
                                            "png-2xS3")]
CHAIN_ONLY_ON_GDN = {"replay"}  # one chain per sequence on GDN layers (module doc)


def _fits(strategy, case) -> bool:
    if case.tree and not supports_trees(strategy):
        return False
    return not (strategy in CHAIN_ONLY_ON_GDN and (case.tree or case.D > 1))


GRID = [pytest.param(preset, name, case, id=f"{preset}-{name}-{case.id}") for preset in QWEN
        for name in speculative_strategies() for case in CASES if _fits(name, case)]


@pytest.mark.parametrize("preset, strategy, case", GRID)
def test_greedy_equals_autoregressive_on_gdn(preset, strategy, case):
    model, ref = reference_run(preset)
    assert len({t for r in ref for t in r}) > 6  # the reference is not a degenerate repeat
    out = generate(model, PROMPTS, max_new_tokens=NEW, strategy=strategy, timing=False,
                   drafter=case.make(ref, model.cfg.vocab_size))
    assert out.sequences == ref
    hist = out.accepted_histogram()
    if case.drafter == "oracle" and case.p == 0.0:
        assert set(hist) == {0}
    if case.drafter == "oracle" and case.p == 1.0 and not case.tree:
        assert max(hist) == case.S


@pytest.mark.parametrize("preset", QWEN)
@pytest.mark.parametrize("strategy", strategy_names())
def test_standard_decoding_on_gdn(preset, strategy):
    model, ref = reference_run(preset)
    out = generate(model, PROMPTS, max_new_tokens=5, strategy=strategy, timing=False)
    assert out.sequences == [r[:5] for r in ref]


@pytest.mark.parametrize("scan, jit_copy", [("chunk", True), ("loop", True), ("fused", False)])
def test_joint_attainment_options_on_gdn(scan, jit_copy):
    from ssmspec.strategies import make_strategy
    model, ref = reference_run("tiny-qwen3-next")
    case = next(c for c in DRAFT_CASES if c.id == "2xS3-p0.5")
    out = generate(model, PROMPTS, max_new_tokens=NEW, timing=False, drafter=case.make(ref, model.cfg.vocab_size),
                   strategy=make_strategy("joint_attainment", scan=scan, jit_copy=jit_copy))
    assert out.sequences == ref


@pytest.mark.parametrize("strategy", sorted(CHAIN_ONLY_ON_GDN))
def test_chain_only_strategies_refuse_gdn_trees(strategy):
    model, ref = reference_run("tiny-qwen3.5")
    case = next(c for c in DRAFT_CASES if c.id == "tree-p0.5")
    with pytest.raises(ValueError, match="one chain only.*stree"):
        generate(model, PROMPTS, max_new_tokens=4, strategy=strategy, timing=False,
                 drafter=case.make(ref, model.cfg.vocab_size))
