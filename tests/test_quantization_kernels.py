"""Weight-only INT8/INT4 on our CPU kernels: ragged register tiles, float32 panels over many rows, INT8
weights held as panels, and INT4's single-row tiles, each against the dequantized product."""
from __future__ import annotations

import pytest
import torch

from quantization_harness import assert_float32_product, outlier_weight
from worker.model import cpu_kernels
from worker.model.layers import pack_panels
from worker.model.quantization import QuantizedLinear
from worker.model.quantized_weight import dequantize, quantize


@pytest.fixture
def weight():
    return outlier_weight()


@pytest.mark.parametrize("bits, group_size", [(8, 0), (4, 8), (4, 32), (4, 128)])
def test_our_kernels_on_ragged_tiles(bits, group_size):
    """Our kernels tile 3 input rows x 4 weight rows (x 8 on AVX-512, and for one row of INT4 in
    groups of whole runs of 32 on AVX2): every count of leftover
    rows and weight rows (98 = 24 x 4 + 2 = 12 x 8 + 2) must still match the dequantized
    reference, on both sides of the row counts where a call switches to float32 panels (15 and 18
    rows on AVX2; on AVX-512, where K is whole blocks of 64, whose panels are filled by
    transposing bytes, 5 for INT8 and for INT4 10 in groups of 128, 6 in groups of 32, 3 in
    groups of 8; else 12 and 16), through INT4's tiles of one, two and three rows, and for INT4
    in the nibble-split orders
    (groups of whole runs of 16 or 32) and out of them (groups of 8). K = 264 is not a whole
    number of the AVX-512 tiles' 32-feature steps: those calls take the AVX2 tiles and fills;
    K = 288 is, but not of the byte fill's 64, so INT4 stays on its AVX-512 tiles up to 12 rows."""
    torch.manual_seed(1)
    for k in {0: (256, 264), 8: (256, 264), 32: (256, 288)}.get(group_size, (256,)):
        weight = torch.randn(98, k)
        layer = QuantizedLinear(quantize(weight, bits, group_size or 128), torch.randn(98), path="ours")
        if not layer.path_available("ours", torch.device("cpu")):
            pytest.skip("our CPU kernels are not built here")
        for rows in (1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 15, 16, 18, 19, 31, 32, 33, 40):
            x = torch.randn(rows, k)
            assert_float32_product(layer(x), x @ dequantize(layer.qw).t() + layer.bias)


@pytest.mark.parametrize("bits, group_size, in_features",
                         [(8, 0, 256), (8, 0, 264), (4, 8, 256), (4, 8, 264), (4, 32, 256), (4, 128, 256)])
