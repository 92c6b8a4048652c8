"""``cache_bytes`` is what a strategy really allocated, and the sizes follow each method: snapshot keeps
1 + S full states, replay one state plus R small input vectors, activation_replay one state plus the last
call's activations, joint_attainment D + 1 states (seed 001: "N + 1 copies")."""
import gc
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig, make_strategy, strategy_names

SPECS = {"S0": SpecConfig(), "S3": SpecConfig(draft_len=3), "2xS3": SpecConfig(draft_len=3, num_drafts=2),
         "tree8": SpecConfig(draft_len=3, tree_size=8)}


def _reachable_tensors(obj) -> list[torch.Tensor]:
    out, todo = [], list(vars(obj).values())
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
    return out


class _Factories(TorchFunctionMode):
    """Weak references to every tensor a torch function returns while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out


def _storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr()


def _takes(name: str, spec: SpecConfig) -> bool:
    try:
        make_strategy(name).check_spec(spec)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name, spec_id", [pytest.param(n, k, id=f"{n}-{k}") for n in strategy_names()
                                           for k, sp in SPECS.items() if _takes(n, sp)])
def test_cache_bytes_is_what_was_allocated(name, spec_id):
    """Every tensor created in ``allocate`` that is still alive is held by the strategy, and cache_bytes is
    the byte size of their distinct storages (views are not counted twice, nothing is left out)."""
    spec = SPECS[spec_id]
    s = make_strategy(name)
    cfg = load_preset("tiny-hybrid")
    with _Factories() as mode:
        s.allocate(cfg, 3, spec, "cpu", torch.float32)
    gc.collect()
    held = {_storage_key(t): t.untyped_storage().nbytes() for t in _reachable_tensors(s)}
    alive = [r() for r in mode.made if r() is not None]
    assert {_storage_key(t) for t in alive if t.numel()} <= set(held), "allocated tensors the strategy does not hold"
    assert s.cache_bytes() == sum(held.values())


def _one_state(cfg, batch) -> int:
    return len(cfg.mamba_layers) * batch * cfg.ssm_heads * cfg.head_dim * cfg.state_size * 4  # fp32


def _conv_state(cfg, batch, elt) -> int:
    return len(cfg.mamba_layers) * batch * cfg.conv_dim * (cfg.conv_kernel - 1) * elt


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("S", [1, 4])
def test_exact_sizes_of_chain_strategies(S, D):
    """Byte-exact accounting on the tiny hybrid (float64 activations, fp32 states)."""
    cfg, bsz, elt = load_preset("tiny-hybrid"), 3, 8
    n, L, C = len(cfg.mamba_layers), 1 + S, cfg.conv_dim
    H, P, G, N = cfg.ssm_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
    spec = SpecConfig(draft_len=S, num_drafts=D)
    one, conv = _one_state(cfg, bsz), _conv_state(cfg, bsz, elt)
    sizes = {}
    for name in ("autoregressive", "snapshot", "activation_replay", "joint_attainment"):
        s = make_strategy(name)
        s.allocate(cfg, bsz, spec if s.speculative else SpecConfig(), "cpu", torch.float64)
        sizes[name] = s.cache_bytes()
    regions = 1 if D == 1 else D + 1  # snapshot: D > 1 chains need a region no row is reading
    assert sizes["autoregressive"] == one + conv
    assert sizes["snapshot"] == regions * L * one + conv + n * bsz * D * L * C * elt + 2 * bsz * 8
    assert sizes["activation_replay"] == one + conv + n * bsz * D * L * (C + H * P + G * N + H) * elt + 2 * bsz * 8
    assert sizes["joint_attainment"] == (D + 1) * one + conv + bsz * L * 8 + bsz * 8


def test_paper_size_ratios_meta():
    """mamba2-2.7b, batch 8, S = 4, bf16 activations, on the meta device (nothing allocated): the ratios to
    one state per sequence and layer that each method's description gives."""
    cfg, bsz, S, R = load_preset("mamba2-2.7b"), 8, 4, 16
    spec = SpecConfig(draft_len=S, buffer_size=R)
    one = _one_state(cfg, bsz)

    def size(name, sp=spec):
        s = make_strategy(name)
        s.allocate(cfg, bsz, sp, "meta", torch.bfloat16)
        return s.cache_bytes()

    ar = size("autoregressive", SpecConfig())
    assert 1.0 < ar / one < 1.02  # one state + a small conv state
    assert (1 + S) < size("snapshot") / one < (1 + S) * 1.02  # 1 + S full states
    arp, ja = size("activation_replay"), size("joint_attainment")
    assert 1.0 < arp / one < 1.1  # one state + activations of 1 + S tokens
    assert 2.0 < ja / one < 2.02  # D + 1 = 2 states
    assert arp < ja  # seed 001 Sec. 3.1: ARP needs less memory than joint attainment
    if "replay" in strategy_names():
        small = len(cfg.mamba_layers) * bsz * R * (cfg.ssm_heads * cfg.head_dim * 2 + cfg.ssm_heads * 4
                                                   + cfg.n_groups * cfg.state_size * 2)
        rep = size("replay")
        assert one + small < rep < 1.1 * one + small  # one state + R small (x, dt, B) vectors
