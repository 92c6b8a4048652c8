"""`activation_replay` (ARP, seed 001 Sec. 3.1 and App. B, Alg. 2): verify from the committed state
without storing any state, cache the call's SSM inputs, and replay the accepted ones into the state
before the next verify.

Per sequence and layer: the committed SSM state and conv state (of the token before the last accepted
step's pending token), and an activation cache of the last call: pre-conv xBC (for the conv state) and
post-conv x, B with raw dt (for the SSM state), one row per draft chain. One call of L = 1 + S tokens per
row ([pending, chain d], seed 001 Sec. 5.3 verifies D drafts as D rows):

1. replay (Alg. 2 lines 2 and 5): advance the conv state over the accepted row's first c cached pre-conv
   inputs and the SSM state over its first c cached (x, dt, B) with the fused multi-step op in its replay
   form (``update_count`` = c, no output); c = accepted + 1 of the previous step, 0 after the prompt;
2. verify (lines 3 and 6): conv over [conv state, call tokens] and the multi-step scan of all L tokens
   from the committed state, outputs only (``store_state=False``);
3. cache the call's activations (lines 4 and 7).

``commit`` only records which row and how many tokens to replay (device tensors): the replay runs at the
start of the next call, sequentially before its verify, as in the paper (the price ARP pays against
joint_attainment, which re-runs the accepted tokens in parallel with the verify).

Gated DeltaNet mixers (``mix_gdn``) cache the call's pre-conv and post-conv q | k | v and the gates (g, beta);
the replay runs ``ops.gdn.gdn_multistep`` with ``update_count`` = c and no output, the verify the same op
from the committed state with no store.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update, conv_state_advance
from ssmspec.ops.gdn import gdn_multistep
from ssmspec.ops.multistep import ssm_multistep
from ssmspec.strategies._chain_rows import accepted_chain, layout_chain_rows
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy)


@register_strategy("activation_replay")
class ActivationReplay(StrategyBase):
    """One state + the last call's activations (module doc)."""

    def allocate(self, cfg, batch: int, spec: SpecConfig, device, dtype) -> None:
        super().allocate(cfg, batch, spec, device, dtype)  # committed conv_state and ssm_state
        n, rows, L = len(cfg.mamba_layers), batch * spec.num_drafts, 1 + spec.draft_len
        H, P, G, N = cfg.ssm_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        # activation cache of the last call, one row per chain (seed 001, Alg. 2 inputs)
        self.conv_in = torch.zeros(n, rows, L, cfg.conv_dim, device=device, dtype=dtype)  # pre-conv xBC
        self.x_in = torch.zeros(n, rows, L, H, P, device=device, dtype=dtype)  # post-conv x
        self.B_in = torch.zeros(n, rows, L, G, N, device=device, dtype=dtype)  # post-conv B
        self.dt_in = torch.zeros(n, rows, L, H, device=device, dtype=dtype)  # raw dt
        self.replay_row = torch.zeros(batch, device=device, dtype=torch.long)  # (B,) cache row to replay
        self.replay_count = torch.zeros(batch, device=device, dtype=torch.long)  # (B,) c: tokens to replay
        self.gdn_conv_in = self.gdn_post = self.gdn_g = self.gdn_beta = None
        if self.gdn_state is not None:  # the same cache for GDN mixers: q | k | v before and after the conv, gates
            ng, cd, Hg = len(cfg.gdn_layers), cfg.gdn_conv_dim, cfg.gdn_v_heads
            self.gdn_conv_in = torch.zeros(ng, rows, L, cd, device=device, dtype=dtype)
            self.gdn_post = torch.zeros(ng, rows, L, cd, device=device, dtype=dtype)
            self.gdn_g = torch.zeros(ng, rows, L, Hg, device=device, dtype=torch.float32)
            self.gdn_beta = torch.zeros(ng, rows, L, Hg, device=device, dtype=torch.float32)

    def max_rows(self, batch: int, spec: SpecConfig) -> int:
        return batch * spec.num_drafts

    def max_call_len(self, spec: SpecConfig) -> int:
        return 1 + spec.draft_len

    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        return layout_chain_rows(pending, drafts, seq_len, self.spec, self.name)

    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Prompt pass: the chunk scan's final state is committed; nothing to replay yet."""
        y = super().prefill(p, inp, step)
        self.replay_count.zero_()
        return y

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        y = super().prefill_gdn(p, inp, step)
        self.replay_count.zero_()
        return y

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """GDN form of ``mix``: replay the accepted cached tokens into the state, verify from it, cache."""
        i, rows, L = p.index, step.rows, step.length
        if step.valid is not None or rows > self.gdn_conv_in.shape[1] or L > self.gdn_conv_in.shape[2]:
            raise ValueError(f"activation_replay takes no pad tokens and at most {self.gdn_conv_in.shape[1]} rows x "
                             f"{self.gdn_conv_in.shape[2]} tokens a call; got {rows} x {L}")
        sel, c = self.replay_row, self.replay_count
        conv_state_advance(self.gdn_conv_state[i], self.gdn_conv_in[i, sel], c)
        qr, kr, vr = p.split(self.gdn_post[i, sel])
        gdn_multistep(self.gdn_state[i], qr, kr, vr, self.gdn_g[i, sel], self.gdn_beta[i, sel], update_count=c,
                      store_state=True, output=False)
        seq = torch.arange(rows, device=inp.qkv.device) // (rows // self.batch)  # (B',)
        post = causal_conv1d_update(inp.qkv, self.gdn_conv_state[i][seq], p.conv_weight, None, activation=p.activation,
                                    update_state=False, save_input=self.gdn_conv_in[i, :rows])  # (B', L, conv_dim)
        q, k, v = p.split(post)
        g, beta = p.gates(inp.a, inp.b)
        y = gdn_multistep(self.gdn_state[i], q, k, v, g, beta, state_batch_indices=seq, store_state=False)
        self.gdn_post[i, :rows, :L] = post
        self.gdn_g[i, :rows, :L] = g
        self.gdn_beta[i, :rows, :L] = beta
        return y

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Replay the previous step's accepted activations, then verify this call from the result."""
        i, rows, L = p.index, step.rows, step.length
        if step.valid is not None:
            raise ValueError("activation_replay does not take pad / no-op tokens in decode calls (StepInputs.valid)")
        if rows > self.conv_in.shape[1] or L > self.conv_in.shape[2]:
            raise ValueError(f"a call of {rows} rows x {L} tokens exceeds the activation cache "
                             f"({self.conv_in.shape[1]} x {self.conv_in.shape[2]}); make the drafter's spec "
                             f"match the strategy's")
        # 1. replay: move conv and SSM state over the c accepted cached tokens (c = 0: unchanged)
        sel, c = self.replay_row, self.replay_count  # (B,), (B,)
        conv_state_advance(self.conv_state[i], self.conv_in[i, sel], c)
        xr, Br = self.x_in[i, sel], self.B_in[i, sel]  # (B, Lc, H, P), (B, Lc, G, N)
        ssm_multistep(self.ssm_state[i], xr, self.dt_in[i, sel], p.A, Br, Br, dt_bias=p.dt_bias, dt_softplus=True,
                      dt_limit=p.dt_limit, update_count=c, store_state=True, output=False)  # C unused: no output
        # 2. verify every row from its sequence's (now current) state, no state stored
        seq = torch.arange(rows, device=inp.xbc.device) // (rows // self.batch)  # (B',)
        xbc = causal_conv1d_update(inp.xbc, self.conv_state[i][seq], p.conv_weight, p.conv_bias, activation=p.activation,
                                   update_state=False, save_input=self.conv_in[i, :rows])  # (B', L, conv_dim)
        x, B, C = p.split_xbc(xbc)  # (B', L, H, P), (B', L, G, N) x2
        y = ssm_multistep(self.ssm_state[i], x, inp.dt, p.A, B, C, p.D, dt_bias=p.dt_bias, dt_softplus=True,
                          dt_limit=p.dt_limit, state_batch_indices=seq, store_state=False)  # (B', L, H, P)
        # 3. cache this call's activations for the next replay
        self.x_in[i, :rows, :L] = x  # (conv_in took this call's inputs in the conv launch)
        self.B_in[i, :rows, :L] = B
        self.dt_in[i, :rows, :L] = inp.dt
        return y.reshape(rows, L, -1)

    def commit(self, verdict, step: StepInputs) -> None:
        """Record the accepted row and count for the next call's replay (device-side, no state moves)."""
        rows_per_seq = step.rows // self.batch
        d = accepted_chain(verdict, self.spec.draft_len) if rows_per_seq > 1 else torch.zeros_like(verdict.accepted)
        self.replay_row.copy_(torch.arange(self.batch, device=d.device) * rows_per_seq + d)
        self.replay_count.copy_(verdict.accepted + 1)
