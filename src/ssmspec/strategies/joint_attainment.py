"""`joint_attainment` (Joint Attainment and Advancement, seed 001 Sec. 3.1, Fig. 3): an extra batch row
re-runs the previous step's accepted tokens while the new drafts are verified, and its final state is the
next committed state. No activations are cached; the dense layers run again on the accepted tokens.

The committed state (SSM and conv) lags one step: it is the state before the previous step's accepted
tokens (the prefix: that step's pending token + its c accepted drafts, c + 1 <= 1 + S tokens). A call has
D + 1 rows per sequence and 2(1 + S) tokens per row, K = 1 + S:

    extra row    [no-op x K | no-op x (K - c - 1), prefix]          its final state = the new committed state
    draft row d  [no-op x (K - c - 1), prefix | pending, chain d]    verifies chain d from the lagged state

No-op tokens (``StepInputs.valid`` False) carry dt = 0, so the state passes through them untouched; the
conv skips them (each row's valid tokens follow the committed conv state directly), and attention neither
attends to them nor lets them see anything. Every row hides the prefix's committed KV slots
(``StepInputs.kv_hide``) since it re-runs those tokens itself, so its attention sees exactly the context
the tokens had when first verified.

States: one per row, D + 1 per sequence and layer (seed 001 Sec. 3.3: "N + 1 copies of the states"). Slot
b(D+1) is the extra row's and holds the committed state; at the start of each call it is copied just in
time into the D draft rows' slots (JIT state copy, Sec. 3.3), then one multi-step scan runs every row from
its own slot; only the extra row stores its state back (``update_count``: L for it, 0 for draft rows).
``commit`` only records the accepted path's tokens (the next prefix), on the device. Chains only.

Ablation options (seed 001 Table 2; ``make_strategy("joint_attainment", scan=..., jit_copy=...)`` or
``strategy.scan=...`` in conf/strategy/joint_attainment.yaml). Every combination is lossless:

- ``scan``: how one call's 2(1 + S) tokens run through the SSM. ``fused`` (default): the fused multi-step
  kernel (App. A; state loaded once, only the extra row stores it). ``chunk``: the chunked SSD scan
  (``ops.ssd``), the seed's Table 2 baseline ("Mamba-2 CS kernel"): every row's final state comes back as a
  new tensor and the extra rows' are copied into their slots. ``loop``: 2(1 + S) launches of the
  single-token ``selective_state_update`` over all rows (Table 1's SSU column), in place.
- ``jit_copy``: True (default) copies the committed state into the draft rows' slots just in time, inside
  the step (so inside its CUDA graph). False is the seed's eager copy: after the step, the host launches
  the copy layer by layer outside the captured graph (``after_step``, which the engine calls after every
  step), paying a launch per layer (Sec. 3.3: "captured within the kernel execution graph and therefore
  has a reduced CPU launch overhead").

Gated DeltaNet mixers (``mix_gdn``) follow the same rows and slots with (H, N, P) states: no-op tokens carry
g = beta = 0 (the state passes through), ``scan`` picks ``ops.gdn.gdn_multistep`` (fused), the chunked WY
scan (``ops.gdn.gdn_chunk_scan``, chunk) or one ``gdn_multistep`` launch per column (loop).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update, conv_state_advance
from ssmspec.ops.gdn import gdn_chunk_scan, gdn_multistep
from ssmspec.ops.multistep import ssm_multistep
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.ops.ssd import ssd_chunk_scan
from ssmspec.strategies._chain_rows import chain_node_places, chain_rows, check_chain_drafts
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy, run_prefill, run_prefill_gdn)


def _roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """x (B', L, C) -> x[b, (t + shift[b]) mod L]: rotate each row left by shift[b] (device-side gather)."""
    L = x.shape[1]
    idx = (torch.arange(L, device=x.device)[None] + shift[:, None]) % L  # (B', L)
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))


