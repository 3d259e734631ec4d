"""Weight-only quantized layers: INT8 per output channel, INT4 group-wise packed two per byte,
in the stored formats of worker/model/quantized_weight.py.

`QuantizedLinear` computes by one of three paths: "ours" (our C++ kernels widen int8/int4 to
float in registers, CPU only; weight-only layers an engine serves hold their weight in the layout
those kernels stream, `hold_weight_panels`; or, opted in by `use_int8_activations`
(worker/model/step_weights.py), quantize the activations per 32-block to int8 and take integer
dot products), "kernel" (torch's packed matmuls) or
"dequant" (rebuild the float weight into a reused buffer, then the float matmul). A
`QuantizationPlan`, one per model, gives decode-sized steps our kernel wherever it runs (else
the faster of the others), times the paths (`choose_path`, worker/model/path_choice.py) on each
kind of layer's own shape and device for prefill-sized steps, and owns the buffer the dequant
path rebuilds weights into: nothing is kept process-wide, so one engine's choices never
depend on what ran before it in the process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model import cpu_kernels, int4_weight_tiles
from worker.model.int8_activation_panels import (from_panels, host_layout_is_output_major, to_panels,
                                                 with_group_columns)
from worker.model.layers import pack_panels, unpack_panels
# `choose_path` is called through this module's namespace (tests replace it here).
from worker.model.path_choice import PATH_TIMING_REPEATS, SMALL_ROWS, choose_path
from worker.model.quantized_weight import QuantizedWeight, dequantize_int4, pack_int4, unpack_int4

# A layer's saved buffers that may be views of an arena (`gather_step_weights`).
ARENA_SAVED_BUFFERS = ("qweight", "scales", "zeros")


# ---- compute -----------------------------------------------------------------------------------
def _torch_int4_operands(qw: QuantizedWeight, device: torch.device):
    """torch's packed INT4 layout for this device, or None where torch has no kernel."""
    q = unpack_int4(qw.qweight).to(torch.int32)
    # torch's kernels dequantize as (q - 8) * scale + zero.
    scales_and_zeros = torch.stack([qw.scales, qw.zeros + 8 * qw.scales], dim=-1)  # [N, K/G, 2]
    scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous()  # [K/G, N, 2]
    if device.type == "cpu" and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return torch._convert_weight_to_int4pack_for_cpu(q, 2), scales_and_zeros
    if device.type == "cuda" and hasattr(torch, "_convert_weight_to_int4pack"):
        packed = pack_int4(q.to(torch.uint8))
        # The CUDA kernel wants the high nibble first and bf16 scales.
        packed = (packed >> 4) | ((packed & 0x0F) << 4)
        return torch._convert_weight_to_int4pack(packed.to(device), 8), scales_and_zeros.to(device, torch.bfloat16)
    return None


