"""Where a model's weights live and how its decoder layers reach them: the three loading modes.

Owns the plan (which device holds each part's weights), the layer loop of the sharded and
on-demand modes (the transformer calls `run_layers`), and the on-demand slots. Must not know
about requests, KV block ownership or sampling: it moves weights and hidden states only.

- full: every weight on the worker's device (no placement object: the transformer's plain loop).
- sharded: decoder layers split into contiguous stages over `devices` (a pipeline inside one
  worker); embeddings on the first device, final norm + lm_head on the last; each layer's KV
  pools on its stage's device. Hidden states, RoPE tables and attention metadata move at each
  stage boundary.
- on_demand: decoder layers stay in host memory (pinned on CUDA) and are copied, one at a time,
  into a few fixed device slots just before they run; the next layer is prefetched on a side
  CUDA stream while the current one computes.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from worker.model.attention import AttentionMetadata
from worker.model.quantization import QuantizedLinear

log = logging.getLogger(__name__)

ON_DEMAND_SLOTS = 2  # the current layer and the one being prefetched
# nn.Module's hook tables: a slot running as layer i takes layer i's (see OnDemandLayers.run_layers).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
HOST = torch.device("cpu")


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightPlacement:
    """Which device each part of the model is loaded onto."""

    load_mode: str
    embed_device: torch.device  # embed_tokens and the RoPE table: where a step's inputs arrive
    layer_devices: tuple[torch.device, ...]  # each decoder layer's weights as loaded (host for on_demand)
    head_device: torch.device  # final norm and lm_head: where logits come out
    compute_device: torch.device  # on_demand: where layers run and their KV lives; else the input device
    stage_of_layer: tuple[int, ...] = ()  # sharded: the pipeline stage of each layer

    @classmethod
    def single(cls, device: torch.device | str, num_layers: int) -> "WeightPlacement":
        device = torch.device(device)
        return cls("full", device, (device,) * num_layers, device, device)

    def describe(self) -> str:
        """For the load log line: where the decoder layers are."""
        if self.load_mode == "on_demand":
            return f"{len(self.layer_devices)} layers in host memory, copied to {self.compute_device} as they run"
        if self.load_mode == "sharded":
            runs = itertools.groupby(range(len(self.stage_of_layer)), key=lambda i: self.stage_of_layer[i])
            return "stages " + ", ".join(f"{self.layer_devices[g[0]]} [layers {g[0]}-{g[-1]}]"
                                         for g in (list(group) for _, group in runs))
        return f"all on {self.compute_device}"


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """The stage of each layer: contiguous runs as even as possible, earlier stages taking the
    remainder (the last stage also holds the output head)."""
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} decoder layers into {num_stages} pipeline stages: "
                         "each stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (stage < extra) for stage in range(num_stages)]
    return [stage for stage, size in enumerate(sizes) for _ in range(size)]


def plan_weights(load_mode: str, device: torch.device | str, devices: Sequence[str], num_layers: int,
                 stage_of_layer: Sequence[int] | None = None) -> WeightPlacement:
    """The plan for a model of `num_layers` decoder layers. `device` is the worker's device (full,
    on_demand); `devices` the pipeline stages (sharded); `stage_of_layer` overrides the even split.
    The settings themselves were checked by EngineConfig; what needs the model is checked here."""
    device = torch.device(device)
    if load_mode == "full":
        return WeightPlacement.single(device, num_layers)
    if load_mode == "on_demand":
        return WeightPlacement("on_demand", device, (HOST,) * num_layers, device, device)
    stage_devices = [torch.device(d) for d in devices]
    for d in stage_devices:
        if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"devices names {d}, but this host has {torch.cuda.device_count()} CUDA devices")
    if len(stage_devices) > num_layers:
        raise ValueError(f"load_mode 'sharded' over {len(stage_devices)} devices needs at least as many decoder "
                         f"layers, but the model has {num_layers}")
    stages = list(stage_of_layer) if stage_of_layer is not None else split_layers(num_layers, len(stage_devices))
    if (len(stages) != num_layers or stages != sorted(stages)
            or sorted(set(stages)) != list(range(len(stage_devices)))):
        raise ValueError(f"stage_of_layer {stages} must give each of the {num_layers} layers a stage, "
                         f"in order, using every stage 0..{len(stage_devices) - 1}")
    return WeightPlacement("sharded", stage_devices[0], tuple(stage_devices[s] for s in stages),
                           stage_devices[-1], stage_devices[0], tuple(stages))


def attach_placement(model: nn.Module, plan: WeightPlacement, num_slots: int = ON_DEMAND_SLOTS) -> None:
    """Give a loaded model the layer loop of its mode. Call after anything that replaces layer
    tensors (quantization): on_demand pins and copies the tensors as they are now."""
    if plan.load_mode == "sharded":
        model.placement = ShardedLayers(plan.stage_of_layer, plan.layer_devices)
    elif plan.load_mode == "on_demand":
        model.placement = OnDemandLayers(model.layers, plan.compute_device, num_slots)
    else:
        model.placement = None


# ---- sharded ---------------------------------------------------------------------------------
def move_metadata(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The step's metadata with its tensors on `device` (the Python lists are shared)."""
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device, non_blocking=True),
                               block_tables=meta.block_tables.to(device, non_blocking=True),
                               seq_lens=meta.seq_lens.to(device, non_blocking=True))


