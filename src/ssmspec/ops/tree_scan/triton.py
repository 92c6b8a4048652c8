"""Triton kernels for STree's packed token tree (seed 003, section 3 "Implementation"): the tree-masked scan
from the committed state (output only) and the depthwise conv over ancestors.

Scan. One program owns (sequence, head, BLOCK_P columns of P, BLOCK_T tree nodes). It is Mamba-2's
intra-chunk SSD step with the causal mask replaced by the ancestor mask (seed 003 eq. 5-6):
    acc_t = Σ_j mask[t, j]·A·dt_j                                   (A_tree: accumulated log-decay)
    y_t   = exp(acc_t)·(C_t S0ᵀ) + Σ_j mask[t, j]·exp(acc_t − acc_j)·dt_j·(C_t·B_j)·x_j + D·x_t
i.e. two small GEMMs per block pair, C_t Bᵀ (BLOCK_T x BLOCK_T) and W x (BLOCK_T x BLOCK_P), plus the
checkpoint readout C S0ᵀ. Nothing of size (L, L, H) is ever written to memory (the reference materialises
three of them) and no per-node state exists; the state is read, never written, so there is no race. Nodes
must be in topological order (ancestors first, as ``DraftTree`` lays them out): the column blocks after a
row block hold no ancestors and are skipped.

Conv. One program owns (sequence, BLOCK_C channels, BLOCK_T nodes). In topological order the ancestors of
t are a chain whose indices increase towards t, so t's k-th nearest ancestor is the node j with mask[t, j]
and exactly k ancestors-or-self of t after it: a reverse prefix count over t's mask row finds it, without
any depth table. Where the tree above t is shallower than k, the tap reads the committed conv state.

The readout C_t S0ᵀ runs over the state width in steps of BLOCK_R columns (one step by default): at 64 nodes
and N = 128 a whole fp32 C tile and state tile at once are 64 KB of registers a program. Its products are one
tf32 product on tensor cores by default for 16-bit inputs (a relative error near 4e-4, ten times below the
rounding of the bf16 y it feeds) and exact fp32 ("ieee") for fp32 inputs; tf32x3 is the middle
(``scan_launch``'s ``readout``). The diagonal node block reuses the rows' A_tree; only blocks before it
compute their columns'.

Neither kernel writes state (an autotuner could replay them safely), but their block sizes are fixed by
hand (``_scan_blocks``, ``scan_launch``) so that no first call inside a CUDA-graph capture has to benchmark;
``python -m ssmspec.bench.tree_scan_sweep`` times the launch options against the unrolled paths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.dispatch import interpret_mode
from ssmspec.ops.triton_common import check_float, discretize, dummy, has_limit, limit_args, silu


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; exact fp32 products when IEEE (fp32 inputs, and 16-bit inputs under the
    CPU interpreter, whose bf16 tl.dot returns garbage in Triton 3.x: the products of 16-bit values are exact
    in fp32, so the result is the same), else on the operands' dtype (tensor cores)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _log_decay(dt_ptr, offs, valid, A, bias, lo, hi, dt_l, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """(dt_j, A·dt_j) of nodes ``offs`` (fp32, 0 outside ``valid``)."""
    d = tl.load(dt_ptr + offs * dt_l, mask=valid, other=0.0).to(tl.float32)
    d = tl.where(valid, discretize(d, bias, lo, hi, DT_SOFTPLUS, HAS_LIMIT), 0.0)
    return d, A * d


@triton.jit
def _ancestors(mask_ptr, rows, cols, L, m_t, m_j, IS_CAUSAL: tl.constexpr):
    """(len(rows), len(cols)) bool: node cols[j] is rows[i] or one of its ancestors."""
    inside = (rows[:, None] < L) & (cols[None, :] < L)
    if IS_CAUSAL:
        return inside & (cols[None, :] <= rows[:, None])
    m = tl.load(mask_ptr + rows[:, None] * m_t + cols[None, :] * m_j, mask=inside, other=0)
    return inside & (m != 0)


@triton.jit
def _acc_tree(mask_ptr, dt_ptr, rows, n_blocks, L, A, bias, lo, hi, m_t, m_j, dt_l,
              IS_CAUSAL: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr):
    """A_tree of nodes ``rows`` (seed 003 eq. 6): Σ of A·dt over ancestors-or-self in column blocks < n_blocks."""
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for kb in range(0, n_blocks):
        cols = kb * BLOCK_T + tl.arange(0, BLOCK_T)
        _, a = _log_decay(dt_ptr, cols, cols < L, A, bias, lo, hi, dt_l, DT_SOFTPLUS, HAS_LIMIT)
        anc = _ancestors(mask_ptr, rows, cols, L, m_t, m_j, IS_CAUSAL)
        acc += tl.sum(tl.where(anc, a[None, :], 0.0), axis=1)
    return acc


@triton.jit
def _readout(c, s, PREC: tl.constexpr):
    """c @ s for the checkpoint readout, fp32 operands: exact fp32 products (0, "ieee"), three tf32 products
    (1, "tf32x3": about fp32's accuracy on tensor cores) or one (2, "tf32")."""
    if PREC == 0:
        return tl.dot(c, s, input_precision="ieee")
    if PREC == 1:
        return tl.dot(c, s, input_precision="tf32x3")
    return tl.dot(c, s, input_precision="tf32")


@triton.jit
def _pair_block(C_t, B_base, x_base, mask_base, rows, cols, acc_t, acc_j, dt_j, offs_n, offs_p, mask_n, mask_p,
                L, B_l, B_n, x_l, x_p, m_t, m_j, IS_CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Σ_j over the column block ``cols`` of mask[t, j]·exp(acc_t − acc_j)·dt_j·(C_t·B_j)·x_j, (BLOCK_T, BLOCK_P)."""
    col_ok = cols < L
    B_j = tl.load(B_base + cols[:, None] * B_l + offs_n[None, :] * B_n,
                  mask=col_ok[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_T, BLOCK_N)
    cb = _dot(C_t, tl.trans(B_j), IEEE)  # (BLOCK_T, BLOCK_T) C_t·B_j
    anc = _ancestors(mask_base, rows, cols, L, m_t, m_j, IS_CAUSAL)
    # exp(acc_t − acc_j) on ancestor pairs only (the exponent of a non-ancestor pair can be positive)
    decay = tl.exp(tl.where(anc, acc_t[:, None] - acc_j[None, :], float("-inf")))
    w = cb * decay * dt_j[None, :]  # (BLOCK_T, BLOCK_T)
    x_j = tl.load(x_base + cols[:, None] * x_l + offs_p[None, :] * x_p,
                  mask=col_ok[:, None] & mask_p[None, :], other=0.0)  # (BLOCK_T, BLOCK_P)
    return _dot(w.to(x_j.dtype), x_j, IEEE)


@triton.jit
def _tree_scan_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, mask_ptr, y_ptr,
    L, H, P, N, heads_per_group, lo, hi,
    s_b, s_h, s_p, s_n,
    x_b, x_l, x_h, x_p,
    dt_b, dt_l, dt_h,
    B_b, B_l, B_g, B_n,
    C_b, C_l, C_g, C_n,
    m_b, m_t, m_j,
    y_b, y_l, y_h, y_p,
    IS_CAUSAL: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr, READOUT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_p = tl.program_id(0)
    bh = tl.program_id(1)
    tb = tl.program_id(2)
    b = bh // H
    h = bh % H
    g = h // heads_per_group
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) the nodes this program writes
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = rows < L
    mask_p = offs_p < P
    mask_n = offs_n < N
    A = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    else:
        bias = 0.0
    dt_base = dt_ptr + b * dt_b + h * dt_h
    mask_base = mask_ptr + b * m_b
    x_base = x_ptr + b * x_b + h * x_h
    B_base = B_ptr + b * B_b + g * B_g
    C_base = C_ptr + b * C_b + g * C_g
    # rows' A_tree; ancestors of a row block lie in column blocks <= tb (topological order)
    acc_t = _acc_tree(mask_base, dt_base, rows, tb + 1, L, A, bias, lo, hi, m_t, m_j, dt_l,
                      IS_CAUSAL, DT_SOFTPLUS, HAS_LIMIT, BLOCK_T)  # (BLOCK_T,)
    # checkpoint readout exp(acc_t)·C_t S0ᵀ on fp32 operands (the state is fp32), BLOCK_R state columns at a
    # time: a (BLOCK_T, BLOCK_N) fp32 C and a (BLOCK_P, BLOCK_N) state at once spill registers at 64 x 128
    y = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    for r0 in tl.static_range(0, BLOCK_N, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < N
        C_r = tl.load(C_base + rows[:, None] * C_l + offs_r[None, :] * C_n,
                      mask=row_ok[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_T, BLOCK_R)
        S_r = tl.load(state_ptr + b * s_b + h * s_h + offs_p[:, None] * s_p + offs_r[None, :] * s_n,
                      mask=mask_p[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_P, BLOCK_R)
        y += _readout(C_r.to(tl.float32), tl.trans(S_r), READOUT)
    y = y * tl.exp(acc_t)[:, None]  # (BLOCK_T, BLOCK_P)
    C_t = tl.load(C_base + rows[:, None] * C_l + offs_n[None, :] * C_n,
                  mask=row_ok[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_T, BLOCK_N)
    for jb in range(0, tb):  # column blocks before the diagonal: ancestors only, their A_tree computed here
        cols = jb * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) candidate ancestors
        dt_j, _ = _log_decay(dt_base, cols, cols < L, A, bias, lo, hi, dt_l, DT_SOFTPLUS, HAS_LIMIT)
        acc_j = _acc_tree(mask_base, dt_base, cols, jb + 1, L, A, bias, lo, hi, m_t, m_j, dt_l,
                          IS_CAUSAL, DT_SOFTPLUS, HAS_LIMIT, BLOCK_T)
        y += _pair_block(C_t, B_base, x_base, mask_base, rows, cols, acc_t, acc_j, dt_j, offs_n, offs_p, mask_n,
                         mask_p, L, B_l, B_n, x_l, x_p, m_t, m_j, IS_CAUSAL, IEEE)
    # the diagonal block: its columns are this program's rows, whose A_tree is acc_t
    dt_t, _ = _log_decay(dt_base, rows, row_ok, A, bias, lo, hi, dt_l, DT_SOFTPLUS, HAS_LIMIT)
    y += _pair_block(C_t, B_base, x_base, mask_base, rows, rows, acc_t, acc_t, dt_t, offs_n, offs_p, mask_n,
                     mask_p, L, B_l, B_n, x_l, x_p, m_t, m_j, IS_CAUSAL, IEEE)
    io = row_ok[:, None] & mask_p[None, :]
    if HAS_D:
        x_t = tl.load(x_base + rows[:, None] * x_l + offs_p[None, :] * x_p, mask=io, other=0.0)
        y += tl.load(D_ptr + h).to(tl.float32) * x_t.to(tl.float32)
    tl.store(y_ptr + b * y_b + h * y_h + rows[:, None] * y_l + offs_p[None, :] * y_p, y, mask=io)


@triton.jit
def _tree_conv_kernel(x_ptr, st_ptr, w_ptr, bias_ptr, mask_ptr, y_ptr, L, Cdim,
                      x_b, x_l, x_c, s_b, s_c, s_w, w_c, w_w, m_b, m_t, m_j, y_b, y_l, y_c,
                      W: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    cols = tl.arange(0, BLOCK_L)  # (BLOCK_L,) every node of the tree
    mask_c = offs_c < Cdim
    row_ok = rows < L
    anc = _ancestors(mask_ptr + b * m_b, rows, cols, L, m_t, m_j, IS_CAUSAL).to(tl.int32)  # (BLOCK_T, BLOCK_L)
    # after[t, j]: ancestors-or-self of t at indices >= j, minus one = how many steps j lies above t
    after = tl.cumsum(anc, axis=1, reverse=True) - 1
    depth = tl.sum(anc, axis=1) - 1  # (BLOCK_T,) ancestors of t inside this call
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(W):  # tap k reads the input k steps up the tree; weight[:, W-1-k] multiplies it
        sel = (anc != 0) & (after == k)
        j = tl.sum(tl.where(sel, cols[None, :], 0), axis=1)  # (BLOCK_T,) the k-th ancestor (0 when none)
        in_tree = row_ok & (k <= depth)
        v = tl.load(x_ptr + b * x_b + j[:, None] * x_l + offs_c[None, :] * x_c,
                    mask=in_tree[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if W > 1:  # shallower than k: column W-1-(k-depth) of the conv state (its last column is the newest)
            from_state = row_ok & (k > depth)
            col = tl.minimum(tl.maximum(W - 1 - (k - depth), 0), W - 2)
            v += tl.load(st_ptr + b * s_b + offs_c[None, :] * s_c + col[:, None] * s_w,
                         mask=from_state[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + offs_c * w_c + (W - 1 - k) * w_w, mask=mask_c, other=0.0).to(tl.float32)
        acc += v * wk[None, :]
    if SILU:
        acc = silu(acc)
    tl.store(y_ptr + b * y_b + rows[:, None] * y_l + offs_c[None, :] * y_c, acc,
             mask=row_ok[:, None] & mask_c[None, :])


READOUTS = {"ieee": 0, "tf32x3": 1, "tf32": 2}  # precision of the checkpoint readout C·S0ᵀ (``_readout``)


def _scan_blocks(L: int, P: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_P, num_warps), by hand. A whole STree tree (up to 64 nodes, seed 003 uses 13-63) is one
    node block, so A_tree and every C·B pair come from one tile; tl.dot needs >= 16 on every side. With
    P = 64 one program covers a head (mamba2-2.7b: 80 programs at batch 1, each two 64x128x64 GEMMs). Eight
    warps: the fastest of the sweep (``bench/tree_scan_sweep``) at depths 4, 5 and 6 on an H200."""
    bt = min(64, max(16, triton.next_power_of_2(L)))
    bp = min(64, max(16, triton.next_power_of_2(P)))
    return bt, bp, 8


def scan_launch(L: int, P: int, N: int, *, block_p: int | None = None, num_warps: int | None = None,
                readout_block: int | None = None, readout: str | None = None, half: bool = True) -> dict:
    """The launch of ``tree_scan_triton``: the defaults of ``_scan_blocks`` and the whole state width read out
    at once where an option is None. ``block_p``: P columns a program (a power of two >= 16; smaller gives more
    programs); ``readout_block``: state columns per step of the readout (a power of two, 16 .. the padded N);
    ``readout``: "ieee", "tf32x3" or "tf32" (``_readout``; None: "tf32" when the inputs are 16-bit, ``half``,
    else "ieee"). Bad values raise ValueError, and so does the one launch Triton 3.6 miscompiles: 64 nodes a
    program, fewer than 64 P columns and 4 warps, with the readout over 128 or more state columns in one step,
    reads past its shared memory in the store of y (compute-sanitizer on an H200: an invalid __shared__ read,
    whatever the readout's precision)."""
    bt, bp, nw = _scan_blocks(L, P)
    bn = max(16, triton.next_power_of_2(N))

    def pow2(name: str, v: int, lo: int, hi: int) -> int:
        if v < lo or v > hi or v & (v - 1):
            raise ValueError(f"tree scan: {name} must be a power of two in [{lo}, {hi}], got {v}")
        return v

    if readout is None:
        readout = "tf32" if half else "ieee"
    if readout not in READOUTS:
        raise ValueError(f"tree scan: readout must be one of {', '.join(READOUTS)}, got {readout!r}")
    cfg = dict(BLOCK_T=bt, BLOCK_N=bn,
               BLOCK_P=bp if block_p is None else pow2("block_p", block_p, 16, 128),
               BLOCK_R=bn if readout_block is None else pow2("readout_block", readout_block, 16, bn),
               num_warps=nw if num_warps is None else pow2("num_warps", num_warps, 1, 16),
               READOUT=READOUTS[readout])
    if cfg["BLOCK_T"] == 64 and cfg["BLOCK_P"] < 64 and cfg["num_warps"] == 4 and cfg["BLOCK_R"] >= 128:
        raise ValueError(f"tree scan: block_p={cfg['BLOCK_P']} with 4 warps and the readout in one step of "
                         f"{cfg['BLOCK_R']} columns faults on the GPU at {L} nodes (a Triton 3.6 shared-memory "
                         f"bug); use num_warps=8 or readout_block=64")
    return cfg


def _mask_arg(tree_mask: Tensor | None, bsz: int, L: int, device) -> tuple[Tensor, tuple[int, int, int]]:
    """The mask as uint8 (a zero-copy view of the bool tensor) and its strides; a placeholder when causal."""
    if tree_mask is None:
        return torch.empty(1, dtype=torch.uint8, device=device), (0, 0, 0)
    if tree_mask.shape != (bsz, L, L) or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be a bool tensor of shape (B, L, L) = {(bsz, L, L)}, "
                         f"got {tuple(tree_mask.shape)} {tree_mask.dtype}")
    m = tree_mask.view(torch.uint8)
    return m, m.stride()


def tree_scan_triton(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                     *, tree_mask: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                     dt_limit: tuple[float, float] = (0.0, float("inf")), **launch) -> Tensor:
    """Triton form of ``tree_scan`` (see ``ssmspec.ops.tree_scan``; same shapes). Returns y (B, L, H, P).
    ``launch``: the options of ``scan_launch`` (block_p, num_warps, readout_block, readout)."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, L, H, P), got {tuple(x.shape)}")
    bsz, L, H, P = x.shape
    N = B.shape[-1]
    if state.shape != (bsz, H, P, N) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 (B, H, P, N) = ({bsz}, {H}, {P}, {N}), got "
                         f"{tuple(state.shape)} {state.dtype}")
    if dt.shape != (bsz, L, H):
        raise ValueError(f"dt must be (B, L, H) = {(bsz, L, H)}, got {tuple(dt.shape)}")
    if B.dim() != 4 or B.shape != C.shape or B.shape[:2] != (bsz, L) or H % B.shape[2]:
        raise ValueError(f"B and C must both be (B, L, G, N) with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")
    if A.shape != (H,) or (D is not None and D.shape != (H,)) or (dt_bias is not None and dt_bias.shape != (H,)):
        raise ValueError(f"A, D and dt_bias must be (H,) = ({H},)")
    for name, t in (("x", x), ("B", B), ("C", C), ("dt", dt)):
        check_float(name, t)
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"B and C must have x's dtype {x.dtype} for the Triton tree scan, got {B.dtype}, {C.dtype}")
    mask, ms = _mask_arg(tree_mask, bsz, L, x.device)
    cfg = scan_launch(L, P, N, half=x.dtype != torch.float32, **launch)
    y = torch.empty_like(x)
    if L == 0:
        return y
    lo, hi = limit_args(dt_limit)
    grid = (triton.cdiv(P, cfg["BLOCK_P"]), bsz * H, triton.cdiv(L, cfg["BLOCK_T"]))
    _tree_scan_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else dummy(x), dt_bias if dt_bias is not None else dummy(x),
        mask, y, L, H, P, N, H // B.shape[2], lo, hi,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ms, *y.stride(),
        IS_CAUSAL=tree_mask is None, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_LIMIT=has_limit(dt_limit), IEEE=x.dtype == torch.float32 or interpret_mode(), **cfg,
    )
    return y


_CONV_BLOCK_C = 128  # channels per program: conv_dim ~ 5-10k gives 40-80 programs per node block at batch 1
_CONV_MAX_NODES = 1024  # one program holds a (BLOCK_T, BLOCK_L) slice of the mask


def tree_conv1d_triton(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                       tree_mask: Tensor | None = None, activation: str | None = "silu") -> Tensor:
    """Triton form of ``tree_conv1d`` (see ``ssmspec.ops.tree_scan``; same shapes). Returns y (B, L, C)."""
    if x.dim() != 3:
        raise ValueError(f"x must be (B, L, C), got {tuple(x.shape)}")
    bsz, L, Cdim = x.shape
    W = weight.shape[-1]
    if weight.shape != (Cdim, W) or conv_state.shape != (bsz, Cdim, W - 1):
        raise ValueError(f"need weight (C, W) and conv_state (B, C, W-1) with C = {Cdim}; got "
                         f"{tuple(weight.shape)}, {tuple(conv_state.shape)}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    if L > _CONV_MAX_NODES:
        raise ValueError(f"the Triton tree conv takes trees of up to {_CONV_MAX_NODES} nodes, got {L}; "
                         f"use backend='reference'")
    mask, ms = _mask_arg(tree_mask, bsz, L, x.device)
    y = torch.empty_like(x)
    if L == 0:
        return y
    bl = max(16, triton.next_power_of_2(L))
    bt = min(bl, 16)
    grid = (bsz, triton.cdiv(Cdim, _CONV_BLOCK_C), triton.cdiv(L, bt))
    _tree_conv_kernel[grid](x, conv_state, weight, bias if bias is not None else dummy(weight), mask, y, L, Cdim,
                            *x.stride(), *conv_state.stride(), *weight.stride(), *ms, *y.stride(),
                            W=W, IS_CAUSAL=tree_mask is None, HAS_BIAS=bias is not None,
                            SILU=activation in ("silu", "swish"), BLOCK_T=bt, BLOCK_L=bl, BLOCK_C=_CONV_BLOCK_C,
                            num_warps=4)
    return y
