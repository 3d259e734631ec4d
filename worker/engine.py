"""The engine: schedule -> execute -> update -> emit, usable in-process with no sockets.

`Engine.from_model_dir` builds model, KV pool, block manager, scheduler and runner from
a local Hugging Face folder; `add_request` / `abort` / `step` drive it one iteration at a
time (what the worker process wraps), and `generate` runs a whole batch offline.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from shared.sampling_params import SamplingParams
from worker.block_manager import BlockManager
from worker.kv_cache import (allocate_kv_cache, copy_blocks, num_blocks_for_budget,
                             num_blocks_from_free_cuda_memory)
from worker.memory import KVUsage
from worker.model import cpu_kernels
from worker.model.config import ModelConfig
from worker.model.layers import release_float_weights
from worker.calibrate import load_or_calibrate
from worker.engine_config import ATTENTION, EngineConfig
from worker.model.calibration import CalibrationSettings
from worker.model.quantize_model import quantize_model
from worker.model.quantized_checkpoint import quantization_config
from worker.model.placement import attach_placement, plan_weights
from worker.model.weights import load_model, resolve_dtype
from worker.model_runner import ModelRunner, OutOfMemory, SequenceStep
from worker.request import Request, RequestStatus
from worker.sampler import Sampler, make_generator, token_seed
from worker.scheduler import RequestRejectedError, Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineConfig", "RequestOutput", "RequestRejectedError", "SamplingParams"]

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # generated in this step
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    # Worker-side durations, only on the output carrying the first token sampled here.
    worker_queue_ms: float = 0.0  # arrival on this worker to the first scheduled step
    prefill_ms: float = 0.0  # first scheduled step to the first token
    peak_kv_blocks: int = 0  # the most KV blocks the request held at once


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig()):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.load_mode == "sharded":
            device = torch.device(config.devices[0])  # the first stage takes the inputs
        else:
            device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                                  else "cpu" if config.device == "auto" else config.device)
        self.model_dir = Path(model_dir)
        model_config = ModelConfig.from_model_dir(self.model_dir)  # read first: it sizes the rotary table
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_config.max_position_embeddings}")
        self.max_model_len = max_model_len
        if device.type == "cpu":
            # Build (first use only, about a minute) or load our CPU kernels now rather
            # than inside the first step.
            cpu_kernels.load()
        stored = quantization_config(self.model_dir)
        if stored is not None and config.quantization != "none":
            raise ValueError(f"{self.model_dir} is already quantized ({stored.get('rule')}); serve it with "
                             f"quantization 'none', or quantize its float source instead")
        # Refused here, before any weight is read: e.g. more pipeline stages than layers.
        self.placement_plan = plan_weights(config.load_mode, device, config.devices, model_config.num_layers)
        started = time.perf_counter()
        self.model = load_model(self.model_dir, device, config.dtype, max_positions=max_model_len,
                                placement=self.placement_plan)
        attach_placement(self.model, self.placement_plan)
        self.load_seconds = time.perf_counter() - started  # read + placed (pinning, slots); quantization apart
        log.info("load_mode %s: weights loaded and placed in %.2f s (%s)", config.load_mode, self.load_seconds,
                 self.placement_plan.describe())
        self.model_config = self.model.config
        self.device = device
        dtype = resolve_dtype(config.dtype, device, model_config)
        # Logits come out on the last pipeline stage (sharded): sample and draw noise there.
        self.output_device = self.model.output_device
        self.sampler = Sampler(self.output_device, seed=config.seed)
        num_blocks = self._num_kv_blocks(dtype, max_model_len)
        self.kv_caches = allocate_kv_cache(self.model_config, num_blocks, config.block_size, dtype,
                                           self.model.layer_devices)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_prefill_chunk_tokens=config.max_prefill_chunk_tokens,
        ), self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, config.max_num_batched_tokens,
                                  config.max_num_seqs, max_model_len, self.sampler, ATTENTION[config.attention])
        self._generators: dict[str, torch.Generator] = {}
        self._aborted: list[Request] = []
        self._ids = itertools.count()
        self.num_steps = 0  # steps that ran a forward
        self._bytes_per_block = sum(k.nbytes + v.nbytes for k, v in self.kv_caches) // num_blocks
        # Quantized last: calibration runs the float model through this engine's own generate.
        self.quantization_report = self.calibration = None
        if config.quantization != "none":
            self._quantize()
            # Quantization replaced layer tensors: on_demand's pinned host copies and slots are rebuilt.
            attach_placement(self.model, self.placement_plan)
        if device.type == "cpu" and config.load_mode != "on_demand":
            # The weights are final: keep only our kernel's packed copies (on demand, slots copy
            # from the float host weights; a tied head shares the embedding, which stays).
            tied = (self.model.lm_head,) if model_config.tie_word_embeddings else ()
            released = release_float_weights(self.model, keep=tied)
            log.info("%d float32 linear weights kept only as packed panels", released)
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens", self.model_dir, device, num_blocks,
                 config.block_size)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides) -> "Engine":
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(names)}")
        return cls(model_dir, EngineConfig(**overrides))

    def _num_kv_blocks(self, dtype: torch.dtype, max_model_len: int) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if self.device.type == "cuda":
            probe = ModelRunner(self.model, [], config.block_size, config.max_num_batched_tokens,
                                config.max_num_seqs, max_model_len, self.sampler)
            # Sharded: each device holds the KV of its own layers; the pool is what the tightest fits.
            layers_per_device = collections.Counter(self.model.layer_devices)
            for device in layers_per_device:
                torch.cuda.reset_peak_memory_stats(device)
            probe.profile_peak_memory()
            for device in layers_per_device:
                torch.cuda.synchronize(device)
            del probe
            return min(num_blocks_from_free_cuda_memory(self.model_config, config.block_size, dtype, device,
                                                        config.gpu_memory_utilization, num_layers)
                       for device, num_layers in layers_per_device.items())
        return num_blocks_for_budget(self.model_config, config.block_size, dtype, config.kv_cache_bytes)

    def _quantize(self) -> None:
        config = self.config
        rule = config.quantization_rule_parsed()
        input_scales = None
        if config.quantization_calibration != "none":
            self.calibration, _ = load_or_calibrate(self, rule, CalibrationSettings(source=config.quantization_calibration))
            input_scales = self.calibration.input_scales
        report = self.quantization_report = quantize_model(self.model, rule, input_scales=input_scales)
        self.block_manager.reset_prefix_cache()  # K/V the float model computed
        log.info("quantized %s (%s): %s, %.1f MiB -> %.1f MiB of weights, paths %s", config.quantization, rule.text,
                 report.num_quantized, report.float_bytes / 2**20, report.quantized_bytes / 2**20, report.paths)

    # ---- the per-step API -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    priority: int = 0, output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request. Raises RequestRejectedError (a ValueError) for one that can never run.

        `output_token_ids` resumes a request another worker started: those tokens count as
        already generated (towards max_tokens, penalties and seeds), so the continuation is
        the one an uninterrupted run would have produced."""
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        prompt = list(prompt_token_ids)
        outputs = list(output_token_ids)
        bad = [t for t in prompt + outputs if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        if len(outputs) >= params.max_tokens:
            raise RequestRejectedError(f"request {request_id!r} already has {len(outputs)} of its "
                                       f"max_tokens={params.max_tokens} output tokens")
        request = Request(request_id=request_id, prompt_token_ids=prompt, params=params, priority=priority,
                          eos_token_ids=self.model_config.eos_token_ids)
        for token_id in outputs:
            request.append_token(token_id)
        self.scheduler.add(request)
        if params.seed is not None:
            self._generators[request_id] = make_generator(params.seed, self.output_device)

    def abort(self, request_id: str) -> None:
        """Abort a request in any state now, freeing its blocks. Unknown ids are a no-op."""
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._generators.pop(request_id, None)
            self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for each request that advanced or ended."""
        outputs = [_output(r, []) for r in self._aborted]
        self._aborted.clear()
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:
            return outputs
        copy_blocks(self.kv_caches, self.block_manager.take_block_copies())
        seqs = []
        for item in schedule.scheduled:
            r = item.request
            start = r.num_computed_tokens
            generator = self._generators.get(r.request_id)
            needs_sample = start + item.num_new_tokens == r.num_tokens
            block_table = self.block_manager.block_table(r.request_id)
            r.peak_num_blocks = max(r.peak_num_blocks, len(block_table))
            seqs.append(SequenceStep(
                new_token_ids=r.token_ids[start:start + item.num_new_tokens],
                context_len=start,
                block_table=block_table,
                needs_sample=needs_sample,
                params=r.params,
                generator=generator,
                token_history=r.token_ids,
                seed=token_seed(r.params.seed, r.num_output_tokens) if generator is not None and needs_sample else None,
            ))
        results = self.runner.execute_splitting(seqs)
        self.num_steps += 1
        for item, seq, result in zip(schedule.scheduled, seqs, results):
            if isinstance(result, OutOfMemory):
                outputs.append(self._fail_out_of_memory(item.request, seq, result))
            else:
                outputs.extend(self._update(item.request, item.num_new_tokens, result))
        return outputs

    def _fail_out_of_memory(self, request: Request, seq: SequenceStep, result: OutOfMemory) -> RequestOutput:
        error = (f"out of memory: request {request.request_id!r} does not fit on this worker even alone "
                 f"({len(seq.new_token_ids)} new tokens on {seq.context_len} of context); {result.error}")
        log.error("%s", error)
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, error)
        self._generators.pop(request.request_id, None)
        return _output(request, [])

    def _update(self, request: Request, num_new_tokens: int, result) -> list[RequestOutput]:
        request.num_computed_tokens += num_new_tokens
        self.block_manager.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
        if result is None:
            return []
        token_id, logprob = result
        request.append_token(token_id, logprob if request.params.logprobs else None)
        is_first = request.first_token_s is None
        if is_first:
            request.first_token_s = time.monotonic()
        status = request.stop_status()
        if status is not None:
            self.scheduler.finish(request, status)
            self._generators.pop(request.request_id, None)
        return [_output(request, [token_id], with_timings=is_first)]

    # ---- offline batch API --------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; one final output per prompt, in order."""
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, per_prompt):
                self.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.abort(request_id)
            self._aborted.clear()
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]

    # ---- memory: what the worker loop asks for and acts with ------------------------------
    @property
    def num_oom_recoveries(self) -> int:
        return self.runner.num_oom_recoveries

    def kv_pool_usage(self) -> KVUsage:
        blocks = self.block_manager
        return KVUsage(num_blocks=blocks.num_blocks, num_used_blocks=blocks.num_used_blocks,
                       num_cached_blocks=blocks.num_evictable_blocks, bytes_per_block=self._bytes_per_block)

    def evict_prefix_cache(self, max_blocks: int | None = None) -> int:
        """Evict up to max_blocks (all if None) unreferenced prefix-cache blocks; returns how many."""
        return self.block_manager.evict(max_blocks)

    def empty_device_cache(self) -> None:
        """Give the CUDA caching allocator's unused blocks back to the driver. It costs the next
        allocations a cudaMalloc, so the loop calls it between steps and only now and then."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe_kv_pool(self, max_requests: int = 64) -> str:
        """The KV pool's layout and who holds which blocks, for the memory-report probe."""
        blocks, (k_cache, _) = self.block_manager, self.kv_caches[0]
        usage = self.kv_pool_usage()
        lines = [f"KV pool: {blocks.num_blocks} blocks x {blocks.block_size} tokens; {len(self.kv_caches)} layers "
                 f"x (K, V) of {list(k_cache.shape)} [N, S, Hkv, D] {k_cache.dtype} on {k_cache.device}; "
                 f"{usage.bytes_per_block} bytes per block, {usage.pool_bytes / 2**20:.1f} MiB in all",
                 f"KV blocks: {blocks.num_free_blocks - blocks.num_evictable_blocks} free, "
                 f"{blocks.num_evictable_blocks} cached (evictable), {blocks.num_used_blocks} used by "
                 f"{len(self.scheduler.running)} running requests ({len(self.scheduler.waiting)} waiting)"]
        for r in self.scheduler.running[:max_requests]:
            table = self.block_manager.block_table(r.request_id)
            lines.append(f"  {r.request_id!r}: {len(table)} blocks for {r.num_computed_tokens} computed tokens "
                         f"of {r.num_tokens}: {table}")
        if len(self.scheduler.running) > max_requests:
            lines.append(f"  ... and {len(self.scheduler.running) - max_requests} more")
        return "\n".join(lines)

    # ---- introspection --------------------------------------------------------------------
    def kv_usage(self) -> tuple[int, int]:
        """(token slots holding live K/V, token slots in blocks held by requests)."""
        live = sum(r.num_computed_tokens for r in self.scheduler.running)
        return live, self.block_manager.num_used_blocks * self.block_manager.block_size

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        for r in self.scheduler.running:
            assert r.status == RequestStatus.RUNNING, r
            assert self.block_manager.has_request(r.request_id), f"running {r.request_id} holds no blocks"
        for r in self.scheduler.waiting:
            assert not self.block_manager.has_request(r.request_id), f"waiting {r.request_id} holds blocks"


def _output(request: Request, new_token_ids: list[int], with_timings: bool = False) -> RequestOutput:
    timings = {}
    if with_timings and request.first_scheduled_s is not None:
        timings = dict(worker_queue_ms=(request.first_scheduled_s - request.arrival_s) * 1e3,
                       prefill_ms=(request.first_token_s - request.first_scheduled_s) * 1e3)
    return RequestOutput(
        request_id=request.request_id,
        token_ids=list(request.output_token_ids),
        new_token_ids=new_token_ids,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        logprobs=list(request.output_logprobs),
        error=request.error,
        peak_kv_blocks=request.peak_num_blocks,
        **timings,
    )
