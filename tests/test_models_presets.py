"""Presets (conf/model/*.yaml) against the published sizes of shared/MODELS.md: derived widths, parameter
counts, and the model each builds (on the meta device: nothing is allocated)."""
import pytest
import torch

from ssmspec.models import HybridLM, load_preset, preset_names


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# shared/MODELS.md 3a/3b [D] columns: (I, heads, conv_dim, in_proj out)
DERIVED = {
    "mamba2-130m": (1536, 24, 1792, 3352), "mamba2-370m": (2048, 32, 2304, 4384),
    "mamba2-780m": (3072, 48, 3328, 6448), "mamba2-1.3b": (4096, 64, 4352, 8512),
    "mamba2-2.7b": (5120, 80, 5376, 10576),
    "nemotron-h-4b": (7168, 112, 9216, 16496), "nemotron-h-8b": (8192, 128, 10240, 18560),
}
# published parameter counts (model names), within 5 %
PUBLISHED = {"mamba2-130m": 130e6, "mamba2-370m": 370e6, "mamba2-780m": 780e6, "mamba2-1.3b": 1.3e9,
             "mamba2-2.7b": 2.7e9, "nemotron-h-8b": 8.1e9}
# per-type block counts of the published patterns
BLOCKS = {"nemotron-h-4b": (24, 4, 24), "nemotron-h-8b": (24, 4, 24)}


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_widths(name):
    cfg = load_preset(name)
    assert (cfg.d_inner, cfg.ssm_heads, cfg.conv_dim, cfg.in_proj_dim) == DERIVED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_model_names(name):
    assert load_preset(name).num_parameters() == pytest.approx(PUBLISHED[name], rel=0.05)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_nemotron_patterns(name):
    p = load_preset(name).pattern
    assert (p.count("M"), p.count("*"), p.count("-")) == BLOCKS[name] and len(p) == 52
    assert load_preset(name).attention_layers == [7, 18, 29, 40]


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_with_the_parameters_it_declares(name):
    cfg = load_preset(name)
    with torch.device("meta"):
        model = HybridLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()  # tied weights counted once
    if cfg.mamba_layers:
        mixer = model.layers[cfg.mamba_layers[0]].mixer
        assert mixer.in_proj.weight.shape == (cfg.in_proj_dim, cfg.d_model)
        assert mixer.conv1d.weight.shape == (cfg.conv_dim, 1, cfg.conv_kernel)
    if cfg.gdn_layers:
        mixer = model.layers[cfg.gdn_layers[0]].mixer
        assert mixer.in_proj_qkv.weight.shape == (cfg.gdn_conv_dim, cfg.d_model)
        assert mixer.conv1d.weight.shape == (cfg.gdn_conv_dim, 1, cfg.conv_kernel)
    if cfg.is_hybrid:  # a KV cache of max_seq_len slots per sequence stays affordable (< 1 GiB in bf16)
        kv = 2 * len(cfg.attention_layers) * cfg.n_kv_heads * cfg.attn_head_dim * cfg.max_seq_len * 2
        assert kv < 2**30


# shared/MODELS.md 3c / 3d: (layers, GDN layers, attention layers, GDN conv_dim, state per layer (H, N, P))
QWEN = {"qwen3-next-80b-a3b": (48, 36, 12, 8192, (32, 128, 128)), "qwen3.5-4b": (32, 24, 8, 8192, (32, 128, 128)),
        "qwen3.5-9b": (32, 24, 8, 8192, (32, 128, 128)), "qwen3.5-0.8b": (24, 18, 6, 8192, (32, 128, 128))}
QWEN_PARAMS = {"qwen3-next-80b-a3b": 80e9, "qwen3.5-4b": 4e9, "qwen3.5-9b": 9e9}


@pytest.mark.parametrize("name", sorted(QWEN))
def test_qwen_layouts(name):
    """Decoder layer i is full attention iff (i + 1) % 4 == 0 (full_attention_interval 4); every layer is a
    token mixer block then an MLP / MoE block."""
    cfg = load_preset(name)
    layers, n_gdn, n_attn, conv_dim, state = QWEN[name]
    mixers = cfg.pattern[0::2]
    assert len(mixers) == layers and mixers.count("G") == n_gdn and mixers.count("*") == n_attn
    assert [i for i, c in enumerate(mixers) if c == "*"] == [i for i in range(layers) if (i + 1) % 4 == 0]
    assert set(cfg.pattern[1::2]) == ({"E"} if cfg.family == "qwen3_next" else {"-"})
    assert cfg.gdn_conv_dim == conv_dim and (cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim) == state
    assert cfg.attn_output_gate and cfg.attn_qk_norm and cfg.rope_dim == cfg.attn_head_dim // 4


@pytest.mark.parametrize("name", sorted(QWEN_PARAMS))
def test_qwen_parameter_counts(name):
    """Within 10 % of the size in the name (the names round: the 4B text model counts 4.2e9 here)."""
    assert load_preset(name).num_parameters() == pytest.approx(QWEN_PARAMS[name], rel=0.10)


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-qwen3.5"])
def test_random_weights_are_allocated_in_the_run_dtype_and_equal_an_fp32_build_cast(name):
    """build_model allocates in the run's dtype (a 23B bf16 model must not pass through fp32's 89 GB) and draws
    the same weights as an fp32 build rounded to it."""
    from ssmspec.models import build_model

    cfg = load_preset(name)
    half = build_model(cfg, seed=5, dtype=torch.bfloat16)
    full = build_model(cfg, seed=5, dtype=torch.float32).to(torch.bfloat16)
    a, b = half.state_dict(), full.state_dict()
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
