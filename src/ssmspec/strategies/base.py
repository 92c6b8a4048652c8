"""The Strategy protocol: how the SSM state of every Mamba-2 mixer is kept during (speculative) decoding.

Mixer kinds: Mamba-2 mixers (``models/layers.py``) hand ``MambaParams`` + ``MixerInputs`` to ``prefill`` /
``mix``; Gated DeltaNet mixers (Qwen3-Next / Qwen3.5, ``models/gdn.py``) hand ``GDNParams`` + ``GDNInputs`` (the
model defines these four types; this module re-exports them) to ``prefill_gdn`` /
``mix_gdn``; ``run_mixer`` dispatches on the params' kind. Each kind has its own state tensors
(``conv_state`` / ``ssm_state`` and ``gdn_conv_state`` / ``gdn_state``, allocated by ``allocate_gdn``);
``commit`` moves both. A strategy that keeps no GDN state refuses a GDN model at ``allocate``.
Every registered strategy keeps GDN state. Token trees on GDN layers: ``stree`` and ``replay`` verify them
with the tree-masked WY solve (``ops.gdn.gdn_tree_scan``, PyTorch: STree's Triton tree scan is the
diagonal-decay SSD form, which the delta rule is not; replay's GDN Triton verify takes a causal window);
snapshot, activation_replay and joint_attainment verify chains only, for GDN as for Mamba-2 (a serial scan
per row cannot verify a tree in one row).

One decode step (DESIGN.md section 3): the drafter proposes a ``DraftTree`` hanging under the pending
token; ``Strategy.layout`` turns it into ``StepInputs`` (model rows, positions, tree mask, where each
tree node's logits come from); the model runs, and every Mamba-2 mixer hands its projected inputs to
``Strategy.mix``; the verifier returns a ``Verdict``; ``Strategy.commit`` moves the state to the last
accepted token on the device (no host sync). Attention layers keep a ``KVCache`` that follows the same
``StepInputs`` and commits the accepted path too.

Adding a strategy is adding a file that subclasses ``StrategyBase``, decorates it with
``@register_strategy("name")`` and a ``conf/strategy/<name>.yaml``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.gdn import GDNInputs, GDNParams  # re-exported: the types a GDN mixer hands over
from ssmspec.models.layers import MambaParams, MixerInputs  # re-exported: the types a Mamba-2 mixer hands over
from ssmspec.ops.causal_conv1d import causal_conv1d
from ssmspec.ops.gdn import gdn_chunk_scan
from ssmspec.ops.ssd import ssd_chunk_scan


@dataclass(frozen=True)
class SpecConfig:
    """Shape of the speculation every step: fixed, so all buffers are allocated once."""

    draft_len: int = 0  # S: draft tokens per chain (depth of a tree); 0 = standard decoding
    num_drafts: int = 1  # D: independent chains per sequence (trees: leave 1)
    tree_size: int = 0  # T: nodes of a token tree (0: chains, T = D * S)
    buffer_size: int = 16  # R: ring-buffer capacity of the `replay` strategy

    @property
    def nodes(self) -> int:
        """Draft nodes per sequence and step (excluding the pending token)."""
        return self.tree_size if self.tree_size else self.num_drafts * self.draft_len


@dataclass
class StepInputs:
    """The model input of one call, as a strategy laid it out.

    Rows B' may exceed the batch B (several chains per sequence, joint attainment's extra rows); every
    row belongs to one sequence (``seq_index``). Node n of a sequence's draft tree (node 0 = the pending
    token) is fed at (``node_row[b, n]``, ``node_col[b, n]``); its logits are read there.
    """

    input_ids: Tensor  # (B', L) int64
    positions: Tensor  # (B', L) int64 token positions in their sequence (RoPE)
    valid: Tensor | None = None  # (B', L) bool; False: pad / no-op token (state untouched, not attended)
    seq_index: Tensor | None = None  # (B',) sequence of each row; None: row b is sequence b
    tree_mask: Tensor | None = None  # (B', L, L) bool, [i, j]: token i sees token j; None: causal
    node_row: Tensor | None = None  # (B, 1+T) model row of each tree node; None: row b
    node_col: Tensor | None = None  # (B, 1+T) column of each tree node; None: column n
    prefill: bool = False  # a prompt pass (sets the initial states)
    kv_bound: int = 0  # host-known upper bound on committed KV slots (0: the whole cache); no sync needed
    kv_hide: Tensor | None = None  # (B',) newest committed KV slots a row does not see (it re-runs them)
    # slot-addressed calls (a draft model's steps, engine/draft.py; strategies with slot_states): row r starts
    # from the state in slot src_slot[r] and stores the state after its token t in slot dst_slot[r, t]; with
    # ``valid`` (right padding) and on prefill, the state after its last valid token in slot dst_slot[r, 0]
    src_slot: Tensor | None = None  # (B',) int64; None on prefill (zero state)
    dst_slot: Tensor | None = None  # (B', L) int64, or (B', 1) with valid / on prefill
    extras: dict = dataclasses.field(default_factory=dict)  # strategy-private per-step tensors

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def gather_nodes(self, logits: Tensor) -> Tensor:
        """(B', L, ...) per call position (logits (B', L, V), their argmax (B', L), hidden states) -> (B, 1+T, ...)
        per tree node."""
        if self.node_row is None and self.node_col is None:
            return logits
        Bp, L = logits.shape[:2]
        flat = self.node_row * L + self.node_col  # (B, 1+T)
        return logits.reshape(Bp * L, *logits.shape[2:])[flat]


class StrategyBase:
    """Shared machinery: per-layer conv and SSM state, prefill, the default one-row-per-sequence layout.

    Subclasses implement ``mix`` (and ``commit`` when they speculate) and may override ``allocate``,
    ``layout`` and ``cache_bytes``. Tensors that persist across steps are created in ``allocate`` with
    fixed shapes so a step can be captured in a CUDA graph.
    """

    name: ClassVar[str] = "base"
    supports_trees: ClassVar[bool] = False  # can verify a token tree (not only chains)
    speculative: ClassVar[bool] = True  # takes drafts; False for autoregressive
    # keeps states in addressable slots (``allocate_slots``, StepInputs.src_slot / dst_slot): a draft engine keeps
    # each sequence's committed state apart from the rows it drafts in, so only such strategies can keep a draft's
    slot_states: ClassVar[bool] = False

    def __init__(self, **options) -> None:
        if options:
            raise ValueError(f"strategy {self.name!r} takes no options {sorted(options)}")
        self.cfg: ModelConfig | None = None
        self.spec = SpecConfig()
        self.batch = 0
        self.conv_state: Tensor | None = None  # (n_mamba, B, conv_dim, W-1)
        self.ssm_state: Tensor | None = None  # (n_mamba, B, H, P, N) fp32
        self.gdn_conv_state: Tensor | None = None  # (n_gdn, B, gdn_conv_dim, W-1)
        self.gdn_state: Tensor | None = None  # (n_gdn, rows, H, N, P) fp32 (k-major, as ops/gdn)

    # allocation ------------------------------------------------------------------------
    def check_spec(self, spec: SpecConfig) -> None:
        if spec.draft_len and not self.speculative:
            raise ValueError(f"strategy {self.name!r} does not speculate: use drafter=none (draft_len 0), "
                             f"or a speculative strategy such as snapshot or replay")
        if spec.tree_size and not self.supports_trees:
            raise ValueError(f"strategy {self.name!r} verifies chains only; use a chain drafter or a "
                             f"tree strategy (stree)")

    def allocate(self, cfg: ModelConfig, batch: int, spec: SpecConfig, device, dtype) -> None:
        self.check_spec(spec)
        self.cfg, self.batch, self.spec = cfg, batch, spec
        n = len(cfg.mamba_layers)
        self.conv_state = torch.zeros(n, batch, cfg.conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype)
        self.ssm_state = torch.zeros(n, batch, cfg.ssm_heads, cfg.head_dim, cfg.state_size, device=device,
                                     dtype=torch.float32)
        self.allocate_gdn(cfg, batch, device, dtype)

    keeps_gdn: ClassVar[bool] = True  # has a GDN form (False: a GDN model is refused at allocate)

    def allocate_gdn(self, cfg: ModelConfig, batch: int, device, dtype, *, state_rows: int | None = None) -> None:
        """The GDN mixers' committed conv state (n_gdn, B, conv_dim, W-1) and delta-rule state (n_gdn, rows, H,
        N, P) fp32 (``state_rows`` default B); nothing when the model has no G blocks."""
        n = len(cfg.gdn_layers)
        if not n:
            self.gdn_conv_state = self.gdn_state = None
            return
        if not self.keeps_gdn:
            raise ValueError(f"strategy {self.name!r} keeps no Gated DeltaNet state (model {cfg.name!r} has G "
                             f"blocks); use autoregressive, snapshot, activation_replay, joint_attainment, replay "
                             f"or stree")
        self.gdn_conv_state = torch.zeros(n, batch, cfg.gdn_conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype)
        self.gdn_state = torch.zeros(n, state_rows or batch, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                                     device=device, dtype=torch.float32)

    def max_rows(self, batch: int, spec: SpecConfig) -> int:
        """Most model rows one call of this strategy uses (KV scratch is sized by it)."""
        return batch

    def max_call_len(self, spec: SpecConfig) -> int:
        """Most tokens per row in one decode call."""
        return 1 + spec.nodes

    def cache_bytes(self) -> int:
        """Bytes of every tensor this strategy allocated (for memory and concurrency figures)."""
        return sum(t.numel() * t.element_size() for t in self._owned_tensors())

    def _owned_tensors(self) -> list[Tensor]:
        return [t for t in vars(self).values() if isinstance(t, Tensor)]

    def allocate_slots(self, cfg: ModelConfig, slots: int, device, dtype) -> None:
        """State slots for slot-addressed calls (a draft model's state, engine/draft.py): ``slots`` conv and SSM
        (and GDN) states per mixer, zero. Strategies that keep one state per window cannot (``slot_states``)."""
        raise ValueError(f"strategy {self.name!r} keeps no addressable state slots, so it cannot keep a draft "
                         f"model's state; use snapshot")

    # prefill -----------------------------------------------------------------------------
    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Prompt pass: conv and chunked scan from zero state; keeps the final states. (B, L, I) output."""
        y, conv_state, ssm_state = run_prefill(p, inp, step, chunk_size=self.cfg.chunk_size)
        self.conv_state[p.index].copy_(conv_state)
        self.ssm_state[p.index].copy_(ssm_state)
        return y

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """Prompt pass of a GDN mixer: conv and the chunked WY scan from zero state; keeps the final states in
        ``gdn_conv_state`` / ``gdn_state`` row b. Returns y (B, L, H, P)."""
        y, conv, st = run_prefill_gdn(p, inp, step)
        self.gdn_conv_state[p.index].copy_(conv)
        self.gdn_state[p.index, :st.shape[0]].copy_(st)
        return y

    def run_mixer(self, p, inp, step: StepInputs) -> Tensor:
        """Dispatch a mixer's call on its kind: Mamba-2 -> ``prefill`` / ``mix``, GDN -> ``prefill_gdn`` /
        ``mix_gdn``."""
        if getattr(p, "kind", "mamba") == "gdn":
            return self.prefill_gdn(p, inp, step) if step.prefill else self.mix_gdn(p, inp, step)
        return self.prefill(p, inp, step) if step.prefill else self.mix(p, inp, step)

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        raise ValueError(f"strategy {self.name!r} keeps no Gated DeltaNet state; use autoregressive, snapshot, "
                         f"activation_replay, joint_attainment, replay or stree")

    # one decode step ----------------------------------------------------------------------
    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        """Default layout: one row per sequence, [pending, draft nodes...], positions seq_len + depth,
        tree mask when the drafts are not one chain."""
        if drafts is None:
            return StepInputs(input_ids=pending[:, None], positions=seq_len[:, None])
        tokens = torch.cat([pending[:, None], drafts.tokens], dim=1)  # (B, 1+T)
        positions = seq_len[:, None] + drafts.depths_with_root()
        mask = None if drafts.is_single_chain else drafts.ancestor_mask()
        return StepInputs(input_ids=tokens, positions=positions, tree_mask=mask)

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        raise NotImplementedError

    def commit(self, verdict, step: StepInputs) -> None:
        """Move every layer's state to the last accepted token (device-side)."""

    def after_step(self) -> None:
        """Work the host launches after every step, outside any captured graph (the engine calls it); none by
        default. joint_attainment's eager state copy (jit_copy=False, seed 001 Table 2) is its one user."""


def run_prefill(p: MambaParams, inp: MixerInputs, step: StepInputs, *, chunk_size: int,
                conv_state: Tensor | None = None, ssm_state: Tensor | None = None):
    """Conv + chunked SSD scan of a whole prompt (left padding masked). Returns y (B, L, I),
    the conv state (B, conv_dim, W-1) and the SSM state (B, H, P, N)."""
    xbc = inp.xbc
    if step.valid is not None:
        xbc = xbc * step.valid[..., None].to(xbc.dtype)  # pads feed zeros, as the empty history does
    xbc_conv, new_conv = causal_conv1d(xbc, p.conv_weight, p.conv_bias, state=conv_state, activation=p.activation)
    x, B, C = p.split_xbc(xbc_conv)
    dt = p.discretize(inp.dt, step.valid)
    y, new_ssm = ssd_chunk_scan(x, dt, p.A, B, C, p.D, chunk_size=chunk_size, initial_state=ssm_state)
    return y.reshape(*y.shape[:2], -1).to(inp.xbc.dtype), new_conv, new_ssm


def run_prefill_gdn(p: GDNParams, inp: GDNInputs, step: StepInputs, *, conv_state: Tensor | None = None,
                    state: Tensor | None = None):
    """Conv + chunked WY scan of a whole prompt through a GDN mixer (left padding: zeros into the conv, g = beta
    = 0 in the scan). Returns y (B, L, H, P), the conv state (B, conv_dim, W-1) and the state (B, H, N, P) fp32."""
    qkv = inp.qkv
    if step.valid is not None:
        qkv = qkv * step.valid[..., None].to(qkv.dtype)
    post, new_conv = causal_conv1d(qkv, p.conv_weight, None, state=conv_state, activation=p.activation)
    q, k, v = p.split(post)
    g, beta = p.gates(inp.a, inp.b, step.valid)
    y, st = gdn_chunk_scan(q, k, v, g, beta, chunk_size=p.chunk_size, initial_state=state)
    return y, new_conv, st


_REGISTRY: dict[str, type[StrategyBase]] = {}


def register_strategy(name: str):
    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_strategy(name: str, **options) -> StrategyBase:
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(strategy_names())}")
    return _REGISTRY[name](**options)
