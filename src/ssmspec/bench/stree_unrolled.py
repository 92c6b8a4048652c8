"""STree Table 2 (seed 003, section 5.1): decoding with beam-search-shaped token trees, STree's packed tree
(``stree``, one call over the tree under its ancestor mask) against the unrolled tree (one chain per root-to-leaf
path through the fused multi-step scan of ``activation_replay``, the seed's "FSS on unrolled input") --
``stree_tab2_unrolled``.

The beam tree of M beams and N steps keeps every token a beam search of the draft model generates, also those of
beams discarded later: N layers of M nodes, the j-th node of a layer a child of node j // 2 of the layer above
(``beam_tree``), so nodes j >= ceil(M / 2) of every layer but the last are leaves. Unrolled, the tree is one chain
per leaf, each padded to depth N (``UnrolledTree``: the same draft tokens, gathered along the paths; padding is
never accepted), D = M + (N - 1) * (M - ceil(M / 2)) chains of N drafts against the packed 1 + M N tokens.

Acceptance, stated: the oracle per branch at ``bench.alpha`` (``bench.rank_decay`` for later siblings), forced
(greedy verification takes its kept nodes; the unrolled chains carry the same verdicts, gathered), so both forms
accept the same lengths from the same draws, as in the seed (same tree, same acceptance). Rows: tokens/s (the
engine's captured steps, ``bench/e2e.py``), tau, ``tokens_per_call``, ``planned_bytes`` (engine.memory's plan of
the engine beside the weights) and, on CUDA, ``peak_bytes`` (the allocator's peak over prefill and the timed
steps). Paper (Mamba2-2.7B, RTX 3090): packed up to 1.49x faster at 0.57x the memory; the unrolled form ran out
of memory at M = 4, 5 with N = 16.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec.bench.e2e_tree import Runner
from ssmspec.bench.tree_lines import Line, acceptance_table
from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.registry import DrafterBase
from ssmspec.drafting.static_tree import check_parents
from ssmspec.strategies import SpecConfig


def beam_tree(M: int, N: int) -> list[int]:
    """Parents list of the M-beam, N-step beam tree (module doc): node (l, j) = 1 + l M + j, l = 0 .. N-1."""
    if M < 1 or N < 1:
        raise ValueError(f"a beam tree needs M >= 1 beams and N >= 1 steps, got M={M}, N={N}")
    return [0 if layer == 0 else 1 + (layer - 1) * M + j // 2 for layer in range(N) for j in range(M)]


def leaf_paths(parents: list[int]) -> tuple[list[list[int]], int]:
    """Root-to-leaf paths of node numbers (1..T, root excluded) of every leaf, and the depth N."""
    T = len(parents)
    has_child = [False] * (T + 1)
    for par in parents:
        has_child[par] = True
    paths = []
    for leaf in range(1, T + 1):
        if has_child[leaf]:
            continue
        path, v = [], leaf
        while v:
            path.append(v)
            v = parents[v - 1]
        paths.append(path[::-1])
    return paths, max(check_parents(parents))


class UnrolledTree(DrafterBase):
    """A tree drafter's drafts as one chain per root-to-leaf path, padded to the tree's depth (module doc)."""

    name = "unrolled"
    on_device = True

    def __init__(self, tree_drafter, parents: list[int]) -> None:
        super().__init__()
        if not getattr(tree_drafter, "forced", False):
            raise ValueError("the unrolled tree repeats a node's token on every path through it, and its padding "
                             "must never be accepted: it needs the forced oracle (bench.oracle=forced)")
        self.inner = tree_drafter
        paths, depth = leaf_paths(parents)
        self.depth, self.num_paths = depth, len(paths)
        # (D * N,) node index - 1 per chain position (pads repeat the leaf) and whether it is a real node
        self._idx = [p[min(s, len(p) - 1)] - 1 for p in paths for s in range(depth)]
        self._real = [s < len(p) for p in paths for s in range(depth)]
        self.spec = SpecConfig(draft_len=depth, num_drafts=len(paths))
        self.on_device = bool(getattr(tree_drafter, "on_device", False))
        self._record(paths=len(paths), depth=depth)

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        self.inner.reset(prompts, batch=batch, device=device, max_new_tokens=max_new_tokens)
        self.idx = torch.tensor(self._idx, device=device)
        self.real = torch.tensor(self._real, device=device)

    def generators(self) -> list:
        return self.inner.generators()

    def _unroll(self, tree: DraftTree) -> DraftTree:
        bsz = tree.tokens.shape[0]
        chains = DraftTree.from_chains(tree.tokens[:, self.idx].reshape(bsz, self.num_paths, self.depth))
        chains.match = tree.match[:, self.idx] & self.real[None]  # the tree's verdicts; pads never accepted
        return chains

    def propose_device(self, buf) -> DraftTree:
        return self._unroll(self.inner.propose_device(buf))

    def propose(self, history, pending) -> DraftTree:
        return self._unroll(self.inner.propose(history, pending))


class _UnrolledRunner(Runner):
    """Runner of bench/e2e_tree.py whose ``unrolled`` lines draft through ``UnrolledTree`` and whose rows hold the
    allocator's peak on CUDA."""

    def drafter(self, model, line: Line, **kw):
        d, expect = super().drafter(model, line, **kw)
        if line.verify == "unrolled":
            d = UnrolledTree(d, line.parents)
        return d, expect

    def point(self, model, line: Line, **kw) -> dict:
        cuda = str(self.device).startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            weights = torch.cuda.memory_allocated()
        row = super().point(model, line, **kw)
        if cuda and row.get("status") == "ok":
            row["peak_bytes"] = int(torch.cuda.max_memory_allocated() - weights)
        return row


def run_stree_unrolled(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``stree_tab2_unrolled`` (module doc)."""
    b = cfg.bench
    if str(b.get("oracle", "forced")) != "forced" or str(b.get("drafter", "oracle")) != "oracle":
        raise ValueError("stree_tab2_unrolled: both forms must accept the same lengths from the same draws, so it "
                         "runs the forced oracle only (bench.drafter=oracle, bench.oracle=forced)")
    shapes = [(int(M), int(N)) for M in b.beams for N in b.steps]
    if not shapes or min(min(s) for s in shapes) < 1:
        raise ValueError(f"stree_tab2_unrolled: bench.beams and bench.steps need values >= 1, got {list(b.beams)}, "
                         f"{list(b.steps)}")
    run = _UnrolledRunner(cfg, "stree_tab2_unrolled")
    lines = [Line("autoregressive", "autoregressive")]
    for M, N in shapes:
        parents = beam_tree(M, N)
        name = f"M={M} N={N}"
        lines += [Line(f"packed {name}", "stree", parents, shape=name),
                  Line(f"unrolled {name}", str(b.unrolled_strategy), parents, verify="unrolled", shape=name)]
    for preset in run.presets():
        for row in run.run(preset, lines, acceptance_table(b)):
            if row.get("shape"):
                M, N = (int(x.split("=")[1]) for x in row["shape"].split())
                row.update(beams=M, steps=N, form=row["line"].split()[0],
                           tree_tokens=1 + M * N, paths=len(leaf_paths(beam_tree(M, N))[0]))
            yield row
