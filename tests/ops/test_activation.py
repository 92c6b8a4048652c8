"""relu² kernel against its twin: bitwise in every float dtype (one rounding after an fp32 square), NaN and
the sign of zero kept as torch.relu keeps them, any shape and stride, and a tail that is not a whole block."""
import pytest
import torch

from ssmspec.ops.activation import relu_square, relu_square_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2049,), (0, 4)])
def test_relu_square_matches_twin_bitwise(device, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
    if x.numel():
        x.view(-1)[0] = float("nan")
        x.view(-1)[-1] = -0.0
    y = relu_square(x, backend="triton")
    assert y.dtype == dtype and y.shape == x.shape
    # bitwise, except that the CPU interpreter rounds fp32 -> bf16 by truncation (one unit in the last place)
    exact = dtype != torch.bfloat16 or torch.cuda.is_available()
    torch.testing.assert_close(y, relu_square_ref(x), rtol=0 if exact else 2 ** -7, atol=0, equal_nan=True)


def test_relu_square_reads_strided_input(device):
    x = torch.randn(6, 10, device=device)[:, ::2]  # non-contiguous
    torch.testing.assert_close(relu_square(x, backend="triton"), relu_square_ref(x), rtol=0, atol=0)


def test_relu_square_keeps_gradients_through_the_twin(device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    relu_square(x, backend="triton").sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.relu(x.detach()))


def test_relu_square_refuses_float64_with_the_fix(device):
    with pytest.raises(ValueError, match="backend='reference'"):
        relu_square(torch.ones(3, dtype=torch.float64, device=device), backend="triton")


@pytest.mark.gpu
def test_relu_square_at_nemotron_mlp_width():
    x = torch.randn(1024, 12288, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(relu_square(x), relu_square_ref(x), rtol=0, atol=0)
