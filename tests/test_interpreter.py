"""The test suite's patches to Triton's CPU interpreter (moekit.tools._interpreter): dots whose bits do not depend
on the CPU's BLAS kernel or on a row's place in the tile."""

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's patches; the GPU runs kernels")


@triton.jit
def _tile_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def _dot(a, b):
    c = torch.full((a.shape[0], b.shape[1]), float("nan"))
    _tile_dot[(1,)](a, b, c, a.shape[0], b.shape[1], a.shape[1])
    return c


# (M, N, K): a tile of 16 (the router's and decode kernels' smallest), one of 64 with a K shorter than the tile
# (OpenBLAS's AVX2 kernels moved both rows and columns there), and a long K as a router's hidden size is.
TILES = [(16, 16, 128), (64, 64, 64), (16, 32, 512)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tile", TILES)
def test_a_dot_row_or_column_gives_the_same_bits_wherever_it_sits(dtype, tile):
    M, N, K = tile
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    c = _dot(a, b)
    for shift in range(1, M):
        assert torch.equal(_dot(a.roll(-shift, 0), b)[0], c[shift]), f"row {shift} moved to row 0"
    for shift in (1, N // 2 + 1, N - 1):
        assert torch.equal(_dot(a, b.roll(-shift, 1))[:, 0], c[:, shift]), f"column {shift} moved to column 0"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_dot_sums_along_k_in_order_in_fp32(dtype):
    """The bits of a chain of fp32 multiply-adds along K, one after another (what the patch promises), and the
    float64 product within fp32's rounding."""
    M, N, K = TILES[0]
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    chain = torch.zeros(M, N)
    for k in range(K):
        chain = chain + a[:, k:k + 1].float() * b[k:k + 1, :].float()
    c = _dot(a, b)
    assert torch.equal(c, chain)
    exact = a.double() @ b.double()
    assert ((c.double() - exact).abs().max() / exact.abs().max()).item() < K * 2 ** -23
