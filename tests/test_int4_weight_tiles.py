"""Held INT4 tiles (worker/model/int4_weight_tiles.py): the layout byte by byte, the kernels reading
it against the row-major weight at every row count and one-row tile, their refusals, and the
layers and engines that hold it."""
from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from shared.sampling_params import SamplingParams
from worker.model import cpu_kernels, int4_weight_tiles
from worker.model.int4_weight_tiles import columns_of, from_tiles, to_tiles
from worker.model.quantization import QuantizedLinear
from worker.model.quantized_weight import dequantize_int4, quantize

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")
needs_tiles = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.load().int4_weight_tiles_supported(256, 128),
    reason="this build's kernels do not take held INT4 tiles (AVX2 and AVX-512 only)")


@pytest.mark.parametrize("rows, in_features", [(21, 256), (8, 128), (3, 384)])
def test_tiles_hold_each_groups_8_rows_then_their_scales_and_zeros(rows, in_features):
    """[ceil(N / 8), K / 128, 9, 64]: line j of tile t, group g is row 8t + j's 64 bytes of that
    group as they lie row-major; line 8 its 8 scales then 8 zeros (float32); rows past N zero."""
    g = torch.Generator().manual_seed(rows + in_features)
    qw = quantize(torch.randn(rows, in_features, generator=g), 4, group_size=128)
    tiles = to_tiles(qw.qweight, qw.scales, qw.zeros)
    count, groups = -(-rows // 8), in_features // 128
    assert tiles.shape == (count, groups, 9, 64) and tiles.dtype == torch.uint8
    padded = torch.cat((qw.qweight, torch.zeros(count * 8 - rows, in_features // 2, dtype=torch.uint8)))
    scales = torch.cat((qw.scales, torch.zeros(count * 8 - rows, groups)))
    zeros = torch.cat((qw.zeros, torch.zeros(count * 8 - rows, groups)))
    for t in range(count):
        for group in range(groups):
            for j in range(8):
                assert torch.equal(tiles[t, group, j], padded[8 * t + j, 64 * group:64 * group + 64])
            columns = tiles[t, group, 8].clone().view(torch.float32)
            assert torch.equal(columns[:8], scales[8 * t:8 * t + 8, group])
            assert torch.equal(columns[8:], zeros[8 * t:8 * t + 8, group])
    assert torch.equal(from_tiles(tiles, rows), qw.qweight)
    got_scales, got_zeros = columns_of(tiles, rows)
    assert torch.equal(got_scales, qw.scales) and torch.equal(got_zeros, qw.zeros)


def test_tiles_refuse_other_group_sizes():
    qw = quantize(torch.randn(8, 256), 4, group_size=64)
    with pytest.raises(ValueError, match="groups of 128"):
        to_tiles(qw.qweight, qw.scales, qw.zeros)


def test_the_kernels_take_tiles_only_for_groups_of_128():
    kernels = cpu_kernels.load()
    assert not kernels.int4_weight_tiles_supported(256, 64)
    assert not kernels.int4_weight_tiles_supported(256, 256)
    assert not kernels.int4_weight_tiles_supported(192, 128)  # K not whole groups


def test_avx2_and_avx512_kernels_take_tiles_for_groups_of_128():
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    if " avx2" not in flags or " fma" not in flags:
        pytest.skip("a host without AVX2 and FMA builds the portable kernels, which read row-major only")
    assert cpu_kernels.load().int4_weight_tiles_supported(256, 128)
    assert int4_weight_tiles.supported(5632, 128)


@needs_tiles
@pytest.mark.parametrize("out_features, in_features", [(45, 256), (8, 128), (33, 1024), (16, 384)])
def test_held_tiles_give_the_row_major_result_bit_for_bit(out_features, in_features):
    """At every row count (the one-row tiles, the 2- and 3-row tiles, the dequantized panels past
    10 rows) and every one-row tile this build has; the outputs past a whole tile too."""
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(out_features * in_features)
    qw = quantize(torch.randn(out_features, in_features, generator=g), 4, group_size=128)
    tiles = to_tiles(qw.qweight, qw.scales, qw.zeros)
    reference = dequantize_int4(qw, torch.float64)
    try:
        for tile in cpu_kernels.int4_row_tiles(kernels):
            kernels.int4_row_kernel(tile)
            for rows in (1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 40):
                x = torch.randn(rows, in_features, generator=g)
                row_major, held = torch.empty(rows, out_features), torch.empty(rows, out_features)
                kernels.linear_small_batch_int4(x, qw.qweight, qw.scales, qw.zeros, 128, row_major)
                kernels.linear_small_batch_int4(x, tiles, qw.scales, qw.zeros, 128, held)
                assert torch.equal(held, row_major), (tile, rows)
                # The one-row bf16 and int8 tiles take x to 16 bits of its largest (about 1e-5).
                want = x.double() @ reference.t()
                assert ((held.double() - want).abs().max() / want.abs().max()).item() < 1e-4, (tile, rows)
    finally:
        kernels.int4_row_kernel("auto")


@needs_tiles
def test_the_kernel_refuses_tiles_that_do_not_match_the_call():
    kernels = cpu_kernels.load()
    qw = quantize(torch.randn(16, 256), 4, group_size=128)
    tiles = to_tiles(qw.qweight, qw.scales, qw.zeros)
    x, out = torch.randn(1, 256), torch.empty(1, 16)
    with pytest.raises(RuntimeError, match="groups of 128"):
        kernels.linear_small_batch_int4(x, tiles, qw.scales.repeat(1, 2), qw.zeros.repeat(1, 2), 64, out)
    with pytest.raises(RuntimeError, match="held INT4 tiles"):
        kernels.linear_small_batch_int4(x, tiles, qw.scales[:8], qw.zeros[:8], 128, torch.empty(1, 8))


@needs_tiles
def test_a_layer_holds_its_tiles_saves_row_major_and_loads_back():
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(20, 256, generator=g), 4, group_size=128)
    plain = QuantizedLinear(qw, path="ours")
    held = QuantizedLinear(qw, path="ours")
    held.hold_weight_panels()
    assert held.held_panels == "weight" and held.columns_in_panels
    assert held.kernel_weight().shape == (3, 2, 9, 64)
    assert "qweight" not in held._buffers
    assert torch.equal(held.qweight, qw.qweight)
    for rows in (1, 4, 16):
        x = torch.randn(rows, 256, generator=g)
        assert torch.equal(held(x), plain(x))
    state = held.state_dict()
    assert torch.equal(state["qweight"], qw.qweight)
    shell = QuantizedLinear.empty(4, (20, 256), group_size=128)
    shell.hold_weight_panels()
    shell.load_state_dict(state)
    assert shell.held_panels == "weight" and torch.equal(shell.qweight, qw.qweight)
    x = torch.randn(1, 256, generator=g)
    assert torch.equal(shell(x), plain(x))


@needs_tiles
def test_held_tiles_in_the_arena_save_and_load_back(tmp_path):
    """Gathered into one arena as an engine holds them: the arena takes the tiles only, a
    checkpoint written from them is row-major, and loading it re-holds the same tiles."""
    from safetensors.torch import load_file, save_file
    from worker.model.step_weights import gather_step_weights
    g = torch.Generator().manual_seed(5)
    layers = [QuantizedLinear(quantize(torch.randn(n, 256, generator=g), 4, group_size=128), path="ours")
              for n in (24, 13)]
    x = torch.randn(2, 256, generator=g)
    want = [layer(x) for layer in layers]
    for layer in layers:
        layer.hold_weight_panels()
    gather_step_weights(layers)
    tiles = [layer.kernel_weight() for layer in layers]
    assert len({t.untyped_storage().data_ptr() for t in tiles}) == 1
    assert all(layer.scales.untyped_storage().data_ptr() != tiles[0].untyped_storage().data_ptr() for layer in layers)
    model = torch.nn.Sequential(*layers)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["0.qweight"].shape == (24, 128)
    model.load_state_dict(saved)
    for layer, before, expected in zip(layers, tiles, want):
        assert layer.held_panels == "weight" and torch.equal(layer.kernel_weight(), before)
        assert torch.equal(layer(x), expected)


def test_a_layer_with_other_groups_stays_row_major():
    layer = QuantizedLinear(quantize(torch.randn(16, 256), 4, group_size=64), path="ours")
    layer.hold_weight_panels()
    assert layer.held_panels is None and "qweight" in layer._buffers


@needs_tiles
def test_an_engine_on_held_tiles_generates_what_it_does_on_row_major_weights(tmp_path, monkeypatch):
    """Every projection and the head held as tiles, through the one-call step: the same greedy
    tokens, prompt and decode, as the same engine on row-major weights."""
    from worker.engine import Engine
    folder = make_checkpoint(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 4]]

    def generate() -> tuple[list[list[int]], int]:
        engine = Engine.from_model_dir(folder, device="cpu", quantization="mixed", quantization_calibration="none",
                                       quantization_rule="*:int4,head:int4", num_kv_blocks=32)
        layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
        held = sum(m.held_panels == "weight" for m in layers)
        return [out.token_ids for out in engine.generate(prompts, params)], held

    tokens, held = generate()
    monkeypatch.setattr(int4_weight_tiles, "supported", lambda in_features, group_size: False)
    row_major_tokens, none_held = generate()
    assert held == 4 * 2 + 1 and none_held == 0  # 2 layers' qkv, o, gate_up and down, and the head
    assert tokens == row_major_tokens
