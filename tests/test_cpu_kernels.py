"""Every matmul form `linear` may pick gives F.linear's result, whatever the row count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model import cpu_kernels
from worker.model.layers import SMALL_BATCH_MAX_ROWS, WIDE_WEIGHT_MAX_ROWS, WIDE_WEIGHT_RATIO, linear


@pytest.mark.parametrize("rows", [1, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1, 17, WIDE_WEIGHT_MAX_ROWS + 1])
@pytest.mark.parametrize("shape", [(96, 64), (64 * WIDE_WEIGHT_RATIO, 64)])  # ordinary and wide weights
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_linear_matches_torch(rows, shape, with_bias, with_out):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=g)
    bias = torch.randn(shape[0], generator=g) if with_bias else None
    x = torch.randn(rows, shape[1], generator=g)
    out = torch.full((rows, shape[0]), float("nan")) if with_out else None
    got = linear(x, weight, bias, out=out)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    if with_out:
        assert got.data_ptr() == out.data_ptr()


def test_small_batch_kernel_is_built_here():
    # This machine (and CI) has a compiler: the fast paths must really be exercised.
    assert cpu_kernels.load() is not None
