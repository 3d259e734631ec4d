"""Int8 activations (`quantization_activations = "int8"`): the quantized layers quantize their input
per 32-block and take integer dot products. The kernels against a torch statement of the same
arithmetic, the engine's routes against each other, and the setting's refusals."""
from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from paged_steps import random_paged_step
from shared.engine_config import ConfigError, EngineConfig
from shared.quantization_rule import QuantizationRule
from shared.sampling_params import SamplingParams
from worker.model import cpu_kernels
from worker.model.cpu_fast_path import CpuFastPath, choose_fast_path
from worker.model.int8_activation_panels import (COLUMN_BLOCK_BYTES, from_panels, to_panels, with_group_columns,
                                                 without_group_columns)
from worker.model.quantization import QuantizedLinear
from worker.model.quantized_weight import dequantize, quantize
from worker.model.quantize_model import quantize_model
from worker.model.step_weights import use_int8_activations
from worker.model.weights import load_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per 32-block, the largest |x| maps to 127, rounded half to even."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).view_as(x)


def _reference(x: torch.Tensor, qw) -> torch.Tensor:
    """In float64: the int8-rounded x against the dequantized weight."""
    return _quantized_activations(x).double() @ dequantize(qw).double().t()


@pytest.mark.parametrize("bits, in_features, group_size", [
    (8, 256, 0), (8, 96, 0),  # whole 64-wide steps; an odd number of blocks
    (4, 256, 128), (4, 96, 32), (4, 192, 96),  # groups of 4, 1 and 3 blocks
    (4, 512, 256),  # groups of two whole units (AVX2's one-row tile steps through them)
])
def test_the_kernels_compute_the_int8_rounded_product(bits, in_features, group_size):
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(bits * 1000 + in_features)
    weight = torch.randn(37, in_features, generator=g)  # a ragged last tile of weight rows
    qw = quantize(weight, bits, group_size=group_size or 128)
    panels = to_panels(qw.qweight, bits, in_features, qw.group_size)
    for rows in (1, 2, 3, 4, 7, 9):
        x = torch.randn(rows, in_features, generator=g)
        x[0, :32] = 0.0  # an all-zero block has scale 0
        out = torch.empty(rows, 37)
        if bits == 8:
            kernels.linear_int8_weights_int8_activations(x, panels, qw.scales, out)
        else:
            kernels.linear_int4_weights_int8_activations(x, panels, qw.scales, qw.zeros, qw.group_size, out)
        want = _reference(x, qw)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
        # And close to the weight-only product: the rounding of x is at most 1/254 of its block's range.
        exact = x.double() @ dequantize(qw).double().t()
        assert (out.double() - exact).norm() < 0.02 * exact.norm(), rows
        # Whatever the tile a row lands in, its result is the one it gets alone, bit for bit (with
        # AVX-512 VNNI one kernel runs every row count, its register tiles of 1-4 rows splitting
        # the integer sums differently but summing the floats in the same order).
        alone = torch.empty(1, 37)
        for i in range(rows):
            if bits == 8:
                kernels.linear_int8_weights_int8_activations(x[i:i + 1], panels, qw.scales, alone)
            else:
                kernels.linear_int4_weights_int8_activations(x[i:i + 1], panels, qw.scales, qw.zeros, qw.group_size,
                                                             alone)
            assert torch.equal(alone[0], out[i]), (rows, i)


@pytest.mark.parametrize("bits, in_features, group_size", [(8, 96, 0), (4, 192, 96), (4, 96, 32), (4, 256, 128)])
def test_a_layer_holds_its_weight_once_as_panels_and_saves_it_row_major(bits, in_features, group_size):
    g = torch.Generator().manual_seed(in_features + group_size)
    qw = quantize(torch.randn(10, in_features, generator=g), bits, group_size=group_size or 128)
    for output_major in (False, True):
        panels = to_panels(qw.qweight, bits, in_features, qw.group_size, output_major=output_major)
        assert torch.equal(from_panels(panels, bits, qw.shape, qw.group_size), qw.qweight), output_major
    layer = QuantizedLinear(qw)
    x = torch.randn(3, in_features, generator=g)
    before = layer(x)  # weight-only
    saved = {k: v.clone() for k, v in layer.state_dict().items()}
    model = torch.nn.Sequential(layer)
    assert use_int8_activations(model) == (1, 1)
    kernels = cpu_kernels.load()
    # One copy: the panels, in the layout this host's kernels read (output-major INT4 with its
    # group columns inside, INT8 with them beside).
    assert "qweight" not in layer._buffers
    output_major = kernels.int8_activations_output_major()
    assert layer.columns_in_panels == (output_major and bits == 4)
    assert layer.kernel_weight().dim() == ((3 if bits == 4 else 4) if output_major else 3)
    if output_major and bits == 8:
        assert torch.equal(layer.kernel_scales(), kernels.int8_activation_group_columns(layer.scales, layer.zeros))
    else:
        assert layer.kernel_scales() is layer.scales
    assert torch.equal(layer.qweight, qw.qweight)  # read back row-major
    state = layer.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    after = layer(x)
    assert (after - before).norm() < 0.02 * before.norm()  # x rounded per block, nothing else
    # A checkpoint loads into a layer with panels, which keeps them; and into a fresh shell.
    layer.load_state_dict(saved)
    assert "qweight" not in layer._buffers and torch.equal(layer(x), after)
    shell = QuantizedLinear.empty(bits, qw.shape, qw.group_size)
    shell.load_state_dict(state)
    assert torch.equal(shell(x), before)


