"""Builds an engine's parts from a local Hugging Face folder, in the one order that works.

Check what can be checked without weights, load and place the model, calibrate it through a
plain float engine over it (the modules, dropped afterwards), quantize, place again over the
final tensors, choose the CPU fast path once, size the KV pool for what is resident, then make
the sampler, pool, block manager, scheduler and runner. The engine itself only wires the parts it is handed.
"""
from __future__ import annotations

import collections
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from shared.engine_config import ConfigError, EngineConfig
from worker.block_manager import BlockManager
from worker.calibrate import load_or_calibrate
from worker.kv_cache import (KVCache, allocate_kv_cache, num_blocks_for_budget, num_blocks_from_free_cuda_memory,
                             resolve_kv_cache_dtype)
from worker.model import cpu_kernels
from worker.model.attention import paged_attention, paged_attention_reference
from worker.model.calibration import Calibration, CalibrationSettings
from worker.model.config import ModelConfig
from worker.model.cpu_fast_path import CpuFastPath, choose_fast_path
from worker.model.placement import WeightPlacement, attach_placement, plan_weights
from worker.model.quantization import QuantizedLinear
from worker.model.quantize_model import QuantizationReport, quantize_model
from worker.model.quantized_checkpoint import quantization_config
from worker.model.step_weights import gather_step_weights, hold_weight_panels, use_int8_activations
from worker.model.transformer import Transformer
from worker.model.weights import load_model
from worker.model_runner import ModelRunner
from worker.sampler import Sampler
from worker.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)
ATTENTION = {"fast": paged_attention, "reference": paged_attention_reference}
E = TypeVar("E")


@dataclass
class EngineParts:
    """Everything an engine wires together; built by `build_engine`."""
    config: EngineConfig
    model_dir: Path
    model: Transformer
    device: torch.device  # where a step's inputs go (the first stage when sharded)
    max_model_len: int
    sampler: Sampler
    kv_caches: list[KVCache]
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    placement_plan: WeightPlacement
    load_seconds: float  # weights read and placed; quantization apart
    quantization_report: QuantizationReport | None = None
    calibration: Calibration | None = None


@dataclass(frozen=True)
class _Target:
    """What is known before any weight is read."""
    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    max_model_len: int
    plan: WeightPlacement


def build_engine(model_dir: str | Path, config: EngineConfig, make_engine: Callable[[EngineParts], E]) -> E:
    """The engine `make_engine` wires from parts built for `config`; `make_engine` also makes the
    float engine that calibration samples from, so this module never imports the engine."""
    target = _check_target(Path(model_dir), config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if target.device.type == "cpu":
        # Build (first use only, about a minute) or load our CPU kernels now rather than inside
        # the first step.
        cpu_kernels.load()
    elif target.device.type == "cuda":
        # torch sends attention to cuDNN first on Hopper and later, and cuDNN builds an execution
        # plan for every new shape (hundreds of ms; a server's prompt chunks are new shapes all the
        # time); flash and memory-efficient attention take any shape as it comes.
        torch.backends.cuda.enable_cudnn_sdp(False)
    started = time.perf_counter()
    model = load_model(target.model_dir, target.device, config.dtype or None, max_positions=target.max_model_len,
                       placement=target.plan, config=target.model_config)
    load_seconds = time.perf_counter() - started  # read + placed below; quantization apart
    report = calibration = None
    if config.quantization != "none":
        rule = config.quantization_rule_parsed()
        if config.quantization_calibration != "none":
            settings = CalibrationSettings(source=config.quantization_calibration)
            calibration = _calibrate(target, model, make_engine, rule, settings)
        report = quantize_model(model, rule, input_scales=calibration.input_scales if calibration else None)
        log.info("quantized %s (%s): %s, %.1f MiB -> %.1f MiB of weights, paths %s", config.quantization,
                 rule.text, report.num_quantized, report.float_bytes / 2**20, report.quantized_bytes / 2**20,
                 report.paths)
    # Over the final tensors: on_demand pins and copies what the layers hold now.
    started = time.perf_counter()
    attach_placement(model, target.plan)
    load_seconds += time.perf_counter() - started
    if config.quantization_activations == "int8":
        _use_int8_activations(target, model)
        if report is not None:
            report.count_paths(model)  # now ours at every size
    # The weight-only layers' too (int8 activations gathered theirs); not on_demand's, whose layer
    # slots copy from the tensors it already holds (an arena would be a second copy, and a layout
    # of their own would not match the slots').
    if target.device.type == "cpu" and config.load_mode != "on_demand":
        if hold_weight_panels(model) and report is not None:
            report.count_paths(model)  # now ours at every size
        gather_step_weights([m for m in model.modules() if isinstance(m, QuantizedLinear)])
    # Chosen once, over the final weights and after calibration (whose hooks need the modules);
    # the float Linears it packs then hold only its panels.
    fast_path, reason = choose_fast_path(model, ATTENTION[config.attention])
    log.info("fast path: %s", reason)
    log.info("load_mode %s: weights loaded and placed in %.2f s (%s)", config.load_mode, load_seconds,
             target.plan.describe())
    parts = _assemble(target, model, load_seconds, fast_path)
    parts.quantization_report, parts.calibration = report, calibration
    log.info("engine ready: %s on %s, %d KV blocks of %d tokens", target.model_dir, target.device,
             parts.block_manager.num_blocks, config.block_size)
    return make_engine(parts)


def _use_int8_activations(target: _Target, model: Transformer) -> None:
    switched, quantized = use_int8_activations(model)
    if not quantized:  # a rule that quantizes no layer of this model
        config = target.config
        rule = f" (quantization_rule {config.quantization_rule!r})" if config.quantization_rule else ""
        raise ConfigError(f"quantization_activations 'int8' needs quantized layers; quantization "
                          f"{config.quantization!r}{rule} quantizes none of {target.model_dir}")
    log.info("int8 activations on %d of %d quantized layers%s", switched, quantized,
             "" if switched == quantized else " (the others: no CPU kernels, or K or the group size not whole "
             "blocks of 32)")


def _check_target(model_dir: Path, config: EngineConfig) -> _Target:
    """Everything that can be refused before weights are read, refused here. A setting this model
    or device refuses is a ConfigError naming it: every start would refuse it again, so its worker
    is not restarted (worker/__main__.py)."""
    if config.load_mode == "sharded":
        device = torch.device(config.devices[0])  # the first stage takes the inputs
    elif config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    model_config = ModelConfig.from_model_dir(model_dir)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                          f"{model_config.max_position_embeddings} ({model_dir / 'config.json'})")
    stored = quantization_config(model_dir)
    if stored is not None and config.quantization != "none":
        raise ConfigError(f"quantization {config.quantization!r}: {model_dir} is already quantized "
                          f"({stored.get('rule')}); serve it with quantization 'none', or quantize its float "
                          f"source instead")
    if config.quantization_activations == "int8":
        if device.type != "cpu":
            raise ConfigError(f"quantization_activations 'int8' runs on our CPU kernels; the device is {device}")
        if stored is None and config.quantization == "none":
            raise ConfigError("quantization_activations 'int8' needs quantized layers: set quantization (it is "
                              f"'none'), or serve a quantized checkpoint ({model_dir} is not one)")
    plan = plan_weights(config.load_mode, device, config.devices, model_config.num_layers)
    return _Target(config, model_dir, model_config, device, max_model_len, plan)


