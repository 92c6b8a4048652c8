"""What a user types is honoured or refused: range checks of every config, the experiment's declarations
(bench keys, experiment.reads), model=<preset> against bench.presets, and Hydra's inspection flags."""
from __future__ import annotations

import pytest
import yaml
from hydra import compose, initialize_config_dir

from ssmspec import config as C
from ssmspec import paths
from ssmspec.registry import _read
from ssmspec.runner import UserError, check_overrides, prepare


def _compose(overrides: list[str]):
    C.register_configs()
    with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    pytest.param(["model.n_groups=0"], "model.n_groups must be >= 1, got 0", id="model-divide-by-zero"),
    pytest.param(["model.d_model=-4"], "model.d_model must be >= 1", id="model-negative"),
    pytest.param(["model.norm_eps=0.0"], "model.norm_eps must be > 0", id="model-eps"),
    pytest.param(["model.pad_token_id=-1"], "model.pad_token_id must be >= 0", id="model-token-id"),
    pytest.param(["model.dt_max_limit=0.0"], "dt_max_limit must be above dt_min_limit", id="model-dt-limits"),
    pytest.param(["sampling.temperature=-1"], "temperature must be >= 0", id="sampling-temperature"),
    pytest.param(["sampling.top_p=1.5"], "top_p must be in (0, 1]", id="sampling-top-p"),
    pytest.param(["sampling.top_k=-2"], "top_k must be >= 0", id="sampling-top-k"),
    pytest.param(["data=humaneval", "data.num_prompts=0"], "data.num_prompts must be >= 1", id="data-num-prompts"),
    pytest.param(["data=mtbench", "data.turn=3"], "data.turn must be 1 or 2", id="data-turn"),
    pytest.param(["data.prompt_len=ten"], "data.prompt_len must be an integer", id="data-type"),
    pytest.param(["bench.iters=0"], "bench.iters must be >= 1", id="bench-iters"),
    pytest.param(["bench.warmup=-1"], "bench.warmup must be a finite number >= 0", id="bench-warmup"),
    pytest.param(["bench.cpu_threads=0"], "bench.cpu_threads must be >= 1", id="bench-threads"),
    pytest.param(["seed=-3"], "seed must be >= 0", id="seed"),
])
def test_every_number_is_checked(overrides, message):
    cfg = _compose(overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        C.check_values(cfg)


def test_defaults_and_every_experiment_pass_the_checks():
    C.check_values(_compose([]))
    for path in sorted((paths.CONF_DIR / "experiment").glob("*.yaml")):
        C.check_values(_compose([f"experiment={path.stem}"]))


def test_model_preset_replaces_the_experiment_presets():
    ov = ["experiment=throughput_ar", "profile=cpu", "+profile_overrides.cpu.presets=[tiny-mamba2]", "model=tiny-hybrid"]
    cfg, _ = prepare(_compose(ov), cli_overrides=ov)
    assert list(cfg.bench.presets) == ["tiny-hybrid"]  # over the file's and the profile's presets
    cfg, _ = prepare(_compose(ov[:3]), cli_overrides=ov[:3])
    assert list(cfg.bench.presets) == ["tiny-mamba2"]


def _experiment(tmp_path, extra: dict):
    text = yaml.safe_load((paths.CONF_DIR / "experiment" / "throughput_ar.yaml").read_text())
    text["experiment"] = {k: v for k, v in text["experiment"].items() if k != "reads"} | {"id": "custom"}
    text["experiment"].update(extra)
    path = tmp_path / "custom.yaml"
    path.write_text("# @package _global_\n" + yaml.safe_dump(text))
    return _read(path)


def test_declarations_reads_and_bench_keys(tmp_path):
    exp = _experiment(tmp_path, {"reads": ["model", "data"], "bench_keys": ["extra"]})
    check_overrides(exp, ["data=gsm8k", "data.num_prompts=4", "+bench.extra=3", "bench.batch=[2]"])
    with pytest.raises(UserError, match="has no setting bench.other"):
        check_overrides(exp, ["+bench.other=1"])
    with pytest.raises(UserError, match="does not read strategy="):
        check_overrides(exp, ["strategy=replay"])
    with pytest.raises(UserError, match="model.d_model changes nothing"):  # presets are still swept
        check_overrides(exp, ["model.d_model=32"])
    nested = _experiment(tmp_path, {"reads": []})
    with pytest.raises(UserError, match="bench.max_prefill_tokens must be an int"):
        check_overrides(nested, ["bench.max_prefill_tokens=lots"])


def test_missing_reads_is_permissive_and_bad_reads_refused(tmp_path):
    exp = _experiment(tmp_path, {})
    assert exp.reads is None
    check_overrides(exp, ["data=gsm8k", "drafter=png", "sampling.temperature=0.5"])
    with pytest.raises(UserError, match="has no setting bench.nope"):  # bench keys are declared by the file
        check_overrides(exp, ["+bench.nope=1"])
    with pytest.raises(ValueError, match="experiment.reads lists settings"):
        _experiment(tmp_path, {"reads": ["bench", "nonsense"]})


def test_cfg_job_shows_the_grid_that_runs(cli):
    status, out, err = cli("run", "experiment=throughput_ar", "profile=cpu", "+profile_overrides.cpu.batch=[7]",
                           "model=tiny-hybrid", "--cfg", "job")
    assert status == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["bench"]["batch"] == [7] and cfg["bench"]["presets"] == ["tiny-hybrid"]
    assert (cfg["profile"], cfg["device"], cfg["dtype"]) == ("cpu", "cpu", "float32")


def test_info_once_and_hydra_help_with_an_experiment(cli):
    status, out, err = cli("run", "experiment=throughput_ar", "--info", "plugins")
    assert status == 0, err
    assert out.count("Installed Hydra Plugins") == 1 and "GpuQueueLauncher" in out
    status, out, err = cli("run", "experiment=throughput_ar", "--hydra-help")
    assert status == 0 and "Hydra" in out and "Traceback" not in err


def test_sampling_presets_outside_the_chosen_ones_are_refused(cli):
    status, _, err = cli("run", "experiment=lossless", "profile=cpu", "bench.presets=[tiny-mamba2]")
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: lossless: bench.sampling.presets")
    assert "bench.sampling.presets=[tiny-mamba2]" in err and "Traceback" not in err
