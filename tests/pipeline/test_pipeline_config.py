"""Every config in conf/ composes; experiment files follow the contract; schemas type-check overrides;
profile overrides merge under command-line overrides."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from ssmspec import config as C
from ssmspec.paths import CONF_DIR
from ssmspec.registry import experiment_ids, get_experiment
from ssmspec.runner import prepare

GROUPS = ("model", "strategy", "drafter", "verify", "data", "bench", "experiment")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


def _compose(overrides: list[str]):
    C.register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_defaults_compose():
    cfg = _compose([])
    assert cfg.model.name == "tiny-mamba2" and cfg.strategy.name == "autoregressive"
    assert cfg.drafter.name == "none" and cfg.verify.name == "greedy" and cfg.data.name == "synthetic"
    assert {"warmup", "iters", "cuda_graph"} <= set(cfg.bench)
    assert cfg.get("experiment") is None and cfg.profile == "auto"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_config_composes(group, option):
    cfg = _compose([f"{group}={option}"])
    if group == "model":
        mcfg = C.model_config(cfg)
        assert mcfg.name == option and mcfg.num_parameters() > 0
    elif group == "strategy":
        assert C.build_strategy(cfg).name == option
    elif group == "drafter":
        from ssmspec.drafting import drafter_names

        assert cfg.drafter.name == option and option in drafter_names()
    elif group == "verify":
        from ssmspec.verify import verifier_names

        assert cfg.verify.name == option and option in verifier_names()
    elif group in ("data", "bench"):
        assert cfg[group]  # a non-empty mapping
        if group == "data":
            assert cfg.data.name == option
    else:  # experiment: resolves for this machine (GPU-only ones just compose without CUDA)
        exp = get_experiment(option)
        assert cfg.experiment.id == option
        if not exp.needs_gpu or C.cuda_available():
            prepared, _ = prepare(cfg)
            assert prepared.profile in ("cpu", "gpu") and prepared.device in ("cpu", "cuda")


@pytest.mark.parametrize("exp_id", experiment_ids())
def test_experiment_file_contract(exp_id):
    path = CONF_DIR / "experiment" / f"{exp_id}.yaml"
    assert path.read_text().splitlines()[0].strip() == "# @package _global_"
    exp = get_experiment(exp_id)
    assert exp.title and set(exp.profiles) <= {"cpu", "gpu"}
    assert callable(exp.bench_fn()) and callable(exp.plot_fn())


def test_schema_rejects_bad_types_and_unknown_fields():
    with pytest.raises(ConfigCompositionException):
        _compose(["model.d_model=wide"])
    with pytest.raises(ConfigCompositionException):
        _compose(["sampling.top_p=abc"])
    with pytest.raises(ConfigCompositionException):
        _compose(["model.no_such_field=1"])
    assert _compose(["model=mamba2-2.7b", "model.max_seq_len=8192"]).model.max_seq_len == 8192


def test_profile_overrides_merge_and_command_line_wins():
    base = ["experiment=throughput_ar", "profile=cpu", "+profile_overrides.cpu.batch=[7]"]
    cfg, _ = prepare(_compose(base))
    assert list(cfg.bench.batch) == [7]  # the profile's value replaces the experiment's
    cfg, _ = prepare(_compose([*base, "bench.batch=[3]"]), cli_overrides=["bench.batch=[3]"])
    assert list(cfg.bench.batch) == [3]  # what the user typed wins over the profile


def test_auto_values_resolve_for_this_machine():
    cfg, _ = prepare(_compose(["experiment=throughput_ar"]))
    gpu = C.cuda_available()
    assert cfg.profile == ("gpu" if gpu else "cpu") and cfg.device == ("cuda" if gpu else "cpu")
    assert cfg.dtype == ("bfloat16" if gpu else "float32")
    assert Path(CONF_DIR / "hydra" / "default.yaml").is_file()


def test_gpu_only_profiles_say_so_in_list(cli, monkeypatch):
    """An experiment that `make reproduce` runs on the gpu profile only declares what it needs, and `list`
    shows it (ssd_kernel_blockt: a GPU, or Triton's interpreter)."""
    from ssmspec.registry import experiments

    for exp in experiments():
        if exp.profiles == ("gpu",):
            assert exp.needs_gpu, f"{exp.id} runs on the gpu profile only: declare needs_gpu (true or triton)"
    status, out, _ = cli("list")
    line = next(x for x in out.splitlines() if x.startswith("ssd_kernel_blockt "))
    assert status == 0 and line.split()[2] == "yes*" and "TRITON_INTERPRET=1" in out.splitlines()[-1]
    if not C.cuda_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        status, _, err = cli("run", "experiment=ssd_kernel_blockt")
        assert status == 2 and "needs a CUDA GPU" in err and "TRITON_INTERPRET=1" in err
