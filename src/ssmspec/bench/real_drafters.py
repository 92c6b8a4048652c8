"""The real drafters of a model pair, built one way wherever their acceptance is measured: ``trained_acceptance``
(bench/trained.py) and its throughput rows (bench/trained_throughput.py), and the (acc) rows of the end-to-end
experiments (bench/e2e.py, bench/cost_model.py) on a checkpoint or a trained pair (bench/trained_rows.py).
Imports nothing from bench/, so every one of them can."""
from __future__ import annotations


def measured_drafter(name: str, *, target, draft, **options):
    """A real drafter: ``mtp`` chains ``target``'s own MTP head, ``png`` looks up the prompt's n-grams (``options``:
    ngram, min_ngram, num_drafts, ...), every other drafter (draft_model, beam_tree, static_tree) drafts with the
    model ``draft``; ``options`` go to ``make_drafter`` (draft_len, ...)."""
    from ssmspec.drafting import make_drafter

    if name == "mtp":
        return make_drafter(name, target=target, **options)
    if name == "png":
        return make_drafter(name, **options)
    return make_drafter(name, draft=draft, **options)
