"""Distillation of a draft from its frozen target (issue 24): the draft minimises KL(target || draft) of the
next-token distributions at temperature 1, token by token, on the same windows the target trained on. The
loop is the target's (``trainer.fit``); only the loss differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.models.model import HybridLM
from ssmspec.train.forward import train_logits
from ssmspec.train.trainer import LossFn


def kl_to_target(target: HybridLM) -> LossFn:
    """loss(draft, windows (B, L + 1)) = mean over the B * L positions of KL(p_target || p_draft) in nats."""
    target.eval().requires_grad_(False)

    def loss(draft: HybridLM, windows: Tensor) -> Tensor:
        ids = windows[:, :-1]
        with torch.no_grad():
            t = train_logits(target, ids).float().log_softmax(-1)  # (B, L, V)
        d = train_logits(draft, ids).float().log_softmax(-1)
        return F.kl_div(d, t, log_target=True, reduction="none").sum(-1).mean()

    return loss
