"""Chain drafts laid out one model row per chain (shared by the chain-only strategies snapshot,
activation_replay and joint_attainment).

Seed 001 (Sec. 5.3) verifies D drafts of a sequence as D batch rows: row b*D + d holds [pending, chain d]
of sequence b, every row starts from its sequence's state, and after the verdict the accepted chain's row
is the one whose inputs are kept. A serial scan cannot verify a token tree in one row, so these strategies
take chains only; tree drafts go to `stree` or `replay`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.strategies.base import SpecConfig, StepInputs


def check_chain_drafts(drafts, spec: SpecConfig, name: str) -> None:
    """Refuse drafts that are not ``spec.num_drafts`` chains of ``spec.draft_len`` tokens (host-side shape
    facts only, no tensor data is read)."""
    if drafts is None:
        if spec.draft_len:
            raise ValueError(f"strategy {name!r} was allocated for S={spec.draft_len} drafts but got none; "
                             f"pass the drafter to generate() or use draft_len 0")
        return
    if not drafts.num_chains:
        raise ValueError(f"strategy {name!r} verifies chains only, but the drafter proposed a token tree; use a "
                         f"chain drafter (oracle, png) or a tree strategy (stree, replay)")
    if drafts.num_chains != spec.num_drafts or drafts.chain_len != spec.draft_len:
        raise ValueError(f"the drafter proposed {drafts.num_chains} chain(s) of {drafts.chain_len} tokens but "
                         f"{name!r} was allocated for num_drafts={spec.num_drafts}, draft_len={spec.draft_len} "
                         f"(SpecConfig); make the drafter's spec match")


def chain_rows(pending: Tensor, drafts, seq_len: Tensor, spec: SpecConfig) -> tuple[Tensor, Tensor]:
    """[pending, chain d] for every sequence b and chain d, as rows b*D + d.

    pending (B,), drafts (B, D*S) chain tokens (or None: S = 0), seq_len (B,) tokens before the pending one.
    Returns tokens (B, D, 1+S) and positions (B, D, 1+S).
    """
    bsz, D, S = pending.shape[0], spec.num_drafts, spec.draft_len
    chains = (drafts.tokens.reshape(bsz, D, S) if drafts is not None
              else pending.new_zeros(bsz, D, 0))  # (B, D, S)
    tokens = torch.cat([pending[:, None, None].expand(bsz, D, 1), chains], dim=2)  # (B, D, 1+S)
    positions = (seq_len[:, None, None] + torch.arange(1 + S, device=pending.device)).expand(bsz, D, 1 + S)
    return tokens, positions


def chain_node_places(bsz: int, spec: SpecConfig, *, rows_per_seq: int, first_row: int, first_col: int,
                      device) -> tuple[Tensor, Tensor]:
    """Where each tree node of a chain draft sits when chain d of sequence b is the row
    b*rows_per_seq + first_row + d starting at column first_col (the pending token, node 0, is read in
    chain 0's row). Returns node_row, node_col (B, 1+D*S)."""
    D, S = spec.num_drafts, spec.draft_len
    node = torch.arange(1 + D * S, device=device)  # (1+T,)
    chain = (node - 1).clamp(min=0) // max(S, 1)  # node 0 -> chain 0
    depth = torch.where(node == 0, 0, (node - 1) % max(S, 1) + 1)
    rows = torch.arange(bsz, device=device)[:, None] * rows_per_seq + first_row + chain[None]  # (B, 1+T)
    cols = (first_col + depth)[None].expand(bsz, -1)
    return rows, cols.contiguous()


def accepted_chain(verdict, draft_len: int) -> Tensor:
    """(B,) chain index d of each sequence's accepted path (0 when no draft was accepted)."""
    return (verdict.last_node - 1).clamp(min=0) // max(draft_len, 1)


def layout_chain_rows(pending: Tensor, drafts, seq_len: Tensor, spec: SpecConfig, name: str) -> StepInputs:
    """One row per chain: rows b*D + d = [pending, chain d] (D = 1: the plain one-row-per-sequence layout)."""
    check_chain_drafts(drafts, spec, name)
    bsz, D = pending.shape[0], spec.num_drafts
    tokens, positions = chain_rows(pending, drafts, seq_len, spec)  # (B, D, 1+S)
    L = tokens.shape[2]
    if D == 1:
        return StepInputs(input_ids=tokens[:, 0], positions=positions[:, 0].contiguous())
    node_row, node_col = chain_node_places(bsz, spec, rows_per_seq=D, first_row=0, first_col=0,
                                           device=pending.device)
    return StepInputs(input_ids=tokens.reshape(bsz * D, L), positions=positions.reshape(bsz * D, L),
                      seq_index=torch.arange(bsz, device=pending.device).repeat_interleave(D),
                      node_row=node_row, node_col=node_col)
