"""Shared pieces of the kernel tests: tolerances per dtype, NaN-aware comparison, random Mamba-2 inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# (atol, rtol) for outputs in the input dtype; fp32 states are compared at STATE_TOL whatever the inputs
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 2e-2), torch.float16: (5e-3, 5e-3)}
STATE_TOL = (2e-4, 2e-4)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    """Finite everywhere (an unwritten output or a read of a NaN-poisoned element shows up) and close."""
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output or a NaN-poisoned read)"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


def mamba_inputs(bsz: int, L: int, H: int, P: int, G: int, N: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Random decode inputs with realistic magnitudes: dt raw around softplus^-1(0.05), A in [-8, -0.5]."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(
        x=r(bsz, L, H, P).to(dtype), dt=(r(bsz, L, H) - 3.0).to(dtype),
        A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device),
        B=r(bsz, L, G, N, scale=0.3).to(dtype), C=r(bsz, L, G, N, scale=0.3).to(dtype),
        D=r(H), z=r(bsz, L, H, P).to(dtype), dt_bias=r(H, scale=0.5),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ssd_scan_inputs(bsz: int, L: int, H: int, P: int, G: int, N: int, dtype: torch.dtype, device,
                    g: torch.Generator) -> dict:
    """SSD scan inputs drawn from ``g`` (CPU): x, discretized dt (softplus around 0.05), A in [-8, -0.5], B, C,
    D and an fp32 initial state ``s0``."""

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return dict(x=r(bsz, L, H, P).to(device, dtype), dt=F.softplus(r(bsz, L, H) - 3.0).to(device),
                A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device),
                B=r(bsz, L, G, N, scale=0.3).to(device, dtype), C=r(bsz, L, G, N, scale=0.3).to(device, dtype),
                D=r(H).to(device), s0=r(bsz, H, P, N, scale=0.1).to(device))