@dataclass(frozen=True)
class Stage:
    device: torch.device
    layer_indices: range


class ShardedLayers:
    """Runs the layers stage by stage, moving what a layer reads onto each stage's device.

    Boundaries are stage changes, not device changes, so sharding over ("cpu", "cpu") runs every
    move (each a no-op copy there) exactly as two GPUs would. Device-to-device copies are ordered
    by torch against both devices' current streams, so non_blocking is safe."""

    def __init__(self, stage_of_layer: Sequence[int], layer_devices: Sequence[torch.device]):
        self.layer_devices = list(layer_devices)
        self.stages: list[Stage] = []
        for stage, group in itertools.groupby(range(len(stage_of_layer)), key=lambda i: stage_of_layer[i]):
            indices = list(group)
            self.stages.append(Stage(self.layer_devices[indices[0]], range(indices[0], indices[-1] + 1)))
        self.num_boundary_moves = 0  # stages entered: tests check the boundary code ran

    def move_to_stage(self, stage: Stage, x: torch.Tensor, rope, meta: AttentionMetadata):
        self.num_boundary_moves += 1
        cos, sin = rope
        return (x.to(stage.device, non_blocking=True),
                (cos.to(stage.device, non_blocking=True), sin.to(stage.device, non_blocking=True)),
                move_metadata(meta, stage.device))

    def run_layers(self, layers: nn.ModuleList, x, rope, kv_caches, meta, attention_fn) -> torch.Tensor:
        for stage in self.stages:
            x, rope, meta = self.move_to_stage(stage, x, rope, meta)
            for i in stage.layer_indices:
                x = layers[i](x, rope, kv_caches[i], meta, attention_fn)
        return x  # on the last stage's device, where the final norm and lm_head are


# ---- on demand -------------------------------------------------------------------------------
def layer_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a layer computes with, parameters and buffers (persistent or not), in a fixed
    order: quantized layers keep their weights in buffers, so parameters alone would miss them."""
    return list(layer.named_parameters()) + list(layer.named_buffers())


class _Slot:
    """A device copy of one layer's structure whose tensors are overwritten with a layer's weights."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.submodules = list(module.modules())
        self.tensors = [t for _, t in layer_tensors(module)]
        self.layer_index: int | None = None
        self.last_used = -1
        self.loaded: torch.cuda.Event | None = None  # copy stream: this slot's weights have arrived
        self.freed: torch.cuda.Event | None = None  # compute stream: the last layer run from it is done


