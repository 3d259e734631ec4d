"""How a model's quantized layers hold what each decode step reads: switched to int8 activations
(`use_int8_activations`: their weight as those kernels' panels), weight-only layers' weight as
our kernels stream it (`hold_weight_panels`), and every such tensor gathered
into one allocation (`gather_step_weights`, worker/model/weight_arena.py) so that, with huge
pages on, a step streams its weights from 2 MiB pages."""
from __future__ import annotations

from torch import nn

from worker.model import weight_arena
from worker.model.quantization import QuantizedLinear


def use_int8_activations(model: nn.Module) -> tuple[int, int]:
    """Quantize the activations of every quantized layer that can take it (`takes_int8_activations`)
    per 32-block to int8, and run it through our integer kernels at every step size: a token's
    result then never depends on the step it ran in (decode, prompt chunk, recompute after
    preemption). Each switched layer holds its weight as those kernels' panels. (layers switched,
    quantized layers in all)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    switched = [layer for layer in layers if layer.takes_int8_activations()]
    for layer in switched:
        layer.int8_activations, layer.small_path, layer.path = True, "ours", "ours"
        layer.hold_int8_activation_panels()
    gather_step_weights(switched)
    return len(switched), len(layers)


def hold_weight_panels(model: nn.Module) -> int:
    """Hold the weight of every weight-only layer our kernels run in the layout they stream
    (`QuantizedLinear.hold_weight_panels`); the layers that hold it now."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.hold_weight_panels()
    return sum(layer.held_panels == "weight" for layer in layers)


def gather_step_weights(layers: list[QuantizedLinear]) -> None:
    """Hold what each decode step reads of these layers (on the CPU, not yet in an arena) in one
    allocation (worker/model/weight_arena.py: with huge pages on, all of it on 2 MiB pages): the
    int8-activation panels and group columns where held (an INT4 weight's columns inside its
    panels; else their scales and zeros), or the weight-only layers' weight (held tiles with their
    columns inside; panels or row-major, with scales and zeros)."""
    layers = list({id(layer): layer for layer in layers
                   if not layer.in_arena and layer.scales.device.type == "cpu"}.values())
    def read_per_step(layer: QuantizedLinear) -> tuple[str, ...]:
        if "qweight_panels" not in layer._buffers:
            return ("qweight", "scales", "zeros")
        if layer.columns_in_panels:
            return ("qweight_panels",)
        return ("qweight_panels", "scale_columns") if "scale_columns" in layer._buffers else (
            "qweight_panels", "scales", "zeros")
    held = [(layer, name) for layer in layers for name in read_per_step(layer)
            if layer._buffers.get(name) is not None]
    for (layer, name), view in zip(held, weight_arena.gather([layer._buffers[name] for layer, name in held])):
        layer._buffers[name] = view
    for layer in layers:
        layer.in_arena = True
