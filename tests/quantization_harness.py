"""Weight-only quantization tests' shared ground: a float weight with an outlier row, and the bound a
quantized product keeps to x times the dequantized weight."""
from __future__ import annotations

import torch


def outlier_weight() -> torch.Tensor:
    """A 96 x 256 float weight with one outlier, in row 3."""
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    w[3, 7] = 25.0  # an outlier row: its scale must not leak into other rows
    return w


def assert_float32_product(actual, reference):
    """actual is x times the dequantized weight to float32 arithmetic: within 1e-4 relative, and
    absolutely within 2e-5 of the output's scale, for outputs near zero (a sum of terms of that
    scale). A single INT4 row on AVX512_BF16 hosts (bf16 dot products on x to 16 mantissa bits)
    comes to about 1e-5 of the scale; float FMAs about 5e-7; x rounded once to bf16, 1e-3."""
    torch.testing.assert_close(actual, reference, rtol=1e-4, atol=2e-5 * reference.abs().max().item())
