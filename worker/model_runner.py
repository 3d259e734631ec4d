"""Runs one step on the device: packs the scheduled sequences into preallocated buffers,
runs the transformer (or the CPU fast path the engine chose for it) on its own CUDA stream
(when on CUDA), and samples.

Owns the tensors of a step, and running a step despite an out-of-memory error (free what
the device caches, run the step in halves) or a request's non-finite logits (that request
fails, the rest of the step stands); knows nothing of scheduling policy or sockets.
"""
from __future__ import annotations

import gc
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from worker.decode_graphs import DecodeGraphs
from worker.kv_cache import KVCache
from worker.model.attention import AttentionMetadata, paged_attention
from worker.model.cpu_fast_path import CpuFastPath
from worker.model.transformer import Transformer
from worker.prompt_logprobs import PromptScoring, score_prompt_positions
from worker.sampler import Sampler, SamplerOutput
from worker.scheduled_step import StepFailure
from worker.sequence_step import SampledToken, SequenceStep, sampling_batch

__all__ = ["ModelRunner", "OutOfMemory", "SampledToken", "SequenceStep", "sampling_batch"]

log = logging.getLogger(__name__)
# The CPU allocator reports exhaustion as a plain RuntimeError carrying this text.
_CPU_OOM_TEXT = "can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and _CPU_OOM_TEXT in str(error)


@dataclass(frozen=True)
class OutOfMemory:
    """The result of a sequence that ran out of memory even in a step of its own."""
    error: str


