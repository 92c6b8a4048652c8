"""relu² as one elementwise pass (``ops.activation``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ssmspec.ops.triton_common import check_float

_BLOCK = 2048


@triton.jit
def _relu_square_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu
    tl.store(y_ptr + offs, (r * r).to(y_ptr.dtype.element_ty), mask=mask)


def relu_square_triton(x: Tensor) -> Tensor:
    """Triton form of ``relu_square``: x of any shape (copied first only when not contiguous)."""
    check_float("x", x)
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, _BLOCK),)](x, y, n, BLOCK=_BLOCK, num_warps=4)
    return y
