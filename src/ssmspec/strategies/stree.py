"""`stree`: tree-based speculative decoding for Mamba-2 mixers (STree, seed 003).

Keeps per sequence and layer one committed SSM state, one committed conv state, and the inputs of the
last call (no per-node states). One decode call:

1. activation replay (seed 003 Alg. 1 line 7, from Snakes and Ladders, seed 001): the accepted path of
   the previous call -- its cached post-conv x, B and discretized dt -- is folded into the committed SSM
   state (``ssm_multistep`` with ``update_count`` = accepted + 1), and its pre-conv inputs advance the
   conv state (``conv_state_advance``);
2. the packed token tree [pending token, draft nodes...] goes through the tree conv over ancestors and
   one tree-masked scan from the committed state (``ops.tree_scan``: accumulated A along ancestors),
   output only -- nothing is stored per node; on CUDA both are the packed Triton kernels of
   ``ops/tree_scan/triton.py`` (no (B, L, L, H) tensor is materialised), elsewhere their naive twins;
3. this call's inputs are cached for step 1 of the next call.

``commit`` only records, on the device, which columns form the accepted path and how many there are;
every shape is fixed at ``allocate`` so a step can be captured in a CUDA graph. Chains (one or several)
are trees too, so every drafter works. Attention layers follow the same layout: the KV cache attends
under ``step.tree_mask`` and ``generate`` commits the accepted path's keys and values.

Gated DeltaNet mixers (``mix_gdn``): the same replay / verify / cache cycle with the delta rule. The tree scan
above is the diagonal-decay SSD form (a node's output is a decayed sum over its ancestors' inputs), which the
delta rule is not: each node's correction u depends on its ancestors' corrections. The GDN tree verify is
``ops.gdn.gdn_tree_scan``: the WY form with the triangular system restricted to ancestors (every node's
correction is its own path's), one solve for the whole tree, output only. It is a PyTorch op on every device
(no Triton kernel yet: a delta-rule tree kernel would be its own kernel); the replay of the accepted path
is ``ops.gdn.gdn_multistep`` with ``update_count``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import conv_state_advance
from ssmspec.ops.gdn import gdn_multistep, gdn_tree_scan
from ssmspec.ops.multistep import ssm_multistep
from ssmspec.ops.tree_scan import tree_conv1d, tree_scan
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy)


@register_strategy("stree")
class STree(StrategyBase):
    supports_trees = True

    def allocate(self, cfg, batch: int, spec: SpecConfig, device, dtype) -> None:
        super().allocate(cfg, batch, spec, device, dtype)
        n, Lc = len(cfg.mamba_layers), self.max_call_len(spec)
        # the last call's inputs, per layer and node column (activation cache, seed 003 Alg. 1)
        self.cache_pre = torch.zeros(n, batch, Lc, cfg.conv_dim, device=device, dtype=dtype)  # pre-conv xBC
        self.cache_post = torch.zeros(n, batch, Lc, cfg.conv_dim, device=device, dtype=dtype)  # post-conv xBC
        self.cache_dt = torch.zeros(n, batch, Lc, cfg.ssm_heads, device=device, dtype=torch.float32)  # discretized
        # accepted path of the last call: its columns root first, and its length (0 = nothing to replay)
        self.replay_cols = torch.zeros(batch, Lc, device=device, dtype=torch.long)
        self.replay_count = torch.zeros(batch, device=device, dtype=torch.long)
        self.gdn_pre = self.gdn_post = self.gdn_g = self.gdn_beta = None
        if self.gdn_state is not None:  # the last call's GDN inputs per node column
            ng, cd, Hg = len(cfg.gdn_layers), cfg.gdn_conv_dim, cfg.gdn_v_heads
            self.gdn_pre = torch.zeros(ng, batch, Lc, cd, device=device, dtype=dtype)
            self.gdn_post = torch.zeros(ng, batch, Lc, cd, device=device, dtype=dtype)
            self.gdn_g = torch.zeros(ng, batch, Lc, Hg, device=device, dtype=torch.float32)
            self.gdn_beta = torch.zeros(ng, batch, Lc, Hg, device=device, dtype=torch.float32)

    def layout(self, pending: Tensor, drafts, seq_len: Tensor) -> StepInputs:
        step = super().layout(pending, drafts, seq_len)
        if step.length > self.cache_pre.shape[2]:
            raise ValueError(f"the drafter proposed {step.length - 1} nodes per sequence but stree was allocated "
                             f"for {self.cache_pre.shape[2] - 1} (SpecConfig.nodes); make the drafter's spec match")
        return step

    def _replay(self, p: MambaParams) -> None:
        """Fold the previous call's accepted path into layer ``p.index``'s conv and SSM state (device-side)."""
        i = p.index
        cdim = self.cache_pre.shape[3]
        cols = self.replay_cols[:, :, None]  # (B, Lc, 1)
        pre = self.cache_pre[i].gather(1, cols.expand(-1, -1, cdim))  # (B, Lc, conv_dim) path first
        conv_state_advance(self.conv_state[i], pre, self.replay_count)
        post = self.cache_post[i].gather(1, cols.expand(-1, -1, cdim))  # (B, Lc, conv_dim)
        dt = self.cache_dt[i].gather(1, cols.expand(-1, -1, self.cache_dt.shape[3]))  # (B, Lc, H)
        x, B, C = p.split_xbc(post)
        ssm_multistep(self.ssm_state[i], x, dt, p.A, B, C, None, dt_bias=None, dt_softplus=False,
                      update_count=self.replay_count, store_state=True, output=False)

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """GDN form of ``mix``: fold the accepted path into the delta-rule state, verify the tree (module doc)."""
        i, L = p.index, step.length
        if step.rows != self.batch:
            raise ValueError(f"stree lays out one row per sequence ({self.batch}), got a call of {step.rows} rows")
        cols = self.replay_cols[:, :, None]  # (B, Lc, 1) path columns, root first
        cd, Hg = self.gdn_pre.shape[3], self.gdn_g.shape[3]
        conv_state_advance(self.gdn_conv_state[i], self.gdn_pre[i].gather(1, cols.expand(-1, -1, cd)), self.replay_count)
        qr, kr, vr = p.split(self.gdn_post[i].gather(1, cols.expand(-1, -1, cd)))
        gdn_multistep(self.gdn_state[i], qr, kr, vr, self.gdn_g[i].gather(1, cols.expand(-1, -1, Hg)),
                      self.gdn_beta[i].gather(1, cols.expand(-1, -1, Hg)), update_count=self.replay_count,
                      store_state=True, output=False)
        pre = inp.qkv if step.valid is None else inp.qkv * step.valid[..., None].to(inp.qkv.dtype)
        post = tree_conv1d(pre, self.gdn_conv_state[i], p.conv_weight, None, tree_mask=step.tree_mask,
                           activation=p.activation)
        q, k, v = p.split(post)
        g, beta = p.gates(inp.a, inp.b, step.valid)
        y, _ = gdn_tree_scan(self.gdn_state[i], q, k, v, g, beta, mask=step.tree_mask)
        self.gdn_pre[i, :, :L] = pre
        self.gdn_post[i, :, :L] = post
        self.gdn_g[i, :, :L] = g
        self.gdn_beta[i, :, :L] = beta
        return y

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Replay last call's accepted path, then verify the packed tree from the committed state."""
        i = p.index
        if step.rows != self.batch:
            raise ValueError(f"stree lays out one row per sequence ({self.batch}), got a call of {step.rows} rows")
        self._replay(p)
        xbc_in = inp.xbc if step.valid is None else inp.xbc * step.valid[..., None].to(inp.xbc.dtype)
        xbc = tree_conv1d(xbc_in, self.conv_state[i], p.conv_weight, p.conv_bias, tree_mask=step.tree_mask,
                          activation=p.activation)  # (B, L, conv_dim)
        x, B, C = p.split_xbc(xbc)  # (B, L, H, P), (B, L, G, N) x2
        dt = p.discretize(inp.dt, step.valid)  # (B, L, H) fp32, 0 on pads
        y = tree_scan(self.ssm_state[i], x, dt, p.A, B, C, p.D, tree_mask=step.tree_mask)  # (B, L, H, P)
        L = step.length
        self.cache_pre[i, :, :L] = xbc_in
        self.cache_post[i, :, :L] = xbc
        self.cache_dt[i, :, :L] = dt
        return y.reshape(*y.shape[:2], -1)

    def commit(self, verdict, step: StepInputs) -> None:
        """Record the accepted path (pending token + accepted nodes) for the next call's replay."""
        path = verdict.path  # (B, 1+Smax) node numbers, root first
        cols = path if step.node_col is None else step.node_col.gather(1, path)
        self.replay_cols.zero_()
        self.replay_cols[:, :cols.shape[1]] = cols
        self.replay_count.copy_(verdict.accepted + 1)