@register_strategy("joint_attainment")
class JointAttainment(StrategyBase):
    """Extra re-run row per sequence attains the committed state (module doc)."""

    SCANS = ("fused", "chunk", "loop")

    def __init__(self, *, scan: str = "fused", jit_copy: bool = True, **unknown) -> None:
        super().__init__()
        if unknown:
            raise ValueError(f"joint_attainment takes the options scan and jit_copy, not {sorted(unknown)}; "
                             f"see conf/strategy/joint_attainment.yaml")
        if scan not in self.SCANS:
            raise ValueError(f"joint_attainment scan={scan!r} is not one of {', '.join(self.SCANS)}; set "
                             f"strategy.scan to fused (the seed's kernel), chunk (its Table 2 baseline) or loop")
        if not isinstance(jit_copy, bool):
            raise ValueError(f"joint_attainment jit_copy must be true or false, got {jit_copy!r}")
        self.scan, self.jit_copy = scan, jit_copy

    @property
    def options(self) -> dict:
        """The ablation options (result rows record them)."""
        return {"scan": self.scan, "jit_copy": self.jit_copy}

    def allocate(self, cfg, batch: int, spec: SpecConfig, device, dtype) -> None:
        self.check_spec(spec)
        self.cfg, self.batch, self.spec = cfg, batch, spec
        n, K, R = len(cfg.mamba_layers), 1 + spec.draft_len, 1 + spec.num_drafts
        self.conv_state = torch.zeros(n, batch, cfg.conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype)
        # (n, B*(D+1), H, P, N) fp32: slot b*(D+1) = extra row = committed state, then one per draft row
        self.ssm_state = torch.zeros(n, batch * R, cfg.ssm_heads, cfg.head_dim, cfg.state_size, device=device,
                                     dtype=torch.float32)
        self.prefix = torch.zeros(batch, K, device=device, dtype=torch.long)  # (B, K) previous accepted tokens
        self.prefix_len = torch.zeros(batch, device=device, dtype=torch.long)  # (B,) c + 1 (0 after the prompt)
        self.allocate_gdn(cfg, batch, device, dtype, state_rows=batch * R)  # one GDN state per row too

    def max_rows(self, batch: int, spec: SpecConfig) -> int:
        return batch * (1 + spec.num_drafts)

    def max_call_len(self, spec: SpecConfig) -> int:
        return 2 * (1 + spec.draft_len)

    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Prompt pass: the final state is committed into each sequence's extra-row slot; no prefix yet."""
        y, conv, ssm = run_prefill(p, inp, step, chunk_size=self.cfg.chunk_size)
        self.conv_state[p.index].copy_(conv)
        R = 1 + self.spec.num_drafts
        # every slot of a sequence starts from its committed state (an eager copy runs only after steps)
        self.ssm_state[p.index].copy_(ssm.repeat_interleave(R, 0))
        self.prefix_len.zero_()
        return y

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        y, conv, st = run_prefill_gdn(p, inp, step)
        self.gdn_conv_state[p.index].copy_(conv)
        self.gdn_state[p.index].copy_(st.repeat_interleave(1 + self.spec.num_drafts, 0))
        self.prefix_len.zero_()
        return y

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """GDN form of ``mix``: the same rows, conv rotation and slots; the extra row's state is committed."""
        i, rows, L = p.index, step.rows, step.length
        R = 1 + self.spec.num_drafts
        if step.valid is None or rows != self.batch * R or L != 2 * (1 + self.spec.draft_len):
            raise ValueError(f"joint_attainment needs its own layout ({self.batch * R} rows x "
                             f"{2 * (1 + self.spec.draft_len)} tokens with no-op flags); got {rows} x {L}")
        seq = step.seq_index
        lead = L - step.valid.sum(1)
        xr = _roll_rows(inp.qkv, lead)
        yr = causal_conv1d_update(xr, self.gdn_conv_state[i][seq], p.conv_weight, None, activation=p.activation,
                                  update_state=False)
        q, k, v = p.split(_roll_rows(yr, L - lead))
        g, beta = p.gates(inp.a, inp.b, step.valid)  # 0 on no-ops: the state passes through them
        st = self.gdn_state[i]
        extra, drafts = self._slots(inp.qkv.device)
        if self.jit_copy:
            st.index_copy_(0, drafts, st[extra.repeat_interleave(R - 1)])
        if self.scan == "fused":
            uc = torch.where(torch.arange(rows, device=q.device) % R == 0, L, 0)
            y = gdn_multistep(st, q, k, v, g, beta, update_count=uc, store_state=True)
        elif self.scan == "chunk":
            y, final = gdn_chunk_scan(q, k, v, g, beta, chunk_size=p.chunk_size, initial_state=st)
            st.index_copy_(0, extra, final[extra])
        else:
            y = torch.cat([gdn_multistep(st, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                         beta[:, t:t + 1]) for t in range(L)], dim=1)
        conv_state_advance(self.gdn_conv_state[i], xr[extra], step.valid[extra].sum(1))
        return y

    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        """Rows b*(D+1) + [extra, draft 0..D-1], each 2K tokens (module doc); device-side."""
        spec = self.spec
        check_chain_drafts(drafts, spec, self.name)
        bsz, D, K, dev = pending.shape[0], spec.num_drafts, 1 + spec.draft_len, pending.device
        plen = self.prefix_len  # (B,)
        j = torch.arange(K, device=dev)
        shift = K - plen  # (B,) leading no-ops before the prefix
        ok1 = j[None] >= shift[:, None]  # (B, K) prefix block validity
        pad = self.cfg.pad_token_id
        block1 = torch.where(ok1, self.prefix.gather(1, (j[None] - shift[:, None]).clamp(min=0)), pad)  # (B, K)
        pos1 = (seq_len[:, None] - K + j[None]).clamp(min=0)  # prefix token k sits at seq_len - plen + k
        tokens2, pos2 = chain_rows(pending, drafts, seq_len, spec)  # (B, D, K) [pending, chain d]
        draft_ids = torch.cat([block1[:, None].expand(bsz, D, K), tokens2], dim=2)  # (B, D, 2K)
        draft_pos = torch.cat([pos1[:, None].expand(bsz, D, K), pos2], dim=2)
        extra_ids = torch.cat([torch.full_like(block1, pad), block1], dim=1)[:, None]  # (B, 1, 2K)
        extra_pos = torch.cat([torch.zeros_like(pos1), pos1], dim=1)[:, None]
        ids = torch.cat([extra_ids, draft_ids], dim=1).reshape(bsz * (D + 1), 2 * K)  # (B', 2K)
        pos = torch.cat([extra_pos, draft_pos], dim=1).reshape(bsz * (D + 1), 2 * K)
        ones = torch.ones_like(ok1)
        valid = torch.cat([torch.cat([~ones, ok1], 1)[:, None],
                           torch.cat([ok1, ones], 1)[:, None].expand(bsz, D, 2 * K)], dim=1).reshape(bsz * (D + 1), 2 * K)
        node_row, node_col = chain_node_places(bsz, spec, rows_per_seq=D + 1, first_row=1, first_col=K, device=dev)
        return StepInputs(input_ids=ids, positions=pos, valid=valid,
                          seq_index=torch.arange(bsz, device=dev).repeat_interleave(D + 1),
                          node_row=node_row, node_col=node_col, kv_hide=plen.repeat_interleave(D + 1))

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Conv and the scan (``scan`` option) over every row; the extra row's state becomes the committed one."""
        i, rows, L = p.index, step.rows, step.length
        R = 1 + self.spec.num_drafts
        if step.valid is None or rows != self.batch * R or L != 2 * (1 + self.spec.draft_len):
            raise ValueError(f"joint_attainment needs its own layout ({self.batch * R} rows x "
                             f"{2 * (1 + self.spec.draft_len)} tokens with no-op flags); got {rows} x {L}")
        dev = inp.xbc.device
        seq = step.seq_index  # (B',)
        lead = L - step.valid.sum(1)  # (B',) leading no-ops of each row
        # conv over [committed conv state, the row's valid tokens]: rotate them to the front, conv, rotate back
        xr = _roll_rows(inp.xbc, lead)  # (B', L, conv_dim) valid tokens first
        yr = causal_conv1d_update(xr, self.conv_state[i][seq], p.conv_weight, p.conv_bias, activation=p.activation,
                                  update_state=False)
        xbc = _roll_rows(yr, L - lead)  # (B', L, conv_dim); no-op columns hold finite junk, dt = 0 there
        x, B, C = p.split_xbc(xbc)  # (B', L, H, P), (B', L, G, N) x2
        dt = p.discretize(inp.dt, step.valid)  # (B', L, H) fp32, 0 on no-ops
        st = self.ssm_state[i]  # (B', H, P, N) fp32: slot b*R = committed state, then the draft rows'
        extra, drafts = self._slots(dev)
        if self.jit_copy:  # JIT state copy: every draft row starts from its sequence's committed state
            st.index_copy_(0, drafts, st[extra.repeat_interleave(R - 1)])
        y = self._scan(p, st, x, dt, B, C, extra)  # (B', L, H, P)
        # the extra row's valid tokens (the prefix) advance the committed conv state, after every row read it
        conv_state_advance(self.conv_state[i], xr[extra], step.valid[extra].sum(1))
        return y.reshape(rows, L, -1)

    def _slots(self, dev) -> tuple[Tensor, Tensor]:
        """(B,) extra-row slots (the committed states) and (B*D,) draft-row slots of the state pool."""
        R = 1 + self.spec.num_drafts
        extra = torch.arange(self.batch, device=dev) * R
        return extra, (extra[:, None] + torch.arange(1, R, device=dev)[None]).reshape(-1)

    def _scan(self, p: MambaParams, st: Tensor, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, extra: Tensor) -> Tensor:
        """Every row from its own slot over the call; afterwards the extra rows' slots hold the state after
        their prefix (no-op tokens carry dt = 0, so running them through changes nothing). x (B', L, H, P),
        dt (B', L, H) discretized, B, C (B', L, G, N) -> y (B', L, H, P) in x's dtype."""
        rows, L = x.shape[:2]
        if self.scan == "fused":  # one launch; only the extra rows store (after all L tokens)
            R = 1 + self.spec.num_drafts
            uc = torch.where(torch.arange(rows, device=x.device) % R == 0, L, 0)  # (B',)
            return ssm_multistep(st, x, dt, p.A, B, C, p.D, dt_softplus=False, update_count=uc, store_state=True)
        if self.scan == "chunk":  # the seed's baseline: chunk scan from every slot, final states as a new tensor
            y, final = ssd_chunk_scan(x, dt, p.A, B, C, p.D, chunk_size=self.cfg.chunk_size, initial_state=st)
            st.index_copy_(0, extra, final[extra])  # (B, H, P, N): only the committed states are kept
            return y.to(x.dtype)
        # loop: one single-token launch per column, every row's slot updated in place (draft rows' slots are
        # scratch: the next copy overwrites them)
        return torch.stack([selective_state_update(st, x[:, t], dt[:, t], p.A, B[:, t], C[:, t], p.D)
                            for t in range(L)], dim=1)

    def after_step(self) -> None:
        """``jit_copy=False``: the eager copy of seed 001 Sec. 3.3, launched from the host after every step,
        outside the captured graph: per layer, the committed state into the sequence's D draft-row slots."""
        if self.jit_copy:
            return
        extra, drafts = self._slots(self.ssm_state.device)
        src = extra.repeat_interleave(self.spec.num_drafts)  # (B*D,)
        for i in range(self.ssm_state.shape[0]):  # per layer (B', H, P, N): one gather + one scatter launch
            self.ssm_state[i].index_copy_(0, drafts, self.ssm_state[i][src])
        for i in range(0 if self.gdn_state is None else self.gdn_state.shape[0]):  # GDN layers alike
            self.gdn_state[i].index_copy_(0, drafts, self.gdn_state[i][src])

    def commit(self, verdict, step: StepInputs) -> None:
        """The accepted path's tokens (pending + accepted drafts) become the next call's prefix."""
        path = verdict.path  # (B, 1+Smax) node numbers
        flat = step.node_row.gather(1, path) * step.length + step.node_col.gather(1, path)  # (B, 1+Smax)
        toks = step.input_ids.reshape(-1)[flat]
        self.prefix[:, :toks.shape[1]] = toks
        self.prefix_len.copy_(verdict.accepted + 1)
