"""`snapshot`: the baseline vLLM and SGLang ship (seed 000, Alg. 3): one full state snapshot per draft
position, serial update, and the next step starts from the snapshot of the last accepted token.

Per sequence and layer a pool of state slots; one call of L = 1 + S tokens ([pending, chain]) loads the
start state from slot ``src`` once, runs the tokens serially and stores the state after token t into its
own slot (``ssm_multistep_snapshot``). Commit only moves ``src`` to the slot of the last accepted token
(device-side, no copy): rollback is choosing which snapshot to read next.

Slots: with one chain, 1 + S per sequence and the call's destination slots include the source slot, which
the fused op reads before it stores (vLLM's layout). With D > 1 chains (one row per chain, seed 001
Sec. 5.3) all D rows read the same source while each stores its own snapshots, so the pool holds D + 1
regions of 1 + S slots and row d stores into region (src region + 1 + d) mod (D + 1): no row ever
overwrites the state another row is still reading, in any kernel schedule.

The conv state is rolled back at commit over the accepted row's cached pre-conv inputs
(``conv_state_advance``); the conv itself runs over [conv state, call tokens] without updating the state.

Gated DeltaNet mixers keep the same pool layout and pointers with (H, N, P) delta-rule states
(``ops.gdn.gdn_multistep_snapshot``, seed 000 Alg. 7); one ``src`` serves both kinds.

Slot-addressed calls (``allocate_slots``; a draft model's state, ``engine/draft.py``): the pool is a flat
array of slots the caller addresses through ``StepInputs.src_slot`` / ``dst_slot``; every slot holds the
conv window as well as the SSM (or GDN) state. A row starts from any slot and stores the state after each
token (or, in a right-padded call with ``valid``, the state after its last valid token: the pads run through
the fused ops unmasked, but only the row's last valid token has a store slot, so no per-layer masking is
needed) in slots of the caller's choice -- its own source slot included, as the fused ops read every start
state before they store.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_update_slots, conv_state_advance
from ssmspec.ops.gdn import gdn_multistep_snapshot
from ssmspec.ops.multistep import ssm_multistep_snapshot
from ssmspec.strategies._chain_rows import accepted_chain, layout_chain_rows
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy, run_prefill, run_prefill_gdn)


@register_strategy("snapshot")
class Snapshot(StrategyBase):
    """One state snapshot per draft position (module doc)."""

    @staticmethod
    def regions(spec: SpecConfig) -> int:
        """Regions of 1 + S slots per sequence: 1 for one chain, D + 1 for D > 1 chains (module doc)."""
        return 1 if spec.num_drafts == 1 else spec.num_drafts + 1

    def allocate(self, cfg, batch: int, spec: SpecConfig, device, dtype) -> None:
        self.check_spec(spec)
        self.cfg, self.batch, self.spec = cfg, batch, spec
        n, L, D, Rg = len(cfg.mamba_layers), 1 + spec.draft_len, spec.num_drafts, self.regions(spec)
        self.conv_state = torch.zeros(n, batch, cfg.conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype)
        self.ssm_state = None  # the states live in the snapshot pool
        # (n, B * regions * (1+S), H, P, N) fp32; slot (b*Rg + r)*(1+S) + t = state after token t of region r
        self.snapshots = torch.zeros(n, batch * Rg * L, cfg.ssm_heads, cfg.head_dim, cfg.state_size,
                                     device=device, dtype=torch.float32)
        self.src = torch.zeros(batch, device=device, dtype=torch.long)  # (B,) slot of each start state
        self.src_region = torch.zeros(batch, device=device, dtype=torch.long)  # (B,) region holding it
        self.conv_in = torch.zeros(n, batch * D, L, cfg.conv_dim, device=device, dtype=dtype)  # call's pre-conv xBC
        self.allocate_gdn(cfg, batch, device, dtype)
        self.gdn_snapshots = self.gdn_conv_in = None
        if self.gdn_state is not None:  # GDN mixers: the same slots, (H, N, P) states
            ng, self.gdn_state = self.gdn_state.shape[0], None
            self.gdn_snapshots = torch.zeros(ng, batch * Rg * L, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                                             device=device, dtype=torch.float32)
            self.gdn_conv_in = torch.zeros(ng, batch * D, L, cfg.gdn_conv_dim, device=device, dtype=dtype)

    slot_states = True

    def allocate_slots(self, cfg, slots: int, device, dtype) -> None:
        """``slots`` (conv window, state) pairs per mixer, zero; calls then read and write them through
        ``StepInputs.src_slot`` / ``dst_slot`` (module doc)."""
        self.cfg, self.batch, self.spec = cfg, 0, SpecConfig()
        n, ng, W1 = len(cfg.mamba_layers), len(cfg.gdn_layers), cfg.conv_kernel - 1
        self.conv_state = self.ssm_state = self.gdn_conv_state = self.gdn_state = None
        self.conv_in = self.gdn_conv_in = None
        self.conv_slots = torch.zeros(n, slots, cfg.conv_dim, W1, device=device, dtype=dtype)
        self.snapshots = torch.zeros(n, slots, cfg.ssm_heads, cfg.head_dim, cfg.state_size, device=device,
                                     dtype=torch.float32)
        self.gdn_conv_slots = self.gdn_snapshots = None
        if ng:
            self.gdn_conv_slots = torch.zeros(ng, slots, cfg.gdn_conv_dim, W1, device=device, dtype=dtype)
            self.gdn_snapshots = torch.zeros(ng, slots, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                                             device=device, dtype=torch.float32)

    @staticmethod
    def _slot_conv(pool: Tensor, x: Tensor, p, step: StepInputs) -> Tensor:
        """Conv of a slot-addressed call: x (B', L, C) pre-conv over the window in slot src_slot[r] of pool
        (slots, C, W-1). Unmasked, the window after token t goes to slot dst_slot[r, t]; masked (``valid``,
        right padding), the window after the row's last valid token goes to slot dst_slot[r, 0]. Returns the
        conv output (B', L, C)."""
        masked = step.valid is not None
        keep = Snapshot._per_call(step)[0] if masked else None
        early = None
        if not masked and x.shape[1] > 1:  # windows after the earlier tokens, read before the call stores
            state = pool[step.src_slot]  # (B', C, W-1)
            full = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # (B', C, W-1+L)
            early = [full[..., t + 1:t + 1 + state.shape[-1]] for t in range(x.shape[1] - 1)]
        y = causal_conv1d_update_slots(x, pool, p.conv_weight, p.conv_bias, src_slot=step.src_slot,
                                       dst_slot=step.dst_slot[:, 0 if masked else -1], keep=keep,
                                       activation=p.activation)
        for t, window in enumerate(early or []):
            pool.index_copy_(0, step.dst_slot[:, t], window)
        return y

    @staticmethod
    def _per_call(step: StepInputs) -> tuple[Tensor, Tensor]:
        """A masked call's (valid tokens per row (B',), state slots per token (B', L): -1 (no store) but at the
        row's last valid token, whose state goes to dst_slot[r, 0]; none when the row has no valid token), made
        once per call for every mixer (``StepInputs.extras``)."""
        if "slot_keep" not in step.extras:
            keep = step.valid.sum(1)  # (B',) valid tokens first
            col = torch.arange(step.valid.shape[1], device=keep.device)[None]  # (1, L)
            step.extras["slot_keep"] = keep
            step.extras["slot_dst"] = torch.where(col == keep[:, None] - 1, step.dst_slot, -1)
        return step.extras["slot_keep"], step.extras["slot_dst"]

    def _mix_slots(self, p, inp, step: StepInputs) -> Tensor:
        """One slot-addressed call of a Mamba-2 or GDN mixer (module doc)."""
        i = p.index
        dst = step.dst_slot if step.valid is None else self._per_call(step)[1]
        if getattr(p, "kind", "mamba") == "gdn":
            qkv = self._slot_conv(self.gdn_conv_slots[i], inp.qkv, p, step)
            q, k, v = p.split(qkv)
            g, beta = p.gates(inp.a, inp.b)  # pads run too: no state after one is ever stored (_per_call)
            return gdn_multistep_snapshot(self.gdn_snapshots[i], q, k, v, g, beta, src_slot=step.src_slot,
                                          dst_slots=dst)
        xbc = self._slot_conv(self.conv_slots[i], inp.xbc, p, step)
        x, B, C = p.split_xbc(xbc)
        y = ssm_multistep_snapshot(self.snapshots[i], x, inp.dt, p.A, B, C, p.D, dt_bias=p.dt_bias, dt_softplus=True,
                                   dt_limit=p.dt_limit, src_slot=step.src_slot, dst_slots=dst)
        return y.reshape(*y.shape[:2], -1)

    def _prefill_slots(self, p, inp, step: StepInputs) -> Tensor:
        """A prompt pass from zero state whose final states go to slot dst_slot[r, 0]."""
        i, dst = p.index, step.dst_slot[:, 0]
        if getattr(p, "kind", "mamba") == "gdn":
            y, conv, st = run_prefill_gdn(p, inp, step)
            self.gdn_conv_slots[i].index_copy_(0, dst, conv.to(self.gdn_conv_slots.dtype))
            self.gdn_snapshots[i].index_copy_(0, dst, st)
            return y
        y, conv, ssm = run_prefill(p, inp, step, chunk_size=self.cfg.chunk_size)
        self.conv_slots[i].index_copy_(0, dst, conv.to(self.conv_slots.dtype))
        self.snapshots[i].index_copy_(0, dst, ssm)
        return y

    def run_mixer(self, p, inp, step: StepInputs) -> Tensor:
        if step.dst_slot is not None:
            return self._prefill_slots(p, inp, step) if step.prefill else self._mix_slots(p, inp, step)
        return super().run_mixer(p, inp, step)

    def max_rows(self, batch: int, spec: SpecConfig) -> int:
        return batch * spec.num_drafts

    def max_call_len(self, spec: SpecConfig) -> int:
        return 1 + spec.draft_len

    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        return layout_chain_rows(pending, drafts, seq_len, self.spec, self.name)

    def _home(self) -> Tensor:
        """(B,) first slot of each sequence's region 0."""
        return torch.arange(self.batch, device=self.src.device) * self.regions(self.spec) * (1 + self.spec.draft_len)

    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Prompt pass: the final state becomes the snapshot the first decode step starts from."""
        if step.dst_slot is not None:
            return self._prefill_slots(p, inp, step)
        y, conv, ssm = run_prefill(p, inp, step, chunk_size=self.cfg.chunk_size)
        self.conv_state[p.index].copy_(conv)
        self.src.copy_(self._home())
        self.src_region.zero_()
        self.snapshots[p.index].index_copy_(0, self.src, ssm)
        return y

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        y, conv, st = run_prefill_gdn(p, inp, step)
        self.gdn_conv_state[p.index].copy_(conv)
        self.src.copy_(self._home())
        self.src_region.zero_()
        self.gdn_snapshots[p.index].index_copy_(0, self.src, st)
        return y

    def _dst(self, rows: int, L: int, dev) -> tuple[Tensor, Tensor]:
        """(B',) sequence of each row and (B', L) the slots its snapshots go to."""
        Rg, Lmax = self.regions(self.spec), 1 + self.spec.draft_len
        seq = torch.arange(rows, device=dev) // (rows // self.batch)  # (B',) sequence of each row
        d = torch.arange(rows, device=dev) % (rows // self.batch)  # (B',) chain of each row
        region = (self.src_region[seq] + 1 + d) % Rg if Rg > 1 else torch.zeros_like(d)
        return seq, (seq * Rg + region)[:, None] * Lmax + torch.arange(L, device=dev)[None]

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """GDN form of ``mix``: every row from its start snapshot, one (H, N, P) store per token."""
        i, rows, L = p.index, step.rows, step.length
        if step.valid is not None or rows > self.gdn_conv_in.shape[1] or L > self.gdn_conv_in.shape[2]:
            raise ValueError(f"snapshot takes no pad tokens and at most {self.gdn_conv_in.shape[1]} rows x "
                             f"{self.gdn_conv_in.shape[2]} tokens a call; got {rows} x {L}")
        seq, dst = self._dst(rows, L, inp.qkv.device)
        qkv = causal_conv1d_update(inp.qkv, self.gdn_conv_state[i][seq], p.conv_weight, None, activation=p.activation,
                                   update_state=False, save_input=self.gdn_conv_in[i, :rows])  # inputs kept too
        q, k, v = p.split(qkv)
        g, beta = p.gates(inp.a, inp.b)
        return gdn_multistep_snapshot(self.gdn_snapshots[i], q, k, v, g, beta, src_slot=self.src[seq], dst_slots=dst)

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Serial scan of every row from its sequence's start snapshot, one store per token (Alg. 3)."""
        if step.dst_slot is not None:
            return self._mix_slots(p, inp, step)
        i, rows, L = p.index, step.rows, step.length
        Rg, Lmax = self.regions(self.spec), 1 + self.spec.draft_len
        if step.valid is not None:
            raise ValueError("snapshot does not take pad / no-op tokens in decode calls (StepInputs.valid)")
        if rows > self.conv_in.shape[1] or L > Lmax:
            raise ValueError(f"a call of {rows} rows x {L} tokens exceeds what snapshot allocated "
                             f"({self.conv_in.shape[1]} x {Lmax}); make the drafter's spec match the strategy's")
        dev = inp.xbc.device
        seq = torch.arange(rows, device=dev) // (rows // self.batch)  # (B',) sequence of each row
        xbc = causal_conv1d_update(inp.xbc, self.conv_state[i][seq], p.conv_weight, p.conv_bias, activation=p.activation,
                                   update_state=False, save_input=self.conv_in[i, :rows])  # (B', L, conv_dim)
        x, B, C = p.split_xbc(xbc)  # (B', L, H, P), (B', L, G, N) x2
        d = torch.arange(rows, device=dev) % (rows // self.batch)  # (B',) chain of each row
        region = (self.src_region[seq] + 1 + d) % Rg if Rg > 1 else torch.zeros_like(d)
        dst = (seq * Rg + region)[:, None] * Lmax + torch.arange(L, device=dev)[None]  # (B', L)
        y = ssm_multistep_snapshot(self.snapshots[i], x, inp.dt, p.A, B, C, p.D, dt_bias=p.dt_bias,
                                   dt_softplus=True, dt_limit=p.dt_limit, src_slot=self.src[seq],
                                   dst_slots=dst)  # (B', L, H, P)
        return y.reshape(rows, L, -1)

    def commit(self, verdict, step: StepInputs) -> None:
        """Point ``src`` at the last accepted token's snapshot; roll the conv state forward over the
        accepted row's inputs (device-side)."""
        bsz, Rg, Lmax = self.batch, self.regions(self.spec), 1 + self.spec.draft_len
        rows_per_seq = step.rows // bsz
        d = accepted_chain(verdict, self.spec.draft_len) if rows_per_seq > 1 else torch.zeros_like(verdict.accepted)
        region = (self.src_region + 1 + d) % Rg if Rg > 1 else self.src_region
        b = torch.arange(bsz, device=d.device)
        self.src.copy_((b * Rg + region) * Lmax + verdict.accepted)
        self.src_region.copy_(region)
        row = b * rows_per_seq + d  # (B,) row that verified the accepted chain
        for conv_state, conv_in in ((self.conv_state, self.conv_in), (self.gdn_conv_state, self.gdn_conv_in)):
            if conv_state is None or not conv_state.shape[0]:
                continue
            n, _, _, cdim = conv_in.shape
            rows_in = conv_in[:, row].reshape(n * bsz, Lmax, cdim)
            conv_state_advance(conv_state.view(n * bsz, cdim, -1), rows_in, (verdict.accepted + 1).repeat(n))
