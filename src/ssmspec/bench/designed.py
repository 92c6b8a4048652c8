"""Designed beside measured acceptance in the rows of the end-to-end experiments.

An oracle line's acceptance is designed: its law (``drafting/oracle.py``) has an exact mean accepted length
E[a] (``expected_accepted``). Over the steps a run times, the accepted counts the engine saw are a sample of that
law, so every speculative oracle row reports both:

- ``tokens_per_s`` (measured): emitted tokens / summed step time;
- ``tokens_per_s_designed``: designed tokens / summed step time, designed tokens = sequence-steps x (1 + E[a])
  (batch x (1 + E[a]) per step: the mean step time times the designed tokens per step);
- ``mean_accepted`` (measured) and ``expected_accepted`` (designed), ``accepted_gap`` = measured / designed - 1
  and ``accepted_within``: |gap| <= ``ACCEPTED_TOLERANCE`` (``accepted_tolerance``, written beside it for the figures);
- ``sequence_steps``: the (sequence, step) pairs behind the measured mean, and ``steps_needed``: the a-priori
  count of steps per sequence the law asks for (``drafting/weyl.py: steps_needed``; None for pseudo-random draws).

Designed tokens/s prices the steps that ran at the designed acceptance; when the measured mean is within the
band it differs from the measured tokens/s by the same few percent at most. Lines without drafts report
tokens_per_s_designed = tokens_per_s (one token a step either way); measured drafters (PNG, a draft model)
have no designed acceptance and report None.
"""
from __future__ import annotations

ACCEPTED_TOLERANCE = 0.02  # measured mean accepted length within 2% of the designed one


def designed_fields(*, expected: float | None, accepted: list[int], seconds: float, tokens_per_s: float) -> dict:
    """Row fields of one line (module doc). ``expected``: E[a] of the oracle's law (0.0: no drafts; None: measured
    acceptance); ``accepted``: accepted drafts of every counted (sequence, step); ``seconds``: summed step time."""
    n = len(accepted)
    out = dict(sequence_steps=n, tokens_per_s_designed=None, accepted_gap=None, accepted_within=None)
    if expected is None:
        return out
    if expected == 0.0:  # no drafts: one token a step, designed = measured
        out["tokens_per_s_designed"] = tokens_per_s
        return out
    measured = sum(accepted) / n if n else 0.0
    gap = measured / expected - 1.0
    out.update(tokens_per_s_designed=n * (1.0 + expected) / seconds, accepted_gap=gap,
               accepted_within=bool(abs(gap) <= ACCEPTED_TOLERANCE), accepted_tolerance=ACCEPTED_TOLERANCE)
    return out
