"""The engine: schedule -> execute -> update -> emit, usable in-process with no sockets.

`Engine.from_model_dir` builds the parts (worker/engine_builder.py) from a local Hugging Face
folder and the engine wires them; `add_request` / `abort` / `step` drive it one iteration at a
time (what the worker process wraps), and `generate` runs a whole batch offline. Every change
to a request is the scheduler's; the engine runs steps and reports deltas. It also exposes
what the worker loop reads and acts with: stats, the KV pool's usage, prefix-cache eviction,
and the prefix cache's block hashes for KV events (tracked only once `track_kv_events` is called).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from shared.config import build_section
from shared.engine_config import EngineConfig
from shared.sampling_params import SamplingParams
from worker.constraints import ConstraintCompiler, GrammarError
from worker.engine_builder import EngineParts, build_engine
from worker.memory import KVUsage
from worker.model_runner import OutOfMemory, SequenceStep
from worker.outputs import RequestDelta, RequestOutput, delta_for
from worker.prompt_logprobs import PromptScoring, scoring_for
from worker.request import Request, RequestStatus
from worker.sampling_draws import make_generator, token_seed
from worker.scheduled_step import ScheduledRequest, StepFailure
from worker.scheduler import RequestRejectedError
from worker.speculative import NgramSpeculation

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestDelta", "RequestOutput", "RequestRejectedError",
           "SamplingParams"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load and counters, as the worker's heartbeats report them."""
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # free or evictable
    kv_blocks_cached: int  # evictable prefix-cache blocks
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_oom_recoveries: int
    # Speculative decoding by prompt lookup: drafts verified, their tokens, and the tokens sampling confirmed.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class Engine:
    def __init__(self, parts: EngineParts):
        self.config = parts.config
        self.model_dir = parts.model_dir
        self._constraint_compiler: ConstraintCompiler | None = None
        self.model = parts.model
        self.model_config = parts.model.config
        self.device = parts.device
        self.output_device = parts.model.output_device
        self.max_model_len = parts.max_model_len
        self.sampler = parts.sampler
        self.kv_caches = parts.kv_caches
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.placement_plan = parts.placement_plan
        self.load_seconds = parts.load_seconds
        self.quantization_report = parts.quantization_report
        self.calibration = parts.calibration
        self._generators: dict[str, torch.Generator] = {}
        self._aborted: list[Request] = []
        self._ids = itertools.count()
        # This step's requests scoring prompt positions: (index in the step, request, its positions).
        self._scoring: list[tuple[int, Request, PromptScoring]] = []
        self.num_steps = 0  # steps that ran a forward
        self._bytes_per_block = sum(k[0].nbytes + v[0].nbytes for k, v in self.kv_caches)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None, **overrides) -> "Engine":
        """Build from a folder; `overrides` take the names (and values) of the `[worker]` TOML keys
        that configure the engine, converted and checked the same way."""
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(names)}")
        if config is None:
            config = build_section(EngineConfig, overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or overrides, not both")
        return build_engine(model_dir, config, cls)

    # ---- the per-step API -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    priority: int = 0, output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request. Raises RequestRejectedError (a ValueError) for one that can never run.

        `output_token_ids` resumes a request another worker started: those tokens count as
        already generated (towards max_tokens, min_tokens, penalties and seeds), so the
        continuation is the one an uninterrupted run would have produced."""
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        prompt = list(prompt_token_ids)
        outputs = list(output_token_ids)
        bad = [t for t in prompt + outputs if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        # Refused here rather than by the sampler mid-step, where the error would end every request of the step.
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise RequestRejectedError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")
        if len(outputs) >= params.max_tokens:
            raise RequestRejectedError(f"request {request_id!r} already has {len(outputs)} of its "
                                       f"max_tokens={params.max_tokens} output tokens")
        request = Request(request_id=request_id, prompt_token_ids=prompt, params=params, priority=priority,
                          eos_token_ids=self.model_config.eos_token_ids, output_token_ids=outputs)
        if params.grammar:
            try:
                request.constraint = self._constraints().constraint(params.grammar, outputs)
            except GrammarError as e:
                raise RequestRejectedError(f"request {request_id!r}: {e}") from None
        request.speculation = self._speculation(params)
        self.scheduler.add(request)
        if params.seed is not None:
            self._generators[request_id] = make_generator(params.seed, self.output_device)

    def _speculation(self, params: SamplingParams) -> NgramSpeculation | None:
        """The request's draft proposer: the request's k (else the server's), capped by the server's
        speculative_ngram_max_k. A constrained request does not speculate: its matcher would have to mask
        every draft position from a state of its own."""
        config = self.config
        k = config.speculative_ngram_k if params.speculative_ngram_k is None else params.speculative_ngram_k
        k = min(k, config.speculative_ngram_max_k)
        if k <= 0 or params.grammar:
            return None
        return NgramSpeculation(k, config.speculative_ngram_min_n, config.speculative_ngram_max_n)

    def _constraints(self) -> ConstraintCompiler:
        """Built on the first constrained request: an engine that never sees one loads no lexer."""
        if self._constraint_compiler is None:
            self._constraint_compiler = ConstraintCompiler(self.model_dir, self.model_config.vocab_size,
                                                           self.model_config.eos_token_ids)
        return self._constraint_compiler

    def abort(self, request_id: str) -> None:
        """Abort a request in any state now, freeing its blocks. Unknown ids are a no-op."""
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._generators.pop(request_id, None)
            self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    def step(self) -> list[RequestDelta]:
        """One iteration; returns a delta for each request that advanced or ended."""
        deltas = []
        if self._aborted:
            deltas = [delta_for(r) for r in self._aborted]
            self._aborted.clear()
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return deltas
        seqs = self._sequence_steps(scheduled)
        runner = self.runner
        num_oom_recoveries = runner.num_oom_recoveries
        results = runner.execute_splitting(seqs)
        self.num_steps += 1
        if runner.num_oom_recoveries != num_oom_recoveries:  # only then can a result be OutOfMemory
            results = [self._failure(item, seq, r) if isinstance(r, OutOfMemory) else r
                       for item, seq, r in zip(scheduled, seqs, results)]
        if self._scoring:
            self._keep_prompt_logprobs(results)
        generators = self._generators
        for update in self.scheduler.update(scheduled, results):
            request = update.request
            if generators and request.is_finished:
                generators.pop(request.request_id, None)
            deltas.append(delta_for(request, update.new_token_ids, update.is_first_token, update.num_draft_tokens,
                                    update.num_accepted_tokens))
        return deltas

    def _sequence_steps(self, scheduled: list[ScheduledRequest]) -> list[SequenceStep]:
        """The runner's view of each scheduled request's share of the step, in order."""
        generators, block_table = self._generators, self.block_manager.block_table
        seqs = []
        self._scoring.clear()
        for index, item in enumerate(scheduled):
            r = item.request
            if r.params.prompt_logprobs is not None and r.scores_prompt:
                self._score_prompt(index, r, item.num_new_tokens)
            start = r.num_computed_tokens
            generator = generators.get(r.request_id) if generators else None
            draft = item.draft_token_ids
            num_known = item.num_new_tokens - len(draft)  # new tokens before the draft
            token_ids = r.token_ids
            # A draft's tokens come after every known one: the step reaches the end of what is known.
            needs_sample = start + num_known == len(token_ids)
            new_token_ids = token_ids[start:start + num_known]
            if draft:
                new_token_ids += draft
            # Arguments in SequenceStep's field order: keywords would cost a step a third of a microsecond a row.
            if generator is None or not needs_sample:
                seqs.append(SequenceStep(new_token_ids, start, block_table(r.request_id), needs_sample, r.params,
                                         generator, token_ids, None, r.output_token_ids, r.eos_token_ids,
                                         r.constraint, draft))
                continue
            seed, num_outputs = r.params.seed, r.num_output_tokens
            seqs.append(SequenceStep(
                new_token_ids, start, block_table(r.request_id), needs_sample, r.params, generator, token_ids,
                token_seed(seed, num_outputs), r.output_token_ids, r.eos_token_ids, r.constraint, draft,
                # Each position's randomness is (seed, output index), as without a draft: the same tokens either way.
                [token_seed(seed, num_outputs + j) for j in range(1, len(draft) + 1)]))
        for index, request, scoring in self._scoring:
            seqs[index].prompt_scoring = scoring
        return seqs

    def _score_prompt(self, index: int, request: Request, num_new: int) -> None:
        """Note the prompt positions of this step that the request scores (prompt_logprobs), if any."""
        scoring = scoring_for(request.prompt_token_ids, len(request.prompt_logprobs), request.num_computed_tokens,
                              num_new, request.params.prompt_logprobs)
        if scoring is not None:
            self._scoring.append((index, request, scoring))

    def _keep_prompt_logprobs(self, results: list) -> None:
        """Each scoring request's new prompt entries, in position order; one whose logits were not finite fails."""
        for index, request, scoring in self._scoring:
            if isinstance(results[index], StepFailure):
                continue
            if scoring.entries is None:
                results[index] = StepFailure(scoring.error or "its prompt positions were not scored")
            elif scoring.position == len(request.prompt_logprobs):
                request.prompt_logprobs += scoring.entries

    @staticmethod
    def _failure(item: ScheduledRequest, seq: SequenceStep, result: OutOfMemory) -> StepFailure:
        error = (f"out of memory: request {item.request.request_id!r} does not fit on this worker even alone "
                 f"({len(seq.new_token_ids)} new tokens on {seq.context_len} of context); {result.error}")
        log.error("%s", error)
        return StepFailure(error)

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
                for delta in self.step():
                    if delta.final is not None and delta.request_id in wanted:
                        final[delta.request_id] = delta.final
                        bar.update(1)
        return [final[i] for i in ids]

    # ---- what the worker loop reads and acts with ----------------------------------------
    @property
    def num_oom_recoveries(self) -> int:
        return self.runner.num_oom_recoveries

    def stats(self) -> EngineStats:
        blocks, scheduler = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks, kv_blocks_cached=blocks.num_evictable_blocks,
            num_prefix_query_tokens=blocks.num_prefix_query_tokens, num_prefix_hit_tokens=blocks.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions, num_steps=self.num_steps,
            num_oom_recoveries=self.num_oom_recoveries, num_spec_drafts=scheduler.num_drafts,
            num_spec_draft_tokens=scheduler.num_draft_tokens,
            num_spec_accepted_tokens=scheduler.num_accepted_draft_tokens)

    def set_admission(self, paused: bool) -> None:
        """Paused: waiting requests stay waiting (one is let in when nothing runs); running ones go on."""
        self.scheduler.admission_paused = paused

    def preempt_lowest(self) -> Request | None:
        """Preempt (recompute later) the lowest-priority running request, never the last one."""
        return self.scheduler.preempt_lowest()

    def kv_pool_usage(self) -> KVUsage:
        blocks = self.block_manager
        return KVUsage(num_blocks=blocks.num_blocks, num_used_blocks=blocks.num_used_blocks,
                       num_cached_blocks=blocks.num_evictable_blocks, bytes_per_block=self._bytes_per_block)

    def evict_prefix_cache(self, max_blocks: int | None = None) -> int:
        """Evict up to max_blocks (all if None) unreferenced prefix-cache blocks; returns how many."""
        return self.block_manager.evict(max_blocks)

    def track_kv_events(self) -> None:
        """Record the prefix cache's registered and dropped block hashes from now on, for drain_kv_events."""
        self.block_manager.track_cache_changes()

    def drain_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) block hashes since the last drain, each in its final state; empty unless tracking."""
        return self.block_manager.drain_cache_changes()

    def cached_block_hashes(self) -> list[bytes]:
        """The hash of every block in the prefix cache now (shared/block_hash.py chain hashes)."""
        return self.block_manager.cached_hashes()

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

