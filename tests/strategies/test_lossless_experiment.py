"""The ``lossless`` experiment: its statistics catch what they should, and a tiny run through the composed
config yields exact greedy rows, n/a rows for trees on chain-only strategies, passing sampling rows, and
a table image."""
import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from ssmspec import config as C
from ssmspec.bench.lossless import chi_square, exact_joint, run_lossless
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.paths import CONF_DIR
from ssmspec.plots.lossless import plot_lossless
from ssmspec.runner import prepare
from ssmspec.verify.distributions import SamplingConfig


def test_chi_square_accepts_the_truth_and_rejects_a_skew():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    n = 5000
    counts = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen), minlength=4).double()
    assert chi_square(counts, probs * n)[2] > 1e-3
    skew = torch.tensor([0.37, 0.33, 0.2, 0.1], dtype=torch.float64)  # 3% of the mass moved
    counts = torch.bincount(torch.multinomial(skew, n, replacement=True, generator=gen), minlength=4).double()
    assert chi_square(counts, probs * n)[2] < 1e-3
    impossible = torch.tensor([10.0, 0, 0, 1])  # an outcome the target gives probability 0
    assert chi_square(impossible, torch.tensor([11.0, 0, 0, 0]))[2] == 0.0


def test_exact_joint_is_a_distribution_over_the_top_k_tree():
    model = build_model(load_preset("tiny-mamba2"), seed=0)
    joint = exact_joint(model, [5, 6, 7], 3, SamplingConfig(temperature=1.0, top_k=2))
    assert len(joint) == 8 and all(len(k) == 3 for k in joint)
    assert abs(sum(joint.values()) - 1.0) < 1e-6


def test_tiny_run_and_table(tmp_path):
    C.register_configs()
    drafters = "[{name:none},{name:oracle,p:0.6,draft_len:2},{name:oracle,p:0.7,tree:[0,0,1]}]"
    overrides = ["experiment=lossless", "profile=cpu", "bench.presets=[tiny-hybrid]", f"bench.drafters={drafters}",
                 "bench.strategies=[autoregressive,joint_attainment,stree]", "bench.new_tokens=6",
                 "bench.sampling.samples=600", "bench.sampling.tokens=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    cfg, _ = prepare(cfg, cli_overrides=overrides)
    rows = list(run_lossless(cfg))
    df = pd.DataFrame(rows)
    greedy = df[df.kind == "greedy"]
    assert len(greedy) == 3 * 3
    ok = greedy[greedy.status == "ok"]
    assert ok.exact.all() and (ok.agree == 1.0).all() and (ok.cache_bytes > 0).all()
    na = greedy[greedy.status == "n/a"].set_index(["strategy", "drafter"]).reason.to_dict()
    assert na[("joint_attainment", "oracle tree 3 nodes p=0.7")] == "chains only"
    assert na[("autoregressive", "oracle p=0.6 1x2")] == "does not speculate"
    sampling = df[df.kind == "sampling"]
    assert set(sampling.strategy) == {"autoregressive", "joint_attainment", "stree"} and sampling["pass"].all()
    out = tmp_path / "lossless.png"
    plot_lossless(df, out)
    assert out.stat().st_size > 10_000


def _prepared(overrides):
    C.register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return prepare(cfg, cli_overrides=overrides)[0]


def test_model_choice_runs_the_sampling_rows_on_that_preset_too():
    cfg = _prepared(["experiment=lossless", "profile=cpu", "model=tiny-mamba2"])
    assert list(cfg.bench.presets) == ["tiny-mamba2"] and list(cfg.bench.sampling.presets) == ["tiny-mamba2"]
    typed = ["experiment=lossless", "profile=cpu", "model=tiny-qwen3.5", "bench.sampling.presets=[tiny-qwen3.5]"]
    assert list(_prepared(typed).bench.sampling.presets) == ["tiny-qwen3.5"]  # what is typed wins

