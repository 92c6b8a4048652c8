"""`replay`: ReplaySSM (seed 000) -- cache recent SSM inputs instead of storing the state every step.

Per sequence and layer: a checkpoint state S0 (``ssm_state``), a ring buffer of capacity R holding the
(x, dt, B) of recent tokens (x, B in the activation dtype, dt discretized fp32), a ring index ``head`` of
the oldest cached entry and the number ``count`` = h of committed entries. One call of L tokens
([pending, S drafts], L = 1 + S; standard decoding is S = 0, L = 1):

1. flush where h + 2L > R (seed 000: one window early, so every step keeps L free slots): fold the h
   committed entries into S0 -- the only state store -- and empty the ring; the flags are per-sequence
   data decided inside the verify call (``replay_verify`` with ``flush=None``), never a Python branch, so
   one captured graph serves every step;
2. append the L new tokens to the ring and compute their outputs in the output-only form from S0 and
   the ring window under a causal mask (seed 000, Alg. 2 / 4) -- no state is materialized;
3. ``commit`` moves ``count`` by the accepted count + 1 on the device (rejected entries lie beyond the
   pointer and are overwritten next call), and advances the conv state over the accepted tokens from the
   call's cached conv inputs, both in one launch for every layer (``conv_state_commit``: ``replay_commit`` and
   ``conv_state_advance`` fused); only committed entries are ever folded.

The conv runs over [conv state, call tokens] without updating the state (``causal_conv1d_update`` with
``update_state=False``), so rejected drafts never reach it.

Beyond seed 000 (DESIGN.md section 2): the drafts may be a token tree (or several chains, which are a tree
under the pending token). All 1 + T nodes are appended to the ring; each node's output reads the committed
entries plus its ancestors (``tree_mask`` instead of the causal mask, accumulated decay along ancestors as
in STree), the conv runs over ancestors (``tree_conv1d``), and commit first gathers the accepted path into
consecutive ring slots (``replay_commit_path``) and the conv state advances over the path's inputs.

Gated DeltaNet mixers (seed 000's GDN variant, ``mix_gdn``): the checkpoint is the (H, N, P) delta-rule state,
the ring caches each token's key, gate and correction u = β(v − e^g Sᵀk) (not v: with u the state unrolls like
Mamba-2's), and a call is ``ops.gdn.gdn_replay_verify`` -- the device-side flush, the output-only readout of
every token through the triangular solve of the WY form, the append -- then ``gdn_replay_commit``. Token trees
(or several chains) on GDN layers: that kernel takes a causal window, so a tree call runs in PyTorch
(``_verify_gdn_tree``): the same flush, then the state after the committed entries is materialized from S0
and the ring and the tree is solved with the triangular system restricted to ancestors
(``ops.gdn.gdn_tree_scan``: every node's correction is its own path's, so the accepted path's entries
are exactly what a chain would have cached); commit gathers the path as for Mamba-2. Correct on every device,
not a fast kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update, conv_state_commit
from ssmspec.ops.gdn import (gdn_replay_flush_flags, gdn_replay_state_ref, gdn_replay_verify,
                             gdn_tree_scan)
from ssmspec.ops.replay import replay_commit_path, replay_verify
from ssmspec.ops.tree_scan import tree_conv1d
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy)


@register_strategy("replay")
class Replay(StrategyBase):
    supports_trees = True

    def check_spec(self, spec: SpecConfig) -> None:
        super().check_spec(spec)
        L = self.max_call_len(spec)
        if spec.buffer_size < L:
            shape = (f"S={spec.draft_len}" if spec.nodes == spec.draft_len else
                     f"{spec.nodes} draft nodes, S={spec.draft_len}")
            fix = (f"lower S to at most {spec.buffer_size - 1}" if spec.nodes == spec.draft_len else
                   "draft fewer nodes per step")
            raise ValueError(f"replay buffer_size R={spec.buffer_size} cannot hold one call of {L} tokens "
                             f"(pending + drafts, {shape}); raise buffer_size to at least {L} or {fix}")

    def allocate(self, cfg, batch: int, spec: SpecConfig, device, dtype) -> None:
        super().allocate(cfg, batch, spec, device, dtype)  # ssm_state is the checkpoint S0 of every layer
        n, R, L = len(cfg.mamba_layers), spec.buffer_size, self.max_call_len(spec)
        H, P, G, N = cfg.ssm_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        self.ring_x = torch.zeros(n, batch, R, H, P, device=device, dtype=dtype)  # cached x (v)
        self.ring_dt = torch.zeros(n, batch, R, H, device=device, dtype=torch.float32)  # cached discretized dt
        self.ring_B = torch.zeros(n, batch, R, G, N, device=device, dtype=dtype)  # cached B (k)
        # ring pointers per layer (a flush moves them inside the layer's verify call)
        self.head = torch.zeros(n, batch, device=device, dtype=torch.long)  # slot of the oldest entry
        self.count = torch.zeros(n, batch, device=device, dtype=torch.long)  # committed entries h
        self.conv_in = torch.zeros(n, batch, L, cfg.conv_dim, device=device, dtype=dtype)  # call's pre-conv xBC
        # the one-launch verify's program counters per layer (ops/replay/fused.py): zeros each launch leaves zero
        self.verify_counters = torch.zeros(n, batch, device=device, dtype=torch.int32)
        self.gdn_ring_k = self.gdn_ring_u = self.gdn_ring_g = self.gdn_head = self.gdn_count = None
        self.gdn_conv_in = None
        if self.gdn_state is not None:  # gdn_state is the GDN checkpoint S0
            ng = len(cfg.gdn_layers)
            Gk, Hv, Nk, Pv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
            self.gdn_ring_k = torch.zeros(ng, batch, R, Gk, Nk, device=device, dtype=dtype)  # cached keys
            self.gdn_ring_u = torch.zeros(ng, batch, R, Hv, Pv, device=device, dtype=dtype)  # cached corrections u
            self.gdn_ring_g = torch.zeros(ng, batch, R, Hv, device=device, dtype=torch.float32)  # cached log-decays
            self.gdn_head = torch.zeros(ng, batch, device=device, dtype=torch.long)
            self.gdn_count = torch.zeros(ng, batch, device=device, dtype=torch.long)
            self.gdn_conv_in = torch.zeros(ng, batch, L, cfg.gdn_conv_dim, device=device, dtype=dtype)

    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        if drafts is not None and 1 + drafts.size > self.conv_in.shape[2]:
            raise ValueError(f"the drafter proposed {drafts.size} drafts but replay was allocated for "
                             f"{self.conv_in.shape[2] - 1} (SpecConfig.draft_len); make the drafter's spec match")
        return super().layout(pending, drafts, seq_len)

    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Prompt pass: the chunk scan's final state becomes the checkpoint S0, the ring starts empty."""
        y = super().prefill(p, inp, step)
        self.head[p.index].zero_()
        self.count[p.index].zero_()
        return y

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """Prompt pass: the final delta-rule state is the checkpoint S0, the ring starts empty."""
        y = super().prefill_gdn(p, inp, step)
        self.gdn_head[p.index].zero_()
        self.gdn_count[p.index].zero_()
        return y

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """Output-only GDN verify of the call's chain against S0 + the ring (flushing first where due)."""
        i = p.index
        if step.rows != self.batch or step.valid is not None:
            raise ValueError(f"replay lays out one row per sequence ({self.batch}) with no pads; got {step.rows} rows")
        if step.tree_mask is None:  # the call's inputs are kept (for commit's conv advance) by the same launch
            qkv = causal_conv1d_update(inp.qkv, self.gdn_conv_state[i], p.conv_weight, None, activation=p.activation,
                                       update_state=False, save_input=self.gdn_conv_in[i])
        else:
            qkv = tree_conv1d(inp.qkv, self.gdn_conv_state[i], p.conv_weight, None, tree_mask=step.tree_mask,
                              activation=p.activation)
            self.gdn_conv_in[i, :, :step.length] = inp.qkv
        q, k, v = p.split(qkv)
        g, beta = p.gates(inp.a, inp.b)
        if step.tree_mask is not None:
            return self._verify_gdn_tree(i, q, k, v, g, beta, step.tree_mask)
        return gdn_replay_verify(self.gdn_state[i], self.gdn_ring_k[i], self.gdn_ring_u[i], self.gdn_ring_g[i],
                                 self.gdn_head[i], self.gdn_count[i], q, k, v, g, beta, flush=None)

    def _verify_gdn_tree(self, i: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         tree_mask: Tensor) -> Tensor:
        """A token tree through GDN layer i (module doc): flush where count + 2L > R, solve the tree from the state
        after the committed entries, append (k, U, g) at slots (head + count + s) % R. Device-side, no sync."""
        S0, rk, ru, rg = self.gdn_state[i], self.gdn_ring_k[i], self.gdn_ring_u[i], self.gdn_ring_g[i]
        head, count = self.gdn_head[i], self.gdn_count[i]
        bsz, L, R = q.shape[0], q.shape[1], rk.shape[1]
        flush = gdn_replay_flush_flags(count, L, R)
        folded = gdn_replay_state_ref(S0, rk, ru, rg, head, count * flush)
        S0.copy_(torch.where(flush[:, None, None, None], folded.to(S0.dtype), S0))
        head.copy_(torch.where(flush, (head + count) % R, head))
        count.copy_(torch.where(flush, torch.zeros_like(count), count))
        state = gdn_replay_state_ref(S0, rk, ru, rg, head, count)  # after the committed entries (materialized)
        y, _, U = gdn_tree_scan(state, q, k, v, g, beta, mask=tree_mask, corrections=True)
        slots = (head[:, None] + count[:, None] + torch.arange(L, device=q.device)[None]) % R
        rows = torch.arange(bsz, device=q.device)[:, None]
        rk[rows, slots] = k.to(rk.dtype)
        ru[rows, slots] = U.to(ru.dtype)
        rg[rows, slots] = g.to(rg.dtype)
        return y

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Output-only verify of the call's L tokens against S0 + the ring (flushing first where due)."""
        i = p.index
        if step.rows != self.batch:
            raise ValueError(f"replay lays out one row per sequence ({self.batch}), got a call of {step.rows} rows")
        if step.valid is not None:
            raise ValueError("replay does not take pad / no-op tokens in decode calls (StepInputs.valid)")
        L = step.length
        if step.tree_mask is None:  # (B, L, conv_dim); the same launch keeps the inputs for commit's conv advance
            xbc = causal_conv1d_update(inp.xbc, self.conv_state[i], p.conv_weight, p.conv_bias,
                                       activation=p.activation, update_state=False, save_input=self.conv_in[i])
        else:  # each node's window runs over its ancestors
            xbc = tree_conv1d(inp.xbc, self.conv_state[i], p.conv_weight, p.conv_bias, tree_mask=step.tree_mask,
                              activation=p.activation)
            self.conv_in[i, :, :L] = inp.xbc
        x, B, C = p.split_xbc(xbc)  # (B, L, H, P), (B, L, G, N) x2
        # flush where count + 2L > R: decided per sequence on the device inside the call (data, not a branch)
        y = replay_verify(self.ssm_state[i], self.ring_x[i], self.ring_dt[i], self.ring_B[i], self.head[i],
                          self.count[i], x, inp.dt, p.A, B, C, p.D, dt_bias=p.dt_bias, dt_limit=p.dt_limit,
                          flush=None, tree_mask=step.tree_mask, workspace=self.verify_counters[i])  # (B, L, H, P)
        return y.reshape(*y.shape[:2], -1)

    def commit(self, verdict, step: StepInputs) -> None:
        """Keep pending + accepted entries: move the pointers, advance the conv state (device-side)."""
        if self.gdn_count is not None:  # GDN layers: (tree: path first) count += accepted + 1, conv forward
            ng, bsz, Lg, cg = self.gdn_conv_in.shape
            gin = self.gdn_conv_in.view(ng * bsz, Lg, cg)
            if step.tree_mask is not None:
                path = verdict.path.repeat(ng, 1)
                Rg = self.gdn_ring_k.shape[2]
                replay_commit_path(self.gdn_ring_u.view(ng * bsz, Rg, *self.gdn_ring_u.shape[3:]),
                                   self.gdn_ring_g.view(ng * bsz, Rg, -1),
                                   self.gdn_ring_k.view(ng * bsz, Rg, *self.gdn_ring_k.shape[3:]),
                                   self.gdn_head.view(-1), self.gdn_count.view(-1), path)
                gin = gin.gather(1, path[..., None].expand(-1, -1, cg))
            # gdn_replay_commit (count += accepted + 1) and the conv advance of every layer, one launch
            conv_state_commit(self.gdn_conv_state.view(ng * bsz, cg, -1), gin, verdict.accepted, self.gdn_count)
        n, bsz, Lc, cdim = self.conv_in.shape
        if not n:
            return
        R = self.ring_x.shape[2]
        conv_in = self.conv_in.view(n * bsz, Lc, cdim)
        if step.tree_mask is not None:  # a host-side fact of the layout, not data: the path goes first
            path = verdict.path.repeat(n, 1)  # (n*B, K) node numbers root first, every layer alike
            replay_commit_path(self.ring_x.view(n * bsz, R, *self.ring_x.shape[3:]),
                               self.ring_dt.view(n * bsz, R, -1), self.ring_B.view(n * bsz, R, *self.ring_B.shape[3:]),
                               self.head.view(-1), self.count.view(-1), path)
            conv_in = conv_in.gather(1, path[..., None].expand(-1, -1, cdim))  # (n*B, K, conv_dim) path inputs
        # replay_commit ((n, B) += accepted + 1, broadcast over layers) and the conv advance, one launch
        conv_state_commit(self.conv_state.view(n * bsz, cdim, -1), conv_in, verdict.accepted, self.count)