class ModelRunner:
    """`fast_path`: the CPU fast path built from the model's final weights
    (`cpu_fast_path.choose_fast_path`), which computes every step in the model's place; None
    runs the modules (calibration's hooks observe them, so a runner that calibrates has none)."""

    def __init__(self, model: Transformer, kv_caches: list[KVCache], block_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 sampler: Sampler, attention_fn=paged_attention, fast_path: CpuFastPath | None = None,
                 max_draft_tokens: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.attention_fn = attention_fn
        self.fast_path = fast_path
        self.device = model.input_device  # where a step's inputs go
        # Where logits come out: the last pipeline stage's device when the model is sharded.
        self.output_device = model.output_device
        self.max_num_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # Rows of logits a step may sample: one per sequence, plus one per draft token (speculative
        # decoding, at most max_draft_tokens per sequence), never more than the step has tokens.
        self.max_draft_tokens = max_draft_tokens
        self.max_num_samples = max(max_num_seqs, min(max_num_seqs * (1 + max_draft_tokens), max_num_batched_tokens))
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Preallocated for the largest possible step, so a step allocates no buffers of
        # its own and memory does not creep. On CUDA, inputs are staged in pinned host
        # memory and copied asynchronously on the runner's stream.
        is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if is_cuda else None
        int64 = dict(dtype=torch.int64)
        self._host = {
            "input_ids": torch.zeros(self.max_num_tokens, **int64, pin_memory=is_cuda),
            "positions": torch.zeros(self.max_num_tokens, **int64, pin_memory=is_cuda),
            "slot_mapping": torch.zeros(self.max_num_tokens, **int64, pin_memory=is_cuda),
            "seq_lens": torch.zeros(max_num_seqs, **int64, pin_memory=is_cuda),
            "logits_indices": torch.zeros(self.max_num_samples, **int64, pin_memory=is_cuda),
            "block_tables": torch.zeros(max_num_seqs, self.max_blocks_per_seq, **int64, pin_memory=is_cuda),
        }
        self._device = ({name: torch.zeros_like(t, device=self.device) for name, t in self._host.items()}
                        if is_cuda else self._host)
        self.logits = torch.zeros(self.max_num_samples, model.config.vocab_size,
                                  dtype=model.compute_dtype, device=self.output_device)
        self.index_buffers()
        # One instance entered every step: building a fresh one costs as much again as entering it.
        self._inference_mode = torch.inference_mode()
        # Fault injection for tests: called with a step's sequences before its forward; it may
        # raise (MemoryError, torch.OutOfMemoryError) or sleep, as a real failure or hang would.
        self.fault_hook: Callable[[list[SequenceStep]], None] | None = None
        self.num_oom_recoveries = 0  # out-of-memory errors caught (and survived) in a step
        self.decode_graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, padding_block: int, capture: bool = True) -> None:
        """Run decode steps, and steps that verify drafts, from captured graphs
        (worker/decode_graphs.py), padding batches with rows that write only to `padding_block`,
        a block of the pools no request is given."""
        if self.fast_path is not None or self.model.placement is not None:
            raise ValueError("decode graphs capture the modules on one device: not with a CPU fast path or placement")
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.max_num_seqs,
                                          self.max_blocks_per_seq, self.attention_fn, self.logits, padding_block,
                                          capture=capture, max_queries=1 + self.max_draft_tokens)

    def capture_decode_graphs(self) -> int:
        """Capture every decode graph bucket now (at start-up), on the runner's stream; how many."""
        if self.decode_graphs is None:
            return 0
        with self._inference_mode, torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            return self.decode_graphs.capture_all()

    def execute_splitting(self, seqs: list[SequenceStep]) -> list[SampledToken | None | OutOfMemory]:
        """execute(), surviving out-of-memory errors: free what the device caches and run the
        sequences in halves, recursively. A sequence that fails alone gets OutOfMemory; every
        other one gets exactly what execute() would have given it.

        Retrying is safe because nothing of a failed attempt is kept: results come back only
        from attempts that finished, the caller applies them once, and K/V a failed attempt
        wrote lands in the same slots the retry writes (or in blocks its request gives up)."""
        try:
            return self.execute(seqs)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            error = f"{type(e).__name__}: {(str(e) or 'out of memory').splitlines()[0]}"
        # Outside the except block: the traceback, and the activations its frames hold, are gone.
        self.num_oom_recoveries += 1
        log.warning("out of memory in a step of %d sequences (%s); freeing caches and %s", len(seqs), error,
                    "failing that sequence" if len(seqs) == 1 else "retrying in halves")
        self.release_memory()
        if len(seqs) == 1:
            return [OutOfMemory(error)]
        mid = (len(seqs) + 1) // 2
        return self.execute_splitting(seqs[:mid]) + self.execute_splitting(seqs[mid:])

    def release_memory(self) -> None:
        """Drop what holds bytes and is not needed: unreachable tensors, and on CUDA the blocks the
        caching allocator keeps (so the driver can hand them out whole again). The KV pool is not
        touched: it is allocated once, and freeing its blocks frees no bytes."""
        # Only the young generations: any cycle the failed attempt left is new, and a full
        # collection costs a fifth of a second in a process holding a model.
        gc.collect(1)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def execute(self, seqs: list[SequenceStep]) -> list[SampledToken | list[SampledToken] | None]:
        """Run one step; per sequence (in input order) its sampled (token, logprob, top logprobs),
        a list of 1 + len(draft) of them for a sequence verifying a draft, None for a prompt
        chunk that does not reach the end of what is known, or a StepFailure for one whose logits
        were not finite (the sampler's non_finite_rows)."""
        if not seqs:
            return []
        num_seqs = len(seqs)
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"step has {num_seqs} sequences, more than max_num_seqs={self.max_num_seqs}")
        if self.fault_hook is not None:
            self.fault_hook(seqs)
        # Decodes first, longest context first: the attention fast path batches them in
        # groups of similar length (see AttentionMetadata).
        if num_seqs == 1:
            order, ordered = (0,), seqs
        else:
            # The keys built in one pass, so sorting calls no Python function per sequence.
            keys = [(0, -s.context_len) if len(s.new_token_ids) == 1 else (1, 0) for s in seqs]
            order = sorted(range(num_seqs), key=keys.__getitem__)
            ordered = [seqs[i] for i in order]
        if self.stream is None:
            with self._inference_mode:
                sampled, result = self._forward_and_sample(ordered)
        else:
            with self._inference_mode, torch.cuda.stream(self.stream):
                sampled, result = self._forward_and_sample(ordered)
        results: list[SampledToken | list[SampledToken] | None] = [None] * num_seqs
        if not sampled:
            return results
        token_ids, logprobs, tops = result.token_ids, result.logprobs, result.top_logprobs
        row = 0
        for j in sampled:
            seq = ordered[j]
            if not seq.draft_token_ids:
                results[order[j]] = (token_ids[row], logprobs[row] if logprobs is not None else None,
                                     tops[row] if tops is not None else None)
                row += 1
                continue
            stop = row + seq.num_samples
            results[order[j]] = [(token_ids[r], logprobs[r] if logprobs is not None else None,
                                  tops[r] if tops is not None else None) for r in range(row, stop)]
            row = stop
        if result.non_finite_rows:
            self._fail_non_finite(results, [(ordered[j], order[j]) for j in sampled], set(result.non_finite_rows))
        return results

    def _fail_non_finite(self, results: list, sampled: list[tuple[SequenceStep, int]], rows: set[int]) -> None:
        """A StepFailure for each sampled (sequence, its index in results) with a sampler row in `rows`: a
        token drawn from NaN logits means nothing, and its later steps would read the same overflowed K/V."""
        half = self.kv_caches and self.kv_caches[0][0].dtype == torch.float16
        hint = " (a float16 KV pool holds up to 65504: kv_cache_dtype 'bfloat16' has float32's range)" if half else ""
        start = 0
        for seq, index in sampled:
            if not rows.isdisjoint(range(start, start + seq.num_samples)):
                results[index] = StepFailure(f"the model's logits for this request are not finite (NaN or inf): "
                                             f"an activation overflowed its dtype{hint}")
            start += seq.num_samples
        log.error("non-finite logits in %d of a step's %d sampled rows: failing their requests%s", len(rows), start,
                  hint)

    def _forward_and_sample(self, seqs: list[SequenceStep]) -> tuple[list[int], SamplerOutput | None]:
        """The step of `seqs` (in step order): the positions of the sequences that sample, and the
        sampler's output for their rows (None when none samples)."""
        graphs = self.decode_graphs
        # A graph's step: every sequence samples each token it brings (one, or one and its draft). None scores
        # its prompt: a step that reaches the last known token brings no prompt position with a token after it.
        if graphs is not None and all(s.needs_sample and len(s.new_token_ids) == 1 + len(s.draft_token_ids)
                                      for s in seqs):
            most = max(len(s.new_token_ids) for s in seqs)
            if graphs.takes(len(seqs), max(s.context_len + len(s.new_token_ids) for s in seqs), most):
                logits = graphs.run([s.new_token_ids for s in seqs], [s.context_len for s in seqs],
                                    [s.block_table for s in seqs])
                return list(range(len(seqs))), self.sampler(logits, sampling_batch(seqs))
        input_ids, positions, meta, logits_indices, sampled, scored = self._prepare(seqs)
        # Read once: the fast path and the modules compute the same step, logits included.
        computes = self.fast_path if self.fast_path is not None else self.model
        if computes is self.model:  # called as a module, so forward hooks fire
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.attention_fn)
        else:
            hidden = computes.forward(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        if scored:
            score_prompt_positions(hidden, scored, computes.compute_logits, self.model.config.vocab_size)
        if not sampled:
            return sampled, None
        num_samples = len(logits_indices)
        logits = self._logits_rows.get(num_samples)
        if logits is None:
            logits = self._logits_rows[num_samples] = self.logits[:num_samples]
        if num_samples == hidden.shape[0]:
            # Every token is sampled (indices ascend and are distinct, so they are 0..T-1): no gather.
            sampled_hidden = hidden
        else:
            index = self._stage("logits_indices", logits_indices).to(self.output_device, non_blocking=True)
            sampled_hidden = hidden.index_select(0, index)
        computes.compute_logits(sampled_hidden, out=logits)  # [R, V]
        return sampled, self.sampler(logits, sampling_batch([seqs[j] for j in sampled]))

    def _prepare(self, seqs: list[SequenceStep]):
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices, sampled = [], []
        scored: list[tuple[int, PromptScoring]] = []  # (the row of its first new token, its prompt positions)
        tables, context_lens, query_lens = [], [], []
        for j, seq in enumerate(seqs):
            new, start = seq.new_token_ids, seq.context_len
            num_new = len(new)
            tables.append(seq.block_table)
            context_lens.append(start)
            query_lens.append(num_new)
            if seq.prompt_scoring is not None:
                scored.append((len(input_ids), seq.prompt_scoring))
            if num_new == 1:  # a decode: no range to build
                input_ids.append(new[0])
                positions.append(start)
            else:
                input_ids.extend(new)
                positions.extend(range(start, start + num_new))
            if seq.needs_sample:
                # The last token's logits, and with a draft those of the tokens before each draft token.
                if seq.draft_token_ids:
                    logits_indices.extend(range(len(input_ids) - seq.num_samples, len(input_ids)))
                else:
                    logits_indices.append(len(input_ids) - 1)
                sampled.append(j)
        if len(input_ids) > self.max_num_tokens:
            raise ValueError(f"step has {len(input_ids)} tokens, more than max_num_batched_tokens={self.max_num_tokens}")
        if len(logits_indices) > self.max_num_samples:
            raise ValueError(f"step samples {len(logits_indices)} positions, more than the {self.max_num_samples} "
                             f"its logits buffer holds (a draft longer than speculative_ngram_max_k?)")
        meta = AttentionMetadata.build(tables, context_lens, query_lens, self.block_size, put=self._stage)
        # logits_indices stay a list: a step that samples every token needs no gather, so no tensor.
        return (self._stage("input_ids", input_ids), self._stage("positions", positions), meta, logits_indices, sampled,
                scored)

    def index_buffers(self) -> None:
        """(Re)build the views a step reaches its buffers through; called again by whatever
        replaces `_host`, `_device` or `logits`."""
        # numpy views of the host buffers: a step writes its Python lists through them, far cheaper
        # than building a tensor from each list and copying it in.
        self._host_arrays = {name: t.numpy() for name, t in self._host.items()}
        # (name, rows[, width]) -> (numpy view, host view, device view) of a buffer's front: slicing
        # costs more than a dict lookup, and a step's sizes repeat. At most one entry per size a buffer takes.
        self._fronts: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._logits_rows: dict[int, torch.Tensor] = {}  # R -> self.logits[:R], likewise

    def _stage(self, name: str, values: list) -> torch.Tensor:
        """`values` written into the front of the preallocated buffer `name`: on CUDA into its
        pinned host twin first, then copied asynchronously on the runner's stream. Returns the
        device view."""
        # [:n], or [:rows, :width] for the block tables (their rows are padded to one width).
        key = (name, len(values), len(values[0])) if name == "block_tables" else (name, len(values))
        views = self._fronts.get(key)
        if views is None:
            front = tuple(slice(0, n) for n in key[1:])
            host = self._host[name][front]
            device = host if self._device is self._host else self._device[name][front]
            views = self._fronts[key] = (self._host_arrays[name][front], host, device)
        array, host, device = views
        array[...] = values
        if device is not host:  # CUDA; on the CPU the buffers are the step's tensors
            device.copy_(host, non_blocking=True)
        return device

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int | None = None, kv_dtype: torch.dtype | None = None) -> None:
        """One forward of the largest step (a fresh prompt) into a throwaway cache of `kv_dtype`
        (the model's by default), so the allocator's peak shows what activations cost before the
        KV pool is sized."""
        num_tokens = num_tokens or self.max_num_tokens
        config = self.model.config
        num_blocks = -(-num_tokens // self.block_size)
        dtype = kv_dtype or self.logits.dtype
        shape = (num_blocks, self.block_size, config.num_kv_heads, config.head_dim)
        scratch = [(torch.zeros(shape, dtype=dtype, device=d), torch.zeros(shape, dtype=dtype, device=d))
                   for d in self.model.layer_devices]
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata.build([list(range(num_blocks))], [0], [num_tokens], self.block_size, self.device)
        hidden = self.model(ids, positions, scratch, meta, self.attention_fn)
        self.model.lm_head(hidden[-self.max_num_samples:])
        del scratch, hidden
