"""Single-token Mamba-2 state update (the `autoregressive` baseline)."""
from ssmspec.ops.selective_state_update.naive import selective_state_update_ref

selective_state_update = selective_state_update_ref

__all__ = ["selective_state_update", "selective_state_update_ref"]