@pytest.mark.parametrize("bits, group_size", [(8, 0), (4, 128), (4, 32)])
def test_output_major_panels_give_each_output_a_32_bit_lane_of_its_units(bits, group_size):
    """[ceil(N / 16), units, 16, 64]: bytes 4c..4c + 3 of unit u of row o of panel p at [p, u, c,
    4o..4o + 3], each unit what the tile layout holds for that row (INT8 + 128, INT4 two slots'
    nibbles); the rows past N zero weights."""
    g = torch.Generator().manual_seed(bits + group_size)
    in_features = 256
    qw = quantize(torch.randn(37, in_features, generator=g), bits, group_size=group_size or 128)
    tiles = to_panels(qw.qweight, bits, in_features, qw.group_size, output_major=False).view(torch.uint8)
    panels = to_panels(qw.qweight, bits, in_features, qw.group_size, output_major=True).view(torch.uint8)
    units = tiles.shape[1] // 4
    assert panels.shape == (3, units, 16, 64)
    for row in (0, 5, 16, 36):
        for u in range(units):
            unit = tiles[row // 4, 4 * u + row % 4]
            for c in (0, 7, 15):
                got = panels[row // 16, u, c, 4 * (row % 16):4 * (row % 16) + 4]
                assert torch.equal(got, unit[4 * c:4 * c + 4]), (row, u, c)
    padding = panels[2, :, :, 4 * 5:].reshape(-1)  # rows 37..47
    assert bool((padding == (128 if bits == 8 else 0)).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernels_refuse_panels_in_the_other_layout(bits):
    kernels = cpu_kernels.load()
    qw = quantize(torch.randn(32, 64), bits, group_size=32)
    other = to_panels(qw.qweight, bits, 64, qw.group_size, output_major=not kernels.int8_activations_output_major())
    out = torch.empty(1, 32)
    with pytest.raises(RuntimeError, match="panels"):
        if bits == 8:
            kernels.linear_int8_weights_int8_activations(torch.randn(1, 64), other, qw.scales, out)
        else:
            kernels.linear_int4_weights_int8_activations(torch.randn(1, 64), other, qw.scales, qw.zeros, 32, out)


@pytest.mark.parametrize("out_features, groups", [(37, 3), (8, 1), (16, 0)])
def test_group_columns_put_each_8_rows_scales_then_zeros_side_by_side(out_features, groups):
    """[ceil(N / 8), G, 2, 8]: run r, group g holds rows 8r..8r + 7's scales, then their zeros (0
    for an INT8 weight's per-row scales), the rows past N repeating the last."""
    kernels = cpu_kernels.load()
    scales = torch.randn(out_features, groups) if groups else torch.randn(out_features)
    zeros = torch.randn(out_features, groups) if groups else None
    columns = kernels.int8_activation_group_columns(scales, zeros)
    runs = -(-out_features // 8)
    rows = torch.arange(runs * 8).clamp(max=out_features - 1)
    as_groups = scales.view(out_features, -1)
    want_scales = as_groups[rows].view(runs, 8, -1).transpose(1, 2)
    want_zeros = (zeros[rows] if zeros is not None else torch.zeros(runs * 8, 1)).view(runs, 8, -1).transpose(1, 2)
    assert columns.shape == (runs, as_groups.shape[1], 2, 8)
    assert torch.equal(columns[:, :, 0], want_scales) and torch.equal(columns[:, :, 1], want_zeros)


@pytest.mark.parametrize("bits, in_features, group_size", [(8, 256, 0), (4, 256, 128), (4, 96, 32)])
def test_the_kernels_give_the_same_result_from_group_columns_or_row_major_scales(bits, in_features, group_size):
    """Where the kernels take group columns (AVX-512), a caller that holds only row-major scales
    gets them made for its call: the same result, bit for bit, at one row and at many."""
    kernels = cpu_kernels.load()
    if not kernels.int8_activations_output_major():
        pytest.skip("these kernels take row-major scales only")
    g = torch.Generator().manual_seed(7)
    qw = quantize(torch.randn(45, in_features, generator=g), bits, group_size=group_size or 128)
    panels = to_panels(qw.qweight, bits, in_features, qw.group_size)
    columns = kernels.int8_activation_group_columns(qw.scales, qw.zeros)
    for rows in (1, 2, 5):
        x = torch.randn(rows, in_features, generator=g)
        held, made = torch.empty(rows, 45), torch.empty(rows, 45)
        if bits == 8:
            kernels.linear_int8_weights_int8_activations(x, panels, columns, held)
            kernels.linear_int8_weights_int8_activations(x, panels, qw.scales, made)
        else:
            kernels.linear_int4_weights_int8_activations(x, panels, columns, qw.zeros, qw.group_size, held)
            kernels.linear_int4_weights_int8_activations(x, panels, qw.scales, qw.zeros, qw.group_size, made)
        assert torch.equal(held, made), rows


@pytest.mark.parametrize("in_features, group_size", [(256, 128), (192, 64), (96, 32), (384, 192), (512, 256)])
def test_int4_panels_carry_each_groups_columns_after_the_unit_that_ends_it(in_features, group_size):
    """[P, bytes]: the units in order, and after the unit holding a group's last slot (a unit is
    two slots of 64 features, a group ceil(G / 64) slots) that group's 16 scales then 16 zeros
    (float32, the rows past N zero); `without_group_columns` gives the panels back."""
    g = torch.Generator().manual_seed(in_features + group_size)
    qw = quantize(torch.randn(21, in_features, generator=g), 4, group_size=group_size)
    panels = to_panels(qw.qweight, 4, in_features, group_size, output_major=True)
    inside = with_group_columns(panels, qw.scales, qw.zeros, group_size)
    slots_per_group, groups = -(-group_size // 64), in_features // group_size
    units = -(-slots_per_group * groups // 2)
    assert inside.shape == (2, (units * 1024 + groups * COLUMN_BLOCK_BYTES) // 64, 64)
    assert torch.equal(without_group_columns(inside, in_features, group_size), panels)
    assert torch.equal(from_panels(inside, 4, qw.shape, group_size), qw.qweight)
    inside = inside.view(2, -1)
    scales = torch.cat((qw.scales, torch.zeros(11, groups)))
    zeros = torch.cat((qw.zeros, torch.zeros(11, groups)))
    at, group = 0, 0
    for unit in range(units):
        assert torch.equal(inside[:, at:at + 1024], panels[:, unit].reshape(2, 1024))
        at += 1024
        for slot in (2 * unit, 2 * unit + 1):
            if slot < slots_per_group * groups and (slot + 1) % slots_per_group == 0:
                block = inside[:, at:at + COLUMN_BLOCK_BYTES].contiguous().view(torch.float32).view(2, 2, 16)
                assert torch.equal(block[:, 0], scales[:, group].view(2, 16))
                assert torch.equal(block[:, 1], zeros[:, group].view(2, 16))
                at, group = at + COLUMN_BLOCK_BYTES, group + 1
    assert (at, group) == (inside.shape[1], groups)


@pytest.mark.parametrize("in_features, group_size", [(256, 128), (192, 64), (96, 32), (384, 192), (512, 256)])
def test_the_int4_kernels_give_the_same_result_from_columns_inside_the_panels(in_features, group_size):
    """Columns inside the panels, held beside them, or made from row-major scales: the same
    result, bit for bit, at every row count (each row tile, one panel at a time or two)."""
    kernels = cpu_kernels.load()
    if not kernels.int8_activations_output_major():
        pytest.skip("only the output-major kernels take columns inside their panels")
    g = torch.Generator().manual_seed(in_features)
    out_features = 45  # two pairs of panels and one alone, the last part empty
    qw = quantize(torch.randn(out_features, in_features, generator=g), 4, group_size=group_size)
    panels = to_panels(qw.qweight, 4, in_features, group_size)
    inside = with_group_columns(panels, qw.scales, qw.zeros, group_size)
    columns = kernels.int8_activation_group_columns(qw.scales, qw.zeros)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, in_features, generator=g)
        got, beside = torch.empty(rows, out_features), torch.empty(rows, out_features)
        kernels.linear_int4_weights_int8_activations(x, inside, qw.scales, qw.zeros, group_size, got)
        kernels.linear_int4_weights_int8_activations(x, panels, columns, qw.zeros, group_size, beside)
        assert torch.equal(got, beside), rows
    with pytest.raises(RuntimeError, match="group columns inside"):
        kernels.linear_int4_weights_int8_activations(x, inside[:, :-1].contiguous(), qw.scales, qw.zeros, group_size, got)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernels_take_no_rows_and_refuse_scales_of_another_shape(bits):
    kernels = cpu_kernels.load()
    qw = quantize(torch.randn(32, 64), bits, group_size=32)
    panels = to_panels(qw.qweight, bits, 64, qw.group_size)
    def run(x, scales, out):
        if bits == 8:
            kernels.linear_int8_weights_int8_activations(x, panels, scales, out)
        else:
            kernels.linear_int4_weights_int8_activations(x, panels, scales, qw.zeros, qw.group_size, out)
    run(torch.empty(0, 64), qw.scales, torch.empty(0, 32))  # nothing to compute, nothing touched
    with pytest.raises(RuntimeError, match="scales"):
        run(torch.randn(1, 64), qw.scales[:8], torch.empty(1, 32))


def test_layers_whose_shape_takes_no_int8_blocks_keep_float_activations():
    kernels = cpu_kernels.load()
    assert kernels.int8_activations_supported(96, 96) and not kernels.int8_activations_supported(72, 72)
    model = torch.nn.Sequential()
    model.add_module("wide", QuantizedLinear(quantize(torch.randn(16, 64), 8)))
    model.add_module("odd", QuantizedLinear(quantize(torch.randn(16, 72), 8)))
    assert use_int8_activations(model) == (1, 2)
    assert model.wide.int8_activations and (model.wide.small_path, model.wide.path) == ("ours", "ours")
    assert not model.odd.int8_activations


def _int8_activation_model(folder, rule: str):
    model = load_model(folder)
    quantize_model(model, QuantizationRule.parse(rule), measure_paths=False)
    assert use_int8_activations(model)[0] > 0
    return model


@pytest.mark.parametrize("rule", ["*:int8", "*:int4", "attention:int8,mlp:int4"])
def test_the_one_call_computes_what_the_layers_compute_at_every_step_size(tmp_path, rule):
    folder = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2)
    model = _int8_activation_model(folder, rule)
    fast, reason = choose_fast_path(model, release_float_weights=False)
    assert fast.one_call_tensors_large is not None and "int8 activations" in reason
    by_layers = CpuFastPath(model, cpu_kernels.load(), release_float_weights=False, one_call=False)
    cfg = model.config
    for query_lens, context_lens in (([1, 1, 1], [40, 17, 3]), ([1, 40], [3, 0]), ([70], [5])):
        g = torch.Generator().manual_seed(len(query_lens))
        step = random_paged_step(query_lens, context_lens, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                 generator=g, num_layers=cfg.num_layers)
        ids = torch.randint(3, cfg.vocab_size, (sum(query_lens),), generator=g)
        results = []
        for computes in (fast, by_layers, model):
            kv = [(k.clone(), v.clone()) for k, v in step.kv_caches]
            with torch.inference_mode():
                hidden = computes.forward(ids, step.positions, kv, step.meta)
                results.append((hidden, computes.compute_logits(hidden)))
        for got, want in zip(results[0], results[1]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The modules run the same projections with torch's norms and rotary, whose last bits may
        # move an input across a step of its int8 grid (1/254 of its block's range), and a moved
        # input moves the next layer's: close (a wrong route is off by O(1)), not equal.
        for got, want in zip(results[0], results[2]):
            torch.testing.assert_close(got, want, atol=5e-2, rtol=0)


def test_an_engine_with_int8_activations_gives_each_request_the_tokens_it_gets_alone(tmp_path):
    """Every step size runs the same per-token arithmetic, so batching, chunking and the prefix
    cache never change a token."""
    from worker.engine import Engine
    folder = make_checkpoint(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256)
    engine = Engine.from_model_dir(folder, device="cpu", quantization="int8", quantization_activations="int8",
                                   quantization_calibration="none", num_kv_blocks=64, max_prefill_chunk_tokens=16)
    assert "int8 activations" in engine.runner.fast_path.describe()
    assert list(engine.quantization_report.paths) == ["ours/ours int8 activations"]
    prompts = [list(range(3, 60)), [9] * 12, [40, 41, 42]]
    together = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    alone = []
    for prompt in prompts:
        engine.evict_prefix_cache()
        alone.append(engine.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids)
    assert together == alone
    engine.runner.fast_path = None  # the modules: the same kernels per layer
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == together


def test_the_setting_is_refused_where_it_cannot_apply(tmp_path):
    from worker.engine import Engine
    with pytest.raises(ConfigError, match="quantization_activations"):
        EngineConfig(quantization_activations="int4")
    folder = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="needs quantized layers"):
        Engine.from_model_dir(folder, device="cpu", quantization_activations="int8", num_kv_blocks=16)
    with pytest.raises(ConfigError, match=r"quantization 'mixed' \(quantization_rule 'attention:none'\) quantizes"):
        Engine.from_model_dir(folder, device="cpu", quantization_activations="int8", quantization="mixed",
                              quantization_rule="attention:none", quantization_calibration="none", num_kv_blocks=16)
