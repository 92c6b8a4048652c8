"""`autoregressive`: the baseline. One state per sequence and layer, updated in place token by token
(seed 000, Alg. 1); no speculation. Gated DeltaNet mixers: the recurrent update (``ops.gdn.gdn_multistep``, the
delta-rule state in place) token after token."""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update
from ssmspec.ops.gdn import gdn_multistep
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, StepInputs, StrategyBase,
                                     register_strategy)


@register_strategy("autoregressive")
class Autoregressive(StrategyBase):
    speculative = False

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        """Feed the call's L tokens one after another into the state (L = 1 in standard decoding)."""
        conv_state, ssm_state = self.conv_state[p.index], self.ssm_state[p.index]
        xbc = causal_conv1d_update(inp.xbc, conv_state, p.conv_weight, p.conv_bias, activation=p.activation)  # in place
        x, B, C = p.split_xbc(xbc)  # (B, L, H, P), (B, L, G, N) x2
        ys = [selective_state_update(ssm_state, x[:, t], inp.dt[:, t], p.A, B[:, t], C[:, t], p.D,
                                     dt_bias=p.dt_bias, dt_softplus=True, dt_limit=p.dt_limit)
              for t in range(x.shape[1])]
        y = ys[0].unsqueeze(1) if len(ys) == 1 else torch.stack(ys, dim=1)  # (B, L, H, P); L = 1: a view, no copy
        return y.reshape(*y.shape[:2], -1)

    def mix_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        """The call's L tokens through the conv (state in place) and the gated delta rule (state in place)."""
        qkv = causal_conv1d_update(inp.qkv, self.gdn_conv_state[p.index], p.conv_weight, None, activation=p.activation)
        q, k, v = p.split(qkv)
        g, beta = p.gates(inp.a, inp.b)
        return gdn_multistep(self.gdn_state[p.index], q, k, v, g, beta)  # (B, L, H, P)