def _calibrate(target: _Target, model: Transformer, make_engine: Callable[[EngineParts], E], rule,
               settings: CalibrationSettings) -> Calibration:
    """Calibration samples from a plain float engine over `model`; its KV pool goes with it."""
    attach_placement(model, target.plan)
    float_engine = make_engine(_assemble(target, model, load_seconds=0.0, graphs=False))  # a few steps only
    calibration, _ = load_or_calibrate(float_engine, rule, settings)
    del float_engine
    gc.collect()
    if target.device.type == "cuda":
        torch.cuda.empty_cache()  # the float engine's pool: the final one is sized without it
    return calibration


def _assemble(target: _Target, model: Transformer, load_seconds: float,
              fast_path: CpuFastPath | None = None, graphs: bool = True) -> EngineParts:
    config = target.config
    # Logits come out on the last pipeline stage (sharded): sample and draw noise there.
    sampler = Sampler(model.output_device, seed=config.seed)
    dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.compute_dtype)  # the KV pools' element type
    num_blocks = _num_kv_blocks(target, model, sampler, dtype)
    graphs = decode_graph_mode(target, model, fast_path) if graphs else ""
    # Decode graphs pad their batches with rows that write into one more block, which no request owns.
    kv_caches = allocate_kv_cache(model.config, num_blocks + bool(graphs), config.block_size, dtype,
                                  model.layer_devices)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(SchedulerConfig.from_engine(config, target.max_model_len), block_manager)
    runner = ModelRunner(model, kv_caches, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
                         target.max_model_len, sampler, ATTENTION[config.attention], fast_path=fast_path,
                         max_draft_tokens=config.speculative_ngram_max_k)
    if graphs:
        runner.use_decode_graphs(padding_block=num_blocks, capture=graphs == "capture")
        started = time.perf_counter()
        captured = runner.capture_decode_graphs()
        log.info("decode graphs: %d captured in %.1f s%s", captured, time.perf_counter() - started,
                 f"; off ({runner.decode_graphs.disabled})" if runner.decode_graphs.disabled else "")
    return EngineParts(config=config, model_dir=target.model_dir, model=model, device=target.device,
                       max_model_len=target.max_model_len, sampler=sampler, kv_caches=kv_caches,
                       block_manager=block_manager, scheduler=scheduler, runner=runner, placement_plan=target.plan,
                       load_seconds=load_seconds)


def decode_graph_mode(target: _Target, model: Transformer, fast_path: CpuFastPath | None) -> str:
    """"capture" where decode steps replay CUDA graphs (worker/decode_graphs.py): asked for, on
    CUDA, the modules on one device with the batched attention; else "" (every step eager)."""
    config = target.config
    if (config.cuda_graphs and target.device.type == "cuda" and fast_path is None and model.placement is None
            and config.attention == "fast"):
        return "capture"
    return ""


def _num_kv_blocks(target: _Target, model: Transformer, sampler: Sampler, dtype: torch.dtype) -> int:
    config = target.config
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if target.device.type != "cuda":
        return num_blocks_for_budget(model.config, config.block_size, dtype, config.kv_cache_bytes)
    probe = ModelRunner(model, [], config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
                        target.max_model_len, sampler, max_draft_tokens=config.speculative_ngram_max_k)
    # Sharded: each device holds the KV of its own layers; the pool is what the tightest fits.
    layers_per_device = collections.Counter(model.layer_devices)
    for device in layers_per_device:
        torch.cuda.reset_peak_memory_stats(device)
    probe.profile_peak_memory(kv_dtype=dtype)
    for device in layers_per_device:
        torch.cuda.synchronize(device)
    del probe
    return min(num_blocks_from_free_cuda_memory(model.config, config.block_size, dtype, device,
                                                config.gpu_memory_utilization, num_layers)
               for device, num_layers in layers_per_device.items())
