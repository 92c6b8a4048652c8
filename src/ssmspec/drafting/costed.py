"""A draft model's cost at an oracle's stated acceptance: the throughput lines that draft with a real model
on random weights (``replay_fig8_throughput``'s draft-model lines).

A draft model with random weights is never right, so its own drafts would measure an acceptance of ~0 and
say nothing about the decode loop at a useful one. ``CostedOracle`` runs the model drafter in full every step
(the draft engine's absorb call and its S - 1 depth calls: the real drafting cost, timed inside the drafter
graph) and then proposes the oracle's tokens instead, at the oracle's designed acceptance. The draft is told
the verdict as in a real run (``observe``), so its absorb calls have a real run's shapes: it resumes from its
own state after as many of its drafts as the target accepted and feeds the emitted bonus. Its state then
follows its own drafts where the oracle's differ; a call's cost does not depend on the token values. Rows say ``acceptance: oracle`` and name the
draft whose cost they carry. Not registered (it needs an oracle's reference): the benchmarks build it.
"""
from __future__ import annotations

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.oracle import Oracle
from ssmspec.drafting.registry import DrafterBase


class CostedOracle(DrafterBase):
    """``oracle``'s drafts at the cost of ``drafter`` (a model drafter of the same spec) (module doc)."""

    name = "oracle"
    on_device = True

    def __init__(self, oracle: Oracle, drafter) -> None:
        super().__init__()
        if oracle.spec != drafter.spec:
            raise ValueError(f"the oracle drafts {oracle.spec} but the costed drafter {drafter.name} drafts "
                             f"{drafter.spec}; give both the same draft_len / num_drafts / tree")
        self.oracle, self.drafter = oracle, drafter
        self.spec, self.is_tree = oracle.spec, oracle.is_tree
        self._record(**oracle.describe(), draft_cost=drafter.describe())

    @property
    def engine(self):
        """The costed draft model's engine (what the benchmarks read the draft's time and size from)."""
        return self.drafter.engine

    def expected_accepted(self) -> float:
        return self.oracle.expected_accepted()

    def check_target(self, target) -> None:
        self.drafter.check_target(target)

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        self.oracle.reset(prompts, batch=batch, device=device, max_new_tokens=max_new_tokens)
        self.drafter.reset(prompts, batch=batch, device=device, max_new_tokens=max_new_tokens)

    def generators(self) -> list:
        return [*self.oracle.generators(), *self.drafter.generators()]

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        self.drafter.propose_device(buf)  # the draft model's whole step: its cost
        return self.oracle.propose_device(buf)

    def propose(self, history, pending) -> DraftTree:
        self.drafter.propose(history, pending)
        return self.oracle.propose(history, pending)

    def observe(self, verdict) -> None:
        self.oracle.observe(verdict)
        self.drafter.observe(verdict)  # the same spec: the verdict's layout is the drafter's
