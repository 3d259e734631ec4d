"""One allocation for what a decode step streams (worker/model/weight_arena.py): the copies are
equal, aligned views of one storage; int8-activation layers hold their panels, scales and zeros
there, and weight-only layers their weight (INT4's held tiles, with the scales and zeros inside,
where this host's kernels take them), scales and zeros; both compute what they computed
and still save tensors of their own."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model import cpu_kernels, int4_weight_tiles, weight_arena
from worker.model.quantization import QuantizedLinear
from worker.model.quantized_weight import quantize
from worker.model.step_weights import gather_step_weights, use_int8_activations


def test_gather_copies_into_one_storage_at_cache_line_boundaries():
    tensors = [torch.randn(3, 5), torch.randint(0, 255, (7,), dtype=torch.uint8), torch.randn(2, 2).double()]
    views = weight_arena.gather(tensors)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    for original, view in zip(tensors, views):
        assert view.dtype == original.dtype and view.shape == original.shape and torch.equal(view, original)
        assert view.data_ptr() % weight_arena.ALIGN_BYTES == 0 and view.is_contiguous()
    tensors[0].zero_()  # copies, not aliases
    assert views[0].abs().sum() > 0
    assert weight_arena.gather([]) == []


@pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")
def test_int8_activation_layers_share_one_arena_and_save_their_own_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(QuantizedLinear(quantize(torch.randn(40, 128, generator=g), 4, group_size=64)),
                                QuantizedLinear(quantize(torch.randn(24, 96, generator=g), 8)))
    x0, x1 = torch.randn(2, 128, generator=g), torch.randn(2, 96, generator=g)
    reference = torch.nn.Sequential(*[QuantizedLinear.empty(m.bits, m.shape, m.group_size) for m in model])
    reference.load_state_dict(model.state_dict())
    assert use_int8_activations(reference) == (2, 2)
    want = (reference[0](x0), reference[1](x1))
    assert use_int8_activations(model) == (2, 2)
    # What a step reads: the panels, and the group columns where the kernels take them (AVX-512:
    # INT4's inside its panels, INT8's beside them), else the scales and zeros.
    if model[0].columns_in_panels:
        assert model[1].kernel_scales().dim() == 4
        held = [model[0].kernel_weight(), model[1].kernel_weight(), model[1].kernel_scales()]
    else:
        held = [t for m in model for t in (m.kernel_weight(), m.scales, m.zeros) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    assert torch.equal(model[0](x0), want[0]) and torch.equal(model[1](x1), want[1])
    state = model.state_dict()
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
    save_file(state, str(tmp_path / "model.safetensors"))  # refuses tensors that share memory
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # Loaded back (re-packed: new panels, the scales still the arena's where the kernels read
    # them row-major), it still saves tensors of its own.
    model.load_state_dict(loaded)
    assert torch.equal(model[0](x0), want[0])
    save_file(model.state_dict(), str(tmp_path / "again.safetensors"))


def test_weight_only_layers_share_one_arena_and_save_their_own_tensors(tmp_path):
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(QuantizedLinear(quantize(torch.randn(40, 128, generator=g), 4, group_size=64)),
                                QuantizedLinear(quantize(torch.randn(24, 96, generator=g), 8)))
    x0, x1 = torch.randn(3, 128, generator=g), torch.randn(3, 96, generator=g)
    want = (model[0](x0), model[1](x1))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    gather_step_weights(list(model))
    held = [t for m in model for t in (m.qweight, m.scales, m.zeros) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    assert torch.equal(model[0](x0), want[0]) and torch.equal(model[1](x1), want[1])
    first = model[0].qweight.data_ptr()
    gather_step_weights(list(model))  # once in an arena, left there
    assert model[0].qweight.data_ptr() == first
    state = model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
    save_file(state, str(tmp_path / "model.safetensors"))  # refuses tensors that share memory
    # A checkpoint loads into the arena's views in place.
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    assert model[0].qweight.data_ptr() == first and torch.equal(model[0](x0), want[0])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")
def test_layers_switched_to_int8_activations_after_a_gather_leave_that_arena(tmp_path):
    """The first arena holds every row-major weight: the switched layers keep no view of it."""
    g = torch.Generator().manual_seed(6)
    model = torch.nn.Sequential(QuantizedLinear(quantize(torch.randn(40, 128, generator=g), 4, group_size=64)),
                                QuantizedLinear(quantize(torch.randn(24, 96, generator=g), 8)))
    gather_step_weights(list(model))
    first_arena = model[0].qweight  # kept alive here, so no later allocation takes its address
    assert use_int8_activations(model) == (2, 2)
    held = [t for m in model for t in (m.kernel_weight(), m.kernel_scales(), m.scales, m.zeros) if t is not None]
    assert all(t.untyped_storage().data_ptr() != first_arena.untyped_storage().data_ptr() for t in held)
    assert all(m.in_arena for m in model)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("load_mode", ["full", "on_demand"])
def test_a_cpu_engine_holds_its_weight_only_layers_in_one_arena(tmp_path, load_mode):
    """Not with on_demand, whose layer slots copy from the tensors it already holds."""
    from conftest import make_checkpoint
    from worker.engine import Engine
    folder = make_checkpoint(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256)
    engine = Engine.from_model_dir(folder, device="cpu", quantization="int4", quantization_calibration="none",
                                   num_kv_blocks=16, load_mode=load_mode)
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers
    if load_mode == "full":
        assert all(m.in_arena for m in layers)
        # What each step reads (INT4 held tiles where this host's kernels take them, else row-major).
        assert len({m.kernel_weight().untyped_storage().data_ptr() for m in layers}) == 1
        if int4_weight_tiles.supported(128, 128):
            assert all(m.held_panels == "weight" and m.kernel_weight().dim() == 4 for m in layers)
    else:
        assert not any(m.in_arena for m in layers)