@pytest.mark.parametrize("rows", [33, 40, 128])
def test_many_rows_run_the_float_panels_over_the_dequantized_weight(bits, group_size, rows, in_features):
    """Above a few register tiles of rows, our quantized kernels widen each weight once into float32
    panels and run the float32 panel kernel over them: the result is that kernel's on the
    dequantized weight (bit for bit for INT8, whose dequantized value is one rounding; INT4's
    scale and zero are one fused multiply-add in the kernel against two roundings in torch),
    whether the panels are filled by transposing bytes (AVX-512, K whole blocks of 64) or by
    8 x 8 float transposes (K = 264)."""
    kernels = cpu_kernels.load()
    layer = QuantizedLinear(quantize(torch.randn(98, in_features), bits, group_size or 128), path="ours")
    if kernels is None or not layer.path_available("ours", torch.device("cpu")):
        pytest.skip("our CPU kernels are not built here")
    x = torch.randn(rows, in_features)
    panels = torch.empty(rows, 98)
    kernels.linear_packed(x, pack_panels(dequantize(layer.qw)), panels)
    if bits == 8:
        assert torch.equal(layer(x), panels)
    else:
        torch.testing.assert_close(layer(x), panels, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_features", [256, 264, 40])
@pytest.mark.parametrize("out_features", [98, 114])
def test_int8_weight_panels_match_the_dequantized_product_at_every_row_count(in_features, out_features):
    """A weight-only INT8 layer held as panels (an engine's, on our kernels; on AVX-512 in groups
    of two interleaved by input feature) runs the float32 panel tiles over them at every row
    count: within float32 precision of the dequantized product for every count of leftover rows
    (1-12 rows a tile; four panels a tile at 1-2 rows on AVX-512 and at 1 row on AVX2, else two on
    AVX-512, two at 2-3 rows on AVX2 and one beyond) and a ragged last
    panel (2 outputs wide) alone in its tile and in a group padded with a zero panel (98
    outputs: 7 panels) or the last of a tile of four or two (114: 8 panels); the same bit for
    bit as the plain [P, K, 16] panels; and since each output lane sums its products in one order
    whatever the tile, a row's result is the same bit for bit alone or among any rows."""
    torch.manual_seed(2)
    layer = QuantizedLinear(quantize(torch.randn(out_features, in_features), 8), torch.randn(out_features),
                            path="ours")
    if not layer.path_available("ours", torch.device("cpu")):
        pytest.skip("our CPU kernels are not built here")
    kernels, qweight = cpu_kernels.load(), layer.qweight
    reference_weight = dequantize(layer.qw).t()
    layer.hold_weight_panels()
    assert layer.held_panels == "weight" and "qweight" not in layer._buffers
    group = kernels.int8_weight_panel_group()
    assert layer.kernel_weight().shape == pack_panels(qweight, group).shape
    assert torch.equal(layer.qweight, qweight)
    assert (layer.small_path, layer.path) == ("ours", "ours")
    x = torch.randn(128, in_features)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    plain = pack_panels(qweight)
    for rows in (1, 2, 3, 5, 8, 11, 12, 13, 23, 24, 25, 40, 128):
        out = layer(x[:rows])
        assert_float32_product(out, x[:rows] @ reference_weight + layer.bias)
        assert torch.equal(out[:40], alone[:rows])
        from_plain = torch.empty(rows, out_features)
        kernels.linear_small_batch_int8(x[:rows], plain, layer.scales, from_plain)
        assert torch.equal(out, from_plain + layer.bias)


def test_int8_weight_panels_refuse_a_group_the_kernels_do_not_read():
    qw = quantize(torch.randn(64, 32), 8)
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("our CPU kernels are not built here")
    with pytest.raises(RuntimeError, match=r"\[G, K, 2, 16\]"):
        kernels.linear_small_batch_int8(torch.randn(1, 32), pack_panels(qw.qweight, 4), qw.scales, torch.empty(1, 64))
    # Panels for 64 outputs against scales and out for 96: only the panel count is wrong.
    with pytest.raises(RuntimeError, match="must match out"):
        kernels.linear_small_batch_int8(torch.randn(1, 32), pack_panels(qw.qweight, 2), torch.ones(96), torch.empty(1, 96))
    # Panels and out for 64 against scales for 96: only the scales are wrong.
    with pytest.raises(RuntimeError, match="must match out"):
        kernels.linear_small_batch_int8(torch.randn(1, 32), pack_panels(qw.qweight, 2), torch.ones(96), torch.empty(1, 64))
    ok = torch.empty(1, 64)
    kernels.linear_small_batch_int8(torch.randn(1, 32), pack_panels(qw.qweight, 2), qw.scales, ok)


def test_int8_weight_panels_save_load_and_switch_layouts(weight):
    """Held as panels, the layer still reads and saves its row-major weight, loads a saved state
    back into its panels, and switches to int8 activations' own panels where those run."""
    qw = quantize(weight, 8)
    layer = QuantizedLinear(qw, path="ours")
    if not layer.path_available("ours", torch.device("cpu")):
        pytest.skip("our CPU kernels are not built here")
    x = torch.randn(5, 256)
    before, saved = layer(x), {name: t.clone() for name, t in layer.state_dict().items()}
    layer.hold_weight_panels()
    assert torch.equal(layer.qweight, qw.qweight)
    assert torch.equal(layer.state_dict()["qweight"], qw.qweight) and "qweight_panels" not in layer.state_dict()
    other = quantize(torch.randn(96, 256), 8)
    layer.load_state_dict({"qweight": other.qweight, "scales": other.scales})
    assert layer.held_panels == "weight" and torch.equal(layer.qweight, other.qweight)
    assert_float32_product(layer(x), x @ dequantize(other).t())
    layer.load_state_dict(saved)
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
    if layer.takes_int8_activations():
        layer.int8_activations = True
        layer.hold_int8_activation_panels()
        assert layer.held_panels == "int8_activations" and torch.equal(layer.qweight, saved["qweight"])
        torch.testing.assert_close(layer(x), before, rtol=0, atol=0.02 * before.abs().max().item())


@pytest.mark.parametrize("tile,group_size", [("bf16", 128), ("fma", 128), ("vnni", 128), ("vnni", 256), ("vnni", 64),
                                             ("int8", 64), ("int8", 128), ("int8", 32)])
def test_a_single_int4_row_keeps_float_activations(tile, group_size):
    """One row of x by INT4 weights takes its own tile (float FMAs on the raw nibbles; bf16 dot
    products with x split into two bf16 parts, on AVX512_BF16 builds; int8 dot products with x as
    two int8 parts of a group's grid, on AVX512_VNNI builds, and the same on AVX2 builds): its error against float64 stays a
    small fraction of what rounding x once to bf16 (or to int8) would give, at every scale of x,
    and it agrees with the same row computed among others (the float FMA tiles) to float32
    precision (the int8 tile: within its grid's bound, the int8 parts holding x to 2^-16 of the
    largest |x| of its 32 features, the product of such an x and the INT4 weights exact). Groups the int8
    tile does not take (not whole runs of 128 for VNNI's, of 64 for AVX2's) go through the FMA tile,
    and a group of x that is all zeros stays exact."""
    torch.manual_seed(3)
    qw = quantize(torch.randn(200, 1024), 4, group_size=group_size)
    layer = QuantizedLinear(qw, path="ours")
    if not layer.path_available("ours", torch.device("cpu")):
        pytest.skip("our CPU kernels are not built here")
    kernels = cpu_kernels.load()
    try:
        assert kernels.int4_row_kernel(tile) == tile
    except RuntimeError as e:
        assert "the tiles this build has" in str(e)
        pytest.skip(f"this build has no {tile} tile")
    try:
        w = dequantize(qw).double()
        for scale in (1e-3, 1.0, 1e3):
            x = torch.randn(3, 1024) * scale
            x[0, 5] *= 40  # an outlier feature, as activations have: its 32 features' grid follows it
            x[0, group_size:2 * group_size] = 0
            reference = x[:1].double() @ w.t()
            alone = layer(x[:1]).double()
            bf16_once = x[:1].bfloat16().double() @ w.t()
            assert (alone - reference).abs().max() < (bf16_once - reference).abs().max() / 16
            atol = 3e-5 * reference.abs().max().item()
            if (tile, group_size % {"vnni": 128, "int8": 64}.get(tile, 1)) in (("vnni", 0), ("int8", 0)):
                # Each element is held to its 32 features' unit, 1/(127 * 256) of their largest |x|
                # (half that but where the residual's rounding clamps): the error of each output is
                # within the weights' magnitudes times those units, plus float32 rounding.
                units = x[0].double().view(-1, 32).abs().amax(1).repeat_interleave(32) / (127 * 256)
                grid_bound = w.abs() @ units
                assert ((alone[0] - reference[0]).abs() <= grid_bound + 1e-6 * reference.abs().max()).all()
                atol = max(atol, grid_bound.max().item())
            torch.testing.assert_close(alone, layer(x)[:1].double(), rtol=1e-4, atol=atol)
        for bad in (float("nan"), float("inf")):  # a non-finite x gives no finite output, as in float
            x = torch.randn(1, 1024)
            x[0, 7] = bad
            assert not layer(x).isfinite().any()
    finally:
        kernels.int4_row_kernel("auto")


def test_the_int4_row_tile_is_chosen_by_vendor_unless_told():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("our CPU kernels are not built here")
    chosen = kernels.int4_row_kernel()
    assert chosen in ("bf16", "fma", "vnni", "int8")
    assert kernels.int4_row_kernel("fma") == "fma" and kernels.int4_row_kernel() == "fma"
    assert kernels.int4_row_kernel("auto") == chosen
    with pytest.raises(RuntimeError, match="int4_row_kernel"):
        kernels.int4_row_kernel("fastest")
    vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    assert chosen != "bf16" or vendor == "AuthenticAMD"  # only AMD hosts take the bf16 tile by default
    built = set(cpu_kernels.int4_row_tiles(kernels))
    assert kernels.int4_row_kernel() == chosen
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    if " avx2" in flags and " avx512f" not in flags:
        assert "int8" in built  # the AVX2 form of the int8 tile, wherever the AVX-512 kernels are not built
    if vendor != "AuthenticAMD" or "bf16" not in built:
        # elsewhere an int8 tile wherever one is built: VNNI's, else AVX2's
        assert chosen == ("vnni" if "vnni" in built else "int8" if "int8" in built else "fma")
