"""`autoregressive`: the baseline. One state per sequence and layer, updated in place token by token
(seed 000, Alg. 1); no speculation. With ``SSMSPEC_DECODE_FUSION`` naming ``conv_ssm`` (or ``all``; opt-in:
``ops.dispatch.decode_fusion``) a one-token call on the Triton backend runs the mixer's conv and SSM update in one
launch (``ops.conv_ssm_update``); several tokens, and the reference backend, take the conv update then one
``selective_state_update`` per token. Gated DeltaNet mixers: the recurrent update (``ops.gdn.gdn_multistep``, the
delta-rule state in place) token after token."""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.ops.causal_conv1d import causal_conv1d_update
from ssmspec.ops.conv_ssm_update import conv_ssm_update
from ssmspec.ops.dispatch import decode_fusion, use_triton
from ssmspec.ops.gdn import gdn_multistep
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, SpecConfig, StepInputs,
                                     StrategyBase, register_strategy)


@register_strategy("autoregressive")
class Autoregressive(StrategyBase):
    speculative = False

    def allocate(self, cfg: ModelConfig, batch: int, spec: SpecConfig, device, dtype) -> None:
        super().allocate(cfg, batch, spec, device, dtype)
        self.conv_ssm_counters: Tensor | None = None  # (n_mamba, B, G) int32, made by the first fused call

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Feed the call's L tokens one after another into the state (L = 1 in standard decoding)."""
        conv_state, ssm_state = self.conv_state[p.index], self.ssm_state[p.index]
        if inp.xbc.shape[1] == 1 and "conv_ssm" in decode_fusion() and use_triton(inp.xbc, conv_state, ssm_state):
            y = conv_ssm_update(inp.xbc[:, 0], conv_state, p.conv_weight, p.conv_bias, ssm_state, inp.dt[:, 0], p.A,
                                p.D, p.dt_bias, heads=p.heads, head_dim=p.head_dim, groups=p.groups,
                                state_size=p.state_size, dt_limit=p.dt_limit, activation=p.activation,
                                workspace=self._counters(p.index), backend="triton")  # both states in place
            return y[:, None]  # (B, 1, H*P)
        xbc = causal_conv1d_update(inp.xbc, conv_state, p.conv_weight, p.conv_bias, activation=p.activation)  # in place
        x, B, C = p.split_xbc(xbc)  # (B, L, H, P), (B, L, G, N) x2
        ys = [selective_state_update(ssm_state, x[:, t], inp.dt[:, t], p.A, B[:, t], C[:, t], p.D,
                                     dt_bias=p.dt_bias, dt_softplus=True, dt_limit=p.dt_limit)
              for t in range(x.shape[1])]
        y = ys[0].unsqueeze(1) if len(ys) == 1 else torch.stack(ys, dim=1)  # (B, L, H, P); L = 1: a view, no copy
        return y.reshape(*y.shape[:2], -1)

    def _counters(self, index: int) -> Tensor:
        """Mixer ``index``'s (B*G,) zeros that ``conv_ssm_update`` counts its B/C conv-state readers in (and
        leaves zero): one set per mixer and strategy, so no two launches in flight share one."""
        if self.conv_ssm_counters is None:
            n, c = self.conv_state.shape[0], self.cfg
            self.conv_ssm_counters = torch.zeros(n, self.batch * c.n_groups, dtype=torch.int32,
                                                 device=self.conv_state.device)
        return self.conv_ssm_counters[index]

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """The call's L tokens through the conv (state in place) and the gated delta rule (state in place)."""
        qkv = causal_conv1d_update(inp.qkv, self.gdn_conv_state[p.index], p.conv_weight, None, activation=p.activation)
        q, k, v = p.split(qkv)
        g, beta = p.gates(inp.a, inp.b)
        return gdn_multistep(self.gdn_state[p.index], q, k, v, g, beta)  # (B, L, H, P)
