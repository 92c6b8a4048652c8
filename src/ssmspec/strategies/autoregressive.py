"""`autoregressive`: the baseline. One state per sequence and layer, updated in place token by token
(seed 000, Alg. 1); no speculation."""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.causal_conv1d import causal_conv1d_update
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.strategies.base import MambaParams, MixerInputs, StepInputs, StrategyBase, register_strategy


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
