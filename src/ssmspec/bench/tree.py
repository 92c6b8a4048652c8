"""STree Fig. 3 (seed 003, section 5.1): one forward of a full binary token tree through a Mamba-2 mixer's
scan, packed vs unrolled -- ``stree_fig3_tree_forward``.

A full binary tree of depth d (levels, root = the pending token included) has n = 2^d - 1 nodes and
2^(d-1) root-to-leaf paths of d tokens. Every form starts from one committed state per sequence and gives
y for every node (what verification reads):

- ``packed``: the whole tree in one ``ops.tree_scan`` call under the ancestor mask (STree): 1 state, n tokens;
- ``unrolled``: the tree unrolled into its paths as rows of one fused scan (``ops.multistep.ssm_multistep``,
  the Snakes-and-Ladders kernel STree compares with as FSS): the inputs gathered per path, the committed
  state copied once per path, every path's final state stored (a batch of sequences keeps one state each),
  then each node's output gathered from a path through it: 2^(d-1) states, d·2^(d-1) tokens;
- ``unrolled_shared``: the same without the state copies (every path row reads the one committed state
  through ``state_batch_indices``, output only) -- the strongest unrolled form our kernel allows;
- ``chunk_scan_mamba_ssm``: mamba_ssm's ``mamba_chunk_scan_combined`` over the unrolled paths (initial
  states copied per path, final states returned); a ``skipped`` row where mamba_ssm cannot be imported.

Columns: time per call (CUDA-graph replay, ms_p50 / p20 / p80 and the raw samples; eager on CPU), ``states``
and ``tokens`` (seed 003 Fig. 3 Left), ``alloc_bytes`` -- the bytes of the tensors the form's own code
allocates per call (outputs, gathered inputs, state copies; not an op's internal temporaries) -- and on
CUDA ``peak_bytes``, the allocator's peak above what was allocated before one eager call
(``torch.cuda.max_memory_allocated``). ``bytes`` is the fewest bytes the form must move (for
``hbm_fraction``). Goal P8: at depth 6, packed >= 2x faster than unrolled at <= 0.5x its memory.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from omegaconf import DictConfig

from ssmspec.bench.kernels import Ctx, chain, make_inputs, mamba_ssm_ops, mixer_grid, random_states, state_bytes
from ssmspec.drafting.base import DraftTree
from ssmspec.ops.multistep import ssm_multistep
from ssmspec.ops.tree_scan import tree_scan

log = logging.getLogger("ssmspec.bench.tree")
FORMS = ("packed", "unrolled", "unrolled_shared", "chunk_scan_mamba_ssm")


def full_binary_tree(depth: int, bsz: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ancestor mask (B, n, n) bool, paths (2^(d-1), d) node numbers root first, first (n,) flat index
    into the unrolled (path, position) grid of one path through each node)."""
    if depth < 1:
        raise ValueError(f"stree_fig3_tree_forward: tree depth must be >= 1, got {depth}")
    n = 2 ** depth - 1
    parents = torch.tensor([(i - 1) // 2 for i in range(1, n)], dtype=torch.long).reshape(1, -1).expand(bsz, -1)
    mask = DraftTree(torch.zeros_like(parents), parents).ancestor_mask() if n > 1 else torch.ones(bsz, 1, 1, dtype=torch.bool)
    leaves = range(2 ** (depth - 1) - 1, n)
    paths = []
    for leaf in leaves:  # walk up to the root, then reverse
        p, node = [], leaf
        while True:
            p.append(node)
            if node == 0:
                break
            node = (node - 1) // 2
        paths.append(p[::-1])
    paths_t = torch.tensor(paths, dtype=torch.long)  # (leaves, d)
    first = torch.empty(n, dtype=torch.long)
    for flat in reversed(range(paths_t.numel())):  # the first (path, position) holding each node
        first[paths_t.view(-1)[flat]] = flat
    return mask.to(device), paths_t.to(device), first.to(device)


def _tree_inputs(bsz: int, n: int, z: dict, ctx: Ctx) -> dict:
    return make_inputs(bsz, n, z["H"], z["P"], z["G"], z["N"], ctx.dtype, ctx.device)


def _unroll(inp: dict, paths: torch.Tensor) -> dict:
    """Inputs of the paths as rows: x (B·leaves, d, H, P), dt (B·leaves, d, H), B, C (B·leaves, d, G, N)."""
    flat = paths.reshape(-1)
    out = {}
    for k in ("x", "dt", "B", "C"):
        t = inp[k].index_select(1, flat)  # (B, leaves·d, ...)
        out[k] = t.reshape(t.shape[0] * paths.shape[0], paths.shape[1], *t.shape[2:])
    return out


def _node_outputs(yu: torch.Tensor, bsz: int, first: torch.Tensor) -> torch.Tensor:
    """(B·leaves, d, H, P) path outputs -> (B, n, H, P) node outputs (one path through each node)."""
    return yu.reshape(bsz, -1, *yu.shape[2:]).index_select(1, first)


def _form(form: str, st: torch.Tensor, inp: dict, mask, paths, first, chunk, chunk_size: int,
          allocated: list[int]) -> Callable[[], object]:
    """One call of ``form`` from committed state ``st`` (B, H, P, N); appends the bytes of the tensors the call
    allocates to ``allocated`` on its first run (the same every run: shapes are fixed)."""
    bsz = st.shape[0]
    leaves = paths.shape[0]
    A, D, bias = inp["A"], inp["D"], inp["dt_bias"]
    rows = torch.arange(bsz, device=st.device).repeat_interleave(leaves)  # (B·leaves,) path row -> sequence

    def record(*ts: torch.Tensor) -> None:
        if not allocated:
            allocated.append(sum(t.numel() * t.element_size() for t in ts))

    def packed():
        y = tree_scan(st, inp["x"], inp["dt"], A, inp["B"], inp["C"], D, tree_mask=mask, dt_bias=bias,
                      dt_softplus=True)  # (B, n, H, P)
        record(y)

    def unrolled():
        u = _unroll(inp, paths)
        states = st.repeat_interleave(leaves, dim=0)  # (B·leaves, H, P, N): one state per sequence of the batch
        yu = ssm_multistep(states, u["x"], u["dt"], A, u["B"], u["C"], D, dt_bias=bias, dt_softplus=True)
        y = _node_outputs(yu, bsz, first)
        record(*u.values(), states, yu, y)

    def unrolled_shared():
        u = _unroll(inp, paths)
        yu = ssm_multistep(st, u["x"], u["dt"], A, u["B"], u["C"], D, dt_bias=bias, dt_softplus=True,
                           state_batch_indices=rows, store_state=False)
        y = _node_outputs(yu, bsz, first)
        record(*u.values(), yu, y)

    def chunk_scan():
        u = _unroll(inp, paths)
        states = st.repeat_interleave(leaves, dim=0)
        yu, final = chunk(u["x"], u["dt"], A, u["B"], u["C"], chunk_size=chunk_size, D=D, dt_bias=bias,
                          dt_softplus=True, initial_states=states, return_final_states=True)
        y = _node_outputs(yu, bsz, first)
        record(*u.values(), states, yu, final, y)

    return {"packed": packed, "unrolled": unrolled, "unrolled_shared": unrolled_shared,
            "chunk_scan_mamba_ssm": chunk_scan}[form]


def min_bytes(form: str, bsz: int, depth: int, z: dict, act: int) -> int:
    """Fewest bytes ``form`` must move per call: inputs read and outputs written once per pass over them."""
    H, P, G, N = z["H"], z["P"], z["G"], z["N"]
    n, leaves = 2 ** depth - 1, 2 ** (depth - 1)
    sb = state_bytes(bsz, H, P, N)
    node_io = H * P * act * 2 + 2 * G * N * act + H * act  # x read, y written, B, C, dt read
    node_in = H * P * act + 2 * G * N * act + H * act
    if form == "packed":
        return sb + bsz * n * node_io
    tokens = bsz * leaves * depth
    gather = bsz * n * node_in + tokens * node_in + 2 * bsz * n * H * P * act  # unroll inputs, gather outputs
    if form == "unrolled_shared":
        return gather + leaves * sb + tokens * node_io  # each path row reads the committed state
    return gather + sb + leaves * sb + 2 * leaves * sb + tokens * node_io  # copy, then read + store per path


def _peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Allocator peak above the bytes allocated before one eager call of ``fn`` (CUDA only)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_stree_fig3(cfg: DictConfig) -> Iterator[dict]:
    """Per mixer preset, batch and tree depth: time and memory of the packed tree scan vs the unrolled forms."""
    b = cfg.bench
    unknown = [f for f in b.forms if f not in FORMS]
    if unknown:  # before any measurement
        raise ValueError(f"stree_fig3_tree_forward: unknown form(s) {unknown}; choose from {', '.join(FORMS)}")
    ctx = Ctx(cfg)
    _, chunk_m, why = mamba_ssm_ops()
    for preset, z, bsz in mixer_grid(b, device=ctx.device):
        for depth in b.depth:
            mask, paths, first = full_binary_tree(int(depth), bsz, ctx.device)
            n, leaves = mask.shape[-1], paths.shape[0]
            inp = _tree_inputs(bsz, n, z, ctx)
            sb = state_bytes(bsz, z["H"], z["P"], z["N"])
            rot = ctx.rotation(sb)
            base = dict(model=preset, batch=bsz, depth=int(depth), nodes=n, paths=leaves, rot=rot, **z)
            for form in b.forms:
                packed = form == "packed"
                shape = dict(states=1 if packed or form == "unrolled_shared" else leaves,
                             tokens=n if packed else leaves * int(depth))
                if form == "chunk_scan_mamba_ssm" and chunk_m is None:
                    yield dict(base, impl=form, **shape, status="skipped", reason=why)
                    continue
                states = random_states(rot, (bsz, z["H"], z["P"], z["N"]), ctx.device)
                allocated: list[int] = []
                fns = [_form(form, s, inp, mask, paths, first, chunk_m, int(b.chunk_size), allocated) for s in states]
                fns[0]()  # eager once: records the allocated bytes, compiles the kernels
                peak = _peak_bytes(fns[0], ctx.device) if ctx.cuda else None
                samples = ctx.time(chain(fns), per_call=rot)
                nbytes = min_bytes(form, bsz, int(depth), z, ctx.dtype.itemsize)
                yield ctx.row(samples, nbytes, **base, impl=form, **shape, alloc_bytes=allocated[0], peak_bytes=peak)
                del states, fns
            ctx.sync()
