"""The int8-activation kernels' narrower instruction-set paths. A host with AVX-512 VNNI builds
its output-major kernel natively; a CPU without AVX-512 runs the AVX2 tiles, and one without AVX2 the
portable loop. Each is built here with the wider instructions turned off and held to the same
float64 statement of the arithmetic as the native build (tests/test_int8_activations.py). The
weight-only INT8 / INT4 kernels of the same builds are held to their dequantized product, and
their half-precision float panels to float32 panels of the same values."""
from __future__ import annotations

import pytest
import torch

from worker.model import cpu_kernels
from worker.model.int8_activation_panels import to_panels
from worker.model.layers import pack_panels
from worker.model.quantized_weight import dequantize, quantize

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")]

BUILDS = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


def _host_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return True  # unknown: build every path


def _skip_if_native(build: str) -> None:
    # Without AVX-512 the native build already is the AVX2 path, held to the same statement by
    # tests/test_int8_activations.py: a second build would test nothing more.
    if build == "avx2" and not _host_has_avx512f():
        pytest.skip("this host has no AVX-512: its native build is the AVX2 path")


# Only what this test calls, from the two files that define it, bound with pybind11 and torch's tensor
# casters alone (as bindings.cpp is): the build is most of this test's time (docs/benchmarks.md).
_BINDINGS = """
#include <torch/csrc/utils/pybind.h>
#include "kernels.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_small_batch_int8", &linear_small_batch_int8);
  m.def("linear_small_batch_int4", &linear_small_batch_int4);
  m.def("linear_int8_weights_int8_activations", &linear_int8_weights_int8_activations);
  m.def("linear_int4_weights_int8_activations", &linear_int4_weights_int8_activations);
  m.def("int4_row_kernel", &int4_row_kernel);
  m.def("linear_packed", &linear_packed);
}
"""
_KERNEL_SOURCES = ("linear.cpp", "linear_int8_activations.cpp")


def _build(name: str, flags: list[str], folder):
    from torch.utils.cpp_extension import load
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "isa_bindings.cpp").write_text(_BINDINGS)
    sources = [str(folder / "isa_bindings.cpp"), *(str(cpu_kernels._SOURCE_DIR / s) for s in _KERNEL_SOURCES)]
    return load(name=f"int8_activations_{name}", sources=sources, build_directory=str(folder),
                extra_cflags=["-O1", f"-I{cpu_kernels._SOURCE_DIR}", "-march=native", *flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).view_as(x)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_instruction_set_path_computes_the_int8_rounded_product(build, tmp_path_factory):
    _skip_if_native(build)
    kernels = _build(build, BUILDS[build], tmp_path_factory.mktemp(build))
    for bits, in_features, group_size in ((8, 256, 0), (8, 96, 0), (4, 256, 128), (4, 96, 32), (4, 192, 96)):
        g = torch.Generator().manual_seed(bits * 1000 + in_features)
        qw = quantize(torch.randn(37, in_features, generator=g), bits, group_size=group_size or 128)
        panels = to_panels(qw.qweight, bits, in_features, qw.group_size, output_major=False)
        for rows in (1, 3, 7):
            x = torch.randn(rows, in_features, generator=g)
            x[0, :32] = 0.0
            out = torch.empty(rows, 37)
            if bits == 8:
                kernels.linear_int8_weights_int8_activations(x, panels, qw.scales, out)
            else:
                kernels.linear_int4_weights_int8_activations(x, panels, qw.scales, qw.zeros, qw.group_size, out)
            want = _rounded(x).double() @ dequantize(qw).double().t()
            torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    # The weight-only kernels of the same build: register tiles, INT4's nibble-split order (groups
    # of whole runs of 16) and feature order (groups of 8), the float32 panel route above them,
    # and INT8 panels; a single INT4 row through each one-row tile the build has (an AVX2 build's
    # own choice is its int8 tile, which holds x to a grid: tests/test_quantization_kernels.py).
    for tile in _int4_row_tiles(kernels):
        kernels.int4_row_kernel(tile)
        for bits, group_size in ((8, 0), (4, 128), (4, 32), (4, 8)):
            g = torch.Generator().manual_seed(bits * 100 + group_size)
            qw = quantize(torch.randn(37, 256, generator=g), bits, group_size=group_size or 128)
            w = dequantize(qw).double()
            for rows in (1, 3, 7, 12, 16, 19, 40):
                x = torch.randn(rows, 256, generator=g)
                out = torch.empty(rows, 37)
                if bits == 8:
                    kernels.linear_small_batch_int8(x, qw.qweight, qw.scales, out)
                else:
                    kernels.linear_small_batch_int4(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, out)
                want = x.double() @ w.t()
                atol = 1e-5 * want.abs().max().item()
                if tile == "int8" and bits == 4 and rows == 1 and group_size % 64 == 0:
                    # Each element of x within 1/(127 * 256) of its 32 features' largest |x|.
                    units = x[0].double().view(-1, 32).abs().amax(1).repeat_interleave(32) / (127 * 256)
                    atol = max(atol, (w.abs() @ units).max().item())
                torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)
                if bits == 8:  # INT8 held as the float tiles' panels (widened once above 18 rows on AVX2)
                    for group in (1, 2):  # plain, and in the pairs an AVX-512 build holds
                        out.fill_(float("nan"))
                        kernels.linear_small_batch_int8(x, pack_panels(qw.qweight, group), qw.scales, out)
                        torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)


    # Float panels: half ones (widened in registers, or on AVX2 above 18 rows into a float32 copy)
    # give what float32 panels of the same values give, bit for bit.
    g = torch.Generator().manual_seed(11)
    for half in (torch.bfloat16, torch.float16):
        weight = torch.randn(37, 96, generator=g).to(half)
        for rows in (1, 3, 7, 19, 40):
            x = torch.randn(rows, 96, generator=g)
            got, want = torch.empty(rows, 37), torch.empty(rows, 37)
            kernels.linear_packed(x, pack_panels(weight), got)
            kernels.linear_packed(x, pack_panels(weight.float()), want)
            assert torch.equal(got, want), (half, rows)
            torch.testing.assert_close(got, x @ weight.float().t(), rtol=1e-5, atol=1e-5)


def _int4_row_tiles(kernels) -> list[str]:
    """The one-row INT4 tiles of this build among the float FMA tile and the AVX2 int8 one."""
    tiles = ["fma"]
    try:
        kernels.int4_row_kernel("int8")
        tiles.append("int8")
    except RuntimeError as e:
        assert "the tiles this build has" in str(e)
    return tiles