class OnDemandLayers:
    """Host-resident decoder layers run through `num_slots` fixed device slots.

    Why fixed slots (a device copy of the layer module per slot, its tensors overwritten in place)
    rather than `torch.func.functional_call` with fresh device tensors per layer: the device
    memory for weights is allocated once, so it is visible to KV sizing and never churns the
    allocator or fragments it; a side-stream copy into a persistent buffer needs no
    `record_stream` bookkeeping; and the layer's own forward (kernels, quantized modules) runs
    unchanged, with no per-call module rebinding.

    CUDA: host tensors are pinned and copied with non_blocking on a side stream. Layer i's slot
    may be overwritten only after the compute stream has finished the layer last run from it
    (`freed` event), and layer i runs only after its copy has landed (`loaded` event). On the
    CPU the same loop copies synchronously into the slot tensors."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, num_slots: int = ON_DEMAND_SLOTS):
        if num_slots < 2:
            raise ValueError(f"on_demand needs at least 2 layer slots (one running, one prefetching), got {num_slots}")
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.num_layers = len(layers)
        self.layer_devices = [self.device] * self.num_layers
        self._check_uniform(layers)
        if self.is_cuda:
            _pin_host_tensors(layers)
        self._host = [[t for _, t in layer_tensors(layer)] for layer in layers]
        self._host_modules = [list(layer.modules()) for layer in layers]
        # deepcopy first: on the CPU `.to` would return the same tensors and the slot would
        # alias layer 0's host weights, which the first copy into it would then overwrite.
        self.slots = [_Slot(_prepare_slot_module(copy.deepcopy(layers[0]).to(self.device), self.device))
                      for _ in range(min(num_slots, self.num_layers))]
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        if self.is_cuda:
            for slot in self.slots:
                slot.loaded, slot.freed = torch.cuda.Event(), torch.cuda.Event()
        self._clock = itertools.count()
        self.num_layer_loads = 0  # layers copied in since construction (prefetches included)

    @staticmethod
    def _check_uniform(layers: nn.ModuleList) -> None:
        # One slot structure must fit every layer; quantization rules are per layer type, so they are.
        def signature(layer):
            modules = [(n, type(m).__name__) for n, m in layer.named_modules()]
            return modules + [(n, t.shape, t.dtype) for n, t in layer_tensors(layer)]

        first = signature(layers[0])
        for i, layer in enumerate(layers):
            mine = signature(layer)
            if mine != first:
                raise ValueError(f"on_demand needs every decoder layer to have the same tensors; layer {i} differs "
                                 f"from layer 0 (its own: {[x for x in mine if x not in first][:4]})")

    def resident_layers(self) -> list[int]:
        """The layers whose weights the device slots hold now."""
        return [s.layer_index for s in self.slots if s.layer_index is not None]

    def run_layers(self, layers: nn.ModuleList, x, rope, kv_caches, meta, attention_fn) -> torch.Tensor:
        for i, kv_cache in enumerate(kv_caches):
            slot = self._acquire(i)
            self._adopt_hooks(slot, i)
            x = slot.module(x, rope, kv_cache, meta, attention_fn)
            if self.is_cuda:
                slot.freed.record(torch.cuda.current_stream(self.device))
        return x

    def _adopt_hooks(self, slot: _Slot, i: int) -> None:
        """Hooks registered on layer i's modules (calibration records activations that way) fire
        when the slot runs as layer i: each slot module shares its twin's hook tables."""
        for slot_module, host_module in zip(slot.submodules, self._host_modules[i]):
            for table in _HOOK_TABLES:
                if hasattr(host_module, table):  # plain instance attributes: skip Module.__setattr__
                    object.__setattr__(slot_module, table, getattr(host_module, table))

    def _acquire(self, i: int) -> _Slot:
        """The slot holding layer i, ready to run on the compute stream; starts the next
        layer's copy (wrapping to layer 0 for the next step) before returning."""
        slot = self._holding(i) or self._load(i, busy=None)
        slot.last_used = next(self._clock)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.loaded)
        following = (i + 1) % self.num_layers
        if self._holding(following) is None:
            self._load(following, busy=slot)
        return slot

    def _holding(self, i: int) -> _Slot | None:
        return next((s for s in self.slots if s.layer_index == i), None)

    def _load(self, i: int, busy: _Slot | None) -> _Slot:
        # Least recently used, never the slot about to run: in a sequential sweep that is the
        # slot whose layer ran longest ago.
        slot = min((s for s in self.slots if s is not busy), key=lambda s: s.last_used)
        self.copy_layer(i, slot)
        slot.layer_index = i
        return slot

    def copy_layer(self, i: int, slot: _Slot) -> None:
        self.num_layer_loads += 1
        if not self.is_cuda:
            for dst, src in zip(slot.tensors, self._host[i]):
                dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            # The slot's previous layer may still be computing: wait for it before overwriting.
            self.copy_stream.wait_event(slot.freed)
            for dst, src in zip(slot.tensors, self._host[i]):
                dst.copy_(src, non_blocking=True)  # pinned host -> device, asynchronous
            slot.loaded.record(self.copy_stream)


def _pin_host_tensors(layers: nn.ModuleList) -> None:
    """Page-lock every layer tensor so copies to the device are asynchronous DMA. Done here, after
    quantization, because quantization replaces the tensors."""
    for layer in layers:
        for module in layer.modules():
            for param in module.parameters(recurse=False):
                param.data = param.data.pin_memory()
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.pin_memory())


def _prepare_slot_module(module: nn.Module, device: torch.device) -> nn.Module:
    """Quantized modules in a slot may only compute from the buffers the copies overwrite. torch's
    INT4 kernel path packs its operands once from the weights it was built with, so a slot would
    keep layer 0's: such a slot computes through the dequant path instead (our kernels read the
    buffers directly). Paths measured on the host are measured again on the device (torch's
    packed kernels differ per device), in the model's plan, which the slot's copy shares."""
    for m in module.modules():
        if not isinstance(m, QuantizedLinear):
            continue
        if device.type != HOST.type:
            m.plan.choose_paths(m)
        if m.bits == 4:
            m.path, m.small_path = ("dequant" if p == "kernel" else p for p in (m.path, m.small_path))
    return module
