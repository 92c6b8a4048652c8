"""STree Table 8 (seed 003, appendix C): end-to-end tokens/s and tau of STree drafting a static tree against STree
drafting the draft model's beam-search tree, greedy, beside autoregressive and vanilla speculative decoding --
``stree_tab8_beam``.

Lines (``bench/e2e_tree.py``'s ``Runner``: the engine's captured steps, timed as Table 3): ``autoregressive``;
``chain S=4`` (vanilla SD: the draft model's greedy chain of ``bench.chain_S``, ``bench.chain_strategy``); ``tree
A`` (``stree`` with the static shape ``bench.shape``: the draft's top-k tokens, Fig. 4a's 4 layers of 3, 13 tokens
a call with the pending one); ``beam 3x4`` (``stree`` with ``drafting/beam_tree.py``: a beam search of
``bench.beams`` M = 3 beams for ``bench.beam_depth`` N = 4 steps scored by summed log-probability, every beam's
token of every step kept: N layers of M nodes, the same 13 tokens a call as tree A, but which node extends which
is decided each step by the draft's joint probabilities).

Measured only (``trained.only`` in its yaml): the acceptance is what the trained draft earns on the trained
hybrid's prompts. The oracle cannot stand in here: it drafts a fixed shape and keeps each node with a designed
probability per sibling rank, so a beam tree would be one more static shape whose acceptance we would choose with
alpha and rank_decay -- the beam-vs-static difference Table 8 measures would be an input, not a result.

Paper (MambaInLlama-8B, RTX 3090, greedy, MT-Bench): tokens/s 39.98 / 67.68 / 69.84 / 71.60 (autoregressive,
vanilla SD, static tree, beam tree), tau 1 / 2.04 / 2.47 / 2.60.
"""
from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig

from ssmspec.bench.e2e_tree import Runner
from ssmspec.bench.tree_lines import Line, acceptance_table, beam_layers, chain, named_shape

WHAT = "stree_tab8_beam"


def run_tab8(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``stree_tab8_beam`` (module doc)."""
    b = cfg.bench
    run = Runner(cfg, WHAT)
    if run.kind != "draft" or not cfg.get("checkpoint"):
        raise ValueError(f"{WHAT} measures a trained draft model's beam search against its static tree; the oracle "
                         f"cannot draft a beam tree and a random-weight draft is never accepted: keep bench.trained "
                         f"(the trained pairs, trained.only) or give checkpoint=<target> with bench.drafter=draft "
                         f"and bench.draft_checkpoint=<its draft>")
    M, N, S = int(b.beams), int(b.beam_depth), int(b.chain_S)
    if S < 1:
        raise ValueError(f"{WHAT}: bench.chain_S is the chain's draft length, >= 1; got {S}")
    parents, name = named_shape(b.shape)
    beam = f"beam {M}x{N}"
    lines = [Line("autoregressive", "autoregressive"),
             Line(f"chain S={S}", str(b.chain_strategy), chain(S), shape=f"chain{S}"),
             Line(f"tree {name}", "stree", parents, shape=name),
             Line(beam, "stree", beam_layers(M, N), shape=beam, beams=M)]
    for preset in run.presets():
        for row in run.run(preset, lines, acceptance_table(b)):
            if row.get("draft_nodes"):
                row.update(tree="beam" if row["shape"] == beam else "chain" if row["line"].startswith("chain")
                           else "static", tree_tokens=row["draft_nodes"] + 1)
            yield row