class QuantizedLinear(nn.Module):
    """y = (x * input_scale) W^T (+ b) with W stored quantized. `small_path` (steps of up to
    SMALL_ROWS rows) and `path` (larger ones) are each "ours", "kernel" or "dequant", set by the
    plan (`QuantizationPlan.choose_paths`) or by hand.

    Its state is persistent buffers (`qweight`, `scales`, optional `zeros` and `input_scale`)
    and an optional `bias`, so `state_dict` saves it and a shell from `empty` loads it back.
    `input_scale` is activation-aware scaling (worker/model/calibration.py): the stored
    weight is W / input_scale per input channel, so salient channels were quantized larger.
    `plan` is the model's QuantizationPlan (a layer made on its own gets a plan of its own).

    With int8 activations (`use_int8_activations`) the weight is held as the panels those kernels
    read (worker/model/int8_activation_panels.py) instead of row-major: one copy, not two; a
    weight-only layer an engine serves on our kernels holds it as they stream it
    (`hold_weight_panels`: INT8 as the float tiles' panels, INT4 as held tiles with its scales and
    zeros inside, worker/model/int4_weight_tiles.py). Reading `qweight` then rebuilds the
    row-major weight each time (a read-only copy), and `state_dict()` still saves it row-major."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 path: str = "dequant", input_scale: torch.Tensor | None = None,
                 plan: "QuantizationPlan | None" = None):
        super().__init__()
        self.plan = plan if plan is not None else QuantizationPlan()
        self.bits = qw.bits
        self.shape = tuple(qw.shape)
        self.group_size = qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales.to(dtype))
        self.register_buffer("zeros", None if qw.zeros is None else qw.zeros.to(dtype))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self._int4_operands: tuple[torch.device, tuple] | None = None  # (built for, operands)
        self.path = path  # for steps of more than SMALL_ROWS rows
        self.small_path = path  # for up to SMALL_ROWS rows
        self.int8_activations = False  # set by `use_int8_activations`
        self.in_arena = False  # set by `gather_step_weights`
        self.held_panels: str | None = None  # the layout of `qweight_panels` where held: "weight" or "int8_activations"

    @classmethod
    def empty(cls, bits: int, shape: tuple[int, int], group_size: int = 0, has_bias: bool = False,
              has_input_scale: bool = False, dtype: torch.dtype = torch.float32) -> "QuantizedLinear":
        """A shell with the right buffers (uninitialised) for `load_state_dict` to fill."""
        n, k = shape
        if bits == 8:
            qw = QuantizedWeight(8, torch.empty(n, k, dtype=torch.int8), torch.empty(n), None, (n, k))
        elif bits == 4:
            groups = k // group_size
            qw = QuantizedWeight(4, torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, groups),
                                 torch.empty(n, groups), (n, k), group_size)
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        return cls(qw, torch.empty(n) if has_bias else None, dtype,
                   input_scale=torch.empty(k) if has_input_scale else None)

    def kernel_weight(self) -> torch.Tensor:
        """The weight as our kernels take it: its panels where held (`held_panels`), else qweight."""
        panels = self._buffers.get("qweight_panels")
        return self.qweight if panels is None else panels

    def kernel_scales(self) -> torch.Tensor:
        """The scales as our kernels take them: where held, the int8-activation kernels' group
        columns (the scales and zeros of each 8 rows side by side per group), else `scales`."""
        columns = self._buffers.get("scale_columns")
        return self.scales if columns is None else columns

    @property
    def columns_in_panels(self) -> bool:
        """Whether the held panels carry the scales and zeros inside: an INT4 weight's held tiles,
        or its int8-activation panels where the kernels read the output-major layout
        (`with_group_columns`)."""
        if self.bits != 4:
            return False
        return self.held_panels == "weight" or (self.held_panels == "int8_activations"
                                                and host_layout_is_output_major())

    def hold_int8_activation_panels(self) -> None:
        """Hold the weight as int8-activation panels and drop the row-major copy. Where those
        kernels read the output-major layout (AVX-512 VNNI), they also take the scales' group
        columns (an eighth of the INT4 weight's bytes at groups of 128) rather than gathering per
        group: an INT4 weight's inside its panels, each after the unit that ends its group (one
        stream per panel), an INT8 weight's (one group a row) held beside them."""
        if self.held_panels == "int8_activations":
            return
        panels = to_panels(self.qweight, self.bits, self.in_features, self.group_size)
        output_major = host_layout_is_output_major()
        if output_major and self.bits == 4:
            panels = with_group_columns(panels, self.scales, self.zeros, self.group_size)
        self._hold_panels("int8_activations", panels)
        if output_major and self.bits == 8:
            self.register_buffer("scale_columns",
                                 cpu_kernels.load().int8_activation_group_columns(self.scales, self.zeros),
                                 persistent=False)

    def hold_weight_panels(self) -> None:
        """Where our kernels run this weight-only layer, hold its weight in the layout they stream
        and drop the row-major copy, and run it through them at every step size: INT8 as int8
        panels (`pack_panels`, grouped as this host's kernels read them best; widened inside the
        float32 panel tiles), INT4 with groups of 128 on AVX2 and AVX-512 hosts as held tiles
        (worker/model/int4_weight_tiles.py: one stream per 8 rows, scales and zeros inside)."""
        if (self.int8_activations or self.held_panels is not None
                or not self.path_available("ours", self.scales.device)):
            return
        if self.bits == 8:
            panels = pack_panels(self.qweight, cpu_kernels.load().int8_weight_panel_group())
        elif int4_weight_tiles.supported(self.in_features, self.group_size):
            panels = int4_weight_tiles.to_tiles(self.qweight, self.scales, self.zeros)
        else:
            return
        self._hold_panels("weight", panels)
        self.small_path = self.path = "ours"

    def _hold_panels(self, layout: str, panels: torch.Tensor) -> None:
        self._buffers.pop("qweight_panels", None)  # the other layout's, where held
        self._buffers.pop("qweight", None)
        self.register_buffer("qweight_panels", panels, persistent=False)
        self.held_panels = layout
        if self.in_arena:
            # Out of the arena (whose row-major weights would otherwise stay alive through these
            # views), to be gathered again with the panels.
            for name in ("scales", "zeros"):
                if self._buffers.get(name) is not None:
                    self._buffers[name] = self._buffers[name].clone()
            self.in_arena = False

    def _row_major_from_panels(self, panels: torch.Tensor | None = None) -> torch.Tensor:
        panels = self._buffers["qweight_panels"] if panels is None else panels
        if self.held_panels == "weight":
            if self.bits == 4:
                return int4_weight_tiles.from_tiles(panels, self.out_features)
            return unpack_panels(panels, self.out_features)
        return from_panels(panels, self.bits, self.shape, self.group_size)

    def __getattr__(self, name: str):
        if name == "qweight" and "qweight_panels" in self._buffers:
            return self._row_major_from_panels()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Panels or not, the layer saves what a checkpoint holds: the row-major weight.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "qweight_panels" in self._buffers:
            destination[prefix + "qweight"] = self._row_major_from_panels()
        # Views of a shared arena are saved as tensors of their own: a checkpoint writer refuses
        # tensors that share memory.
        for name in ARENA_SAVED_BUFFERS:
            saved = destination.get(prefix + name)
            if saved is not None and saved.untyped_storage().nbytes() != saved.nbytes:
                destination[prefix + name] = saved.clone()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        panels = self._buffers.pop("qweight_panels", None)
        if panels is None:
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._buffers.pop("scale_columns", None)  # made again from the loaded scales
        # Loaded row-major, as saved, then held as panels again.
        self.register_buffer("qweight", self._row_major_from_panels(panels))
        layout, self.held_panels = self.held_panels, None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.hold_int8_activation_panels() if layout == "int8_activations" else self.hold_weight_panels()

    @property
    def qw(self) -> QuantizedWeight:
        return QuantizedWeight(self.bits, self.qweight, self.scales, self.zeros, self.shape, self.group_size)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def dequantized(self) -> torch.Tensor:
        """The float weight as stored (W / input_scale), rebuilt into the scratch buffer that every
        layer of the plan on this device shares (a buffer per layer would hold a float copy of
        every weight, undoing what quantization saved). Valid until the next layer's call."""
        buffer = self.plan.scratch(self.shape, self.scales.dtype, self.scales.device)
        if self.bits == 8:
            torch.mul(self.qweight.to(buffer.dtype), self.scales[:, None], out=buffer)
        else:
            buffer.copy_(dequantize_int4(self.qw, buffer.dtype))
        return buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        if self.input_scale is not None:
            x = x * self.input_scale
        path = self.small_path if x.shape[0] <= SMALL_ROWS else self.path
        if path == "dequant":
            return F.linear(x, self.dequantized(), self.bias)
        y = self._ours(x) if path == "ours" else self._kernel(x)
        return y if self.bias is None else y + self.bias

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """forward(x) written into `out` [M, N]: by our kernel directly where it is this size's path
        (a vocabulary-sized head's logits are not computed and then copied), else copied in."""
        path = self.small_path if x.shape[0] <= SMALL_ROWS else self.path
        if path == "ours" and self.input_scale is None and self.bias is None and out.is_contiguous():
            return self._ours(x, out)
        return out.copy_(self.forward(x))

    def _ours(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # Chosen only where `path_available` found our kernels and float32 CPU tensors.
        kernels = cpu_kernels.load()
        x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if self.bits == 8 and self.int8_activations:
            kernels.linear_int8_weights_int8_activations(x, self.kernel_weight(), self.kernel_scales(), out)
        elif self.bits == 8:
            kernels.linear_small_batch_int8(x, self.kernel_weight(), self.scales, out)
        elif self.int8_activations:
            kernels.linear_int4_weights_int8_activations(x, self.kernel_weight(), self.kernel_scales(), self.zeros,
                                                         self.group_size, out)
        else:
            kernels.linear_small_batch_int4(x, self.kernel_weight(), self.scales, self.zeros, self.group_size, out)
        return out

    def takes_int8_activations(self) -> bool:
        """Whether our integer kernels can run this layer: ours available, and K and the group
        size whole blocks of 32."""
        kernels = cpu_kernels.load()
        return (self.path_available("ours", self.scales.device) and kernels is not None
                and kernels.int8_activations_supported(self.in_features, self.group_size or self.in_features))

    def path_available(self, path: str, device: torch.device) -> bool:
        if path == "dequant":
            return True
        if path == "kernel":
            return self.kernel_available(device)
        # Our kernels: float32 on the CPU, 8 input features per vector, int4 groups whole vectors.
        return (device.type == "cpu" and self.scales.dtype == torch.float32 and self.in_features % 8 == 0
                and (self.bits == 8 or self.group_size % 8 == 0) and cpu_kernels.load() is not None)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return torch._weight_int8pack_mm(x, self.qweight, self.scales)
        # torch's packed layout is built once per device (a layer loaded on demand moves).
        if self._int4_operands is None or self._int4_operands[0] != x.device:
            self._int4_operands = (x.device, _torch_int4_operands(self.qw, x.device))
        packed, scales_and_zeros = self._int4_operands[1]
        if x.device.type == "cpu":
            return torch._weight_int4pack_mm_for_cpu(x, packed, self.group_size, scales_and_zeros)
        return torch._weight_int4pack_mm(x.to(torch.bfloat16), packed, self.group_size,
                                         scales_and_zeros).to(x.dtype)

    def kernel_available(self, device: torch.device) -> bool:
        if self.bits == 8:
            return hasattr(torch, "_weight_int8pack_mm")
        # Asked without building the packed operands: the same conditions `_torch_int4_operands` has.
        converter = {"cpu": "_convert_weight_to_int4pack_for_cpu", "cuda": "_convert_weight_to_int4pack"}
        return self.shape[1] % 64 == 0 and hasattr(torch, converter.get(device.type, "no such converter"))


class QuantizationPlan:
    """One model's quantized-layer state: the compute paths measured per kind of layer, and one
    scratch buffer per (device, dtype) that the dequant path rebuilds weights into. Layers run
    one after another in a worker, so one dequantized weight is alive at a time.

    Made per engine (or per model loaded), never process-wide: a path measured for one engine,
    or a buffer grown for another model's shapes, must not reach the next one."""

    def __init__(self):
        self._paths: dict[tuple, tuple[str, str]] = {}
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def scratch(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The (device, dtype) buffer, grown to the largest weight asked for, viewed as `shape`."""
        numel = shape[0] * shape[1]
        flat = self._scratch.get((device, dtype))
        if flat is None or flat.numel() < numel:
            flat = self._scratch[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    def choose_paths(self, layer: QuantizedLinear) -> tuple[str, str]:
        """(small_path, path) for `layer`, now in use: one decode-sized and one prefill-sized
        measurement per kind of layer in this plan (every decoder layer repeats the same shapes,
        and timing each of a large model's hundreds of projections would cost minutes at start)."""
        key = (layer.bits, layer.shape, layer.group_size, layer.scales.device, layer.scales.dtype)
        if key not in self._paths:
            # Decode-sized steps take our kernel wherever it runs, untimed: it lets the CPU fast
            # path run every layer of a step in one call, a saving a per-layer timing cannot see,
            # and a route that follows the machine's load at start would make a restarted worker
            # compute (and round) differently.
            ours = layer.path_available("ours", layer.scales.device)
            small = "ours" if ours else choose_path(layer, rows=4, repeats=PATH_TIMING_REPEATS)
            self._paths[key] = (small, choose_path(layer, rows=128, repeats=PATH_TIMING_REPEATS))
        layer.small_path, layer.path = self._paths[key]
        return self._paths[key]

    def __deepcopy__(self, memo) -> "QuantizationPlan":
        # A copied layer (an on-demand slot) stays one of its model's layers.
        return self
