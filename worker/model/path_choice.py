"""Which compute path a quantized layer takes: the paths, the step size that splits a layer's
decode-sized path from its prefill-sized one, and `choose_path`, which times the available
paths on a layer's own shape and device. Pure tensor code; it sets a layer's path attributes
and keeps no state of its own (the per-model choices live in `QuantizationPlan`).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 32  # at or below, a step is decode-sized: reading the weight dominates
PATHS = ("ours", "kernel", "dequant")
PATH_TIMING_REPEATS = 3  # timed runs per path and row count when a plan measures a layer


def choose_path(layer: nn.Module, rows: int = 1, repeats: int = 5) -> str:
    """Time every available path on `rows` rows of this layer's (a `QuantizedLinear`) shape and
    device and keep the fastest correct one for steps of that size (`small_path` up to
    SMALL_ROWS rows, else `path`)."""
    x = torch.randn(rows, layer.in_features, dtype=layer.scales.dtype, device=layer.scales.device)
    scaled = x if layer.input_scale is None else x * layer.input_scale
    reference = F.linear(scaled, layer.dequantized())
    attribute = "small_path" if rows <= SMALL_ROWS else "path"
    timings = {}
    for path in PATHS:
        if not layer.path_available(path, x.device):
            continue
        setattr(layer, attribute, path)
        try:
            y = layer(x)
        except RuntimeError:  # this torch build has no such kernel for this device or dtype
            continue
        if not torch.allclose(y - (0 if layer.bias is None else layer.bias), reference, rtol=1e-2, atol=1e-2):
            continue
        best = min(timings.values(), default=float("inf"))
        fastest, count = float("inf"), 0
        # A path's time is its fastest call: a call a neighbour process slowed says nothing about
        # the path, and a mean would let one such call pick the slower path for the whole run.
        # Repeats only while a path is in the running: two calls, the faster still twice the best so
        # far, settle it (torch's packed kernels can be far slower at prefill sizes, and every layer is timed).
        while count < repeats and (count < 2 or fastest < 2 * best):
            started = time.perf_counter()
            layer(x)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            fastest, count = min(fastest, time.perf_counter() - started), count + 1
        timings[path] = fastest
    setattr(layer, attribute, min(timings, key=timings.get) if timings else "dequant")
    return getattr(layer, attribute)
