"""Decode steps replayed from captured CUDA graphs.

A decode step of a small batch launches hundreds of small kernels (a few per projection, norm
and rotation in every layer), and on a GPU their launch cost, not the weights' memory traffic,
sets the step's time. A captured graph launches them all at once. Graphs have fixed shapes and
fixed addresses, so this module owns the step's inputs in buffers of its own and keeps one graph
per bucket of (batch size, context width, tokens per sequence): the batch padded up to a bucket
size with rows that write their K/V into a block no request owns (the padding block) and attend
to one slot of it, the block tables padded to a bucket width in blocks (a power of two) that the
attention masks by each sequence's length. Logits land in the runner's buffer.

Plain decode steps (one token a sequence) are all captured at start-up (`capture_all`). Steps
that verify speculative drafts (a token and its draft a sequence) take graphs of several tokens a
sequence, their drafts padded with tokens that write only to the padding block and whose logits
are dropped; these are captured on first use. Prompt chunks, and steps past the largest bucket,
run eagerly. `capture=False` runs the same padded, fixed-shape forward without capturing (how the
CPU tests check everything but the capture itself).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Sequence

import torch

from worker.model.attention import AttentionMetadata, fixed_query_attention
from worker.model.transformer import Transformer

log = logging.getLogger(__name__)
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")  # a value per token: rows x queries
_SEQUENCE_FIELDS = ("seq_lens", "context_lens")  # a value per sequence


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, every multiple of 8 to 64, then of 32, up to and including max_num_seqs: a
    decode step pads at most 8 rows up to 64 sequences, and a large max_num_seqs does not
    multiply the graphs captured at start-up (one per batch bucket and context width)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, min(max_num_seqs, 65), 8))
    sizes += list(range(96, max_num_seqs, 32))
    return sorted({n for n in sizes if n < max_num_seqs} | {max_num_seqs})


def width_bucket(blocks: int, max_blocks: int) -> int:
    """The next power of two at or above `blocks`, capped at `max_blocks`."""
    return min(1 << max(0, blocks - 1).bit_length(), max_blocks)


def query_buckets(max_queries: int) -> list[int]:
    """Tokens per sequence: 1 (plain decode), then powers of two, then max_queries."""
    return sorted({width_bucket(n, max_queries) for n in range(1, max_queries + 1)})


class DecodeGraphs:
    """`max_queries`: the most tokens a sequence brings to a step the graphs take (1 + the longest
    draft); `logits` must hold max_num_seqs rows, and steps of more rows than it holds run eagerly."""

    def __init__(self, model: Transformer, kv_caches: list, block_size: int, max_num_seqs: int,
                 max_blocks_per_seq: int, attention_fn, logits: torch.Tensor, padding_block: int,
                 capture: bool = True, max_queries: int = 1):
        self.model, self.kv_caches, self.attention_fn = model, kv_caches, attention_fn
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.logits = logits
        self.padding_slot = padding_block * block_size
        self.padding_block = padding_block
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.query_sizes = query_buckets(max(1, max_queries))
        rows = self.batch_sizes[-1]
        self._rows, self._tokens = rows, rows * self.query_sizes[-1]
        device = model.input_device
        # One flat buffer, so a step's inputs cross to the device in one copy: the token vectors,
        # the sequence vectors, then the block tables [rows, max_blocks].
        self._offsets = {name: i * self._tokens for i, name in enumerate(_TOKEN_FIELDS)}
        self._offsets.update({name: len(_TOKEN_FIELDS) * self._tokens + i * rows
                              for i, name in enumerate(_SEQUENCE_FIELDS)})
        self._tables_at = len(_TOKEN_FIELDS) * self._tokens + len(_SEQUENCE_FIELDS) * rows
        size = self._tables_at + rows * max_blocks_per_seq
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=on_cuda)
        self._device = torch.zeros(size, dtype=torch.int64, device=device) if on_cuda else self._host
        self._host_array = self._host.numpy()
        self._host_tables = self._tables(self._host).numpy()
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture and on_cuda else None
        # Captures on a stream of this device: torch's shared default one lives on whichever
        # device captured first.
        self._capture_stream = torch.cuda.Stream(device) if self._pool is not None else None
        self.num_skipped = 0  # buckets left eager because their capture ran out of memory
        self.disabled: str | None = None  # why graphs stopped being used, once a capture failed
        self.drafts_disabled: str | None = None  # likewise for the graphs of several tokens a sequence
        self.num_steps = 0  # steps run here, captured or not
        self.num_draft_steps = 0  # of which steps verifying drafts
        self.num_replays = 0
        self.num_captures = 0

    def _vector(self, buffer: torch.Tensor, name: str, length: int) -> torch.Tensor:
        start = self._offsets[name]
        return buffer[start:start + length]

    def _tables(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self._tables_at:].view(self._rows, self.max_blocks)

    def takes(self, num_seqs: int, max_seq_len: int, max_queries: int = 1) -> bool:
        """Whether a step of this many sequences, the longest reaching `max_seq_len` tokens with
        this one (its cached tokens plus its new ones), each bringing at most `max_queries`
        tokens, can run from a graph."""
        if self.disabled is not None or num_seqs > self._rows or max_queries > self.query_sizes[-1]:
            return False
        if max_queries > 1:
            rows = next(n for n in self.batch_sizes if n >= num_seqs)
            queries = next(q for q in self.query_sizes if q >= max_queries)
            if self.drafts_disabled is not None or rows * queries > self.logits.shape[0]:
                return False
        return (max_seq_len - 1) // self.block_size < self.max_blocks

    def widths(self) -> list[int]:
        """Every width bucket: powers of two below max_blocks, then max_blocks."""
        return sorted({width_bucket(1 << i, self.max_blocks) for i in range(self.max_blocks.bit_length() + 1)})

    def capture_all(self) -> int:
        """Capture every plain-decode (batch, width) bucket now, rows all padding, so no decode
        step of a running server pays for a capture; the number captured (0 without capture, or
        once one failed)."""
        captured = 0
        for rows in reversed(self.batch_sizes):  # the largest first: the pool grows once
            for width in reversed(self.widths()):
                if self.disabled is not None or self._pool is None:
                    return captured
                if (rows, width, 1) not in self._graphs:
                    self._fill([], [], [], rows, width, 1)
                    self._graphs[rows, width, 1] = self._capture(rows, width, 1)
                    captured += self._graphs[rows, width, 1] is not None
        return captured

    def run(self, new_token_ids: Sequence[Sequence[int]], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """The logits of one step, one row per new token in order ([sum of tokens, V]; a view
        of the runner's buffer when each sequence brings one): sequence b feeds new_token_ids[b]
        from position context_lens[b] on, its K/V going where block_tables[b] says."""
        num_seqs = len(new_token_ids)
        most = max(map(len, new_token_ids))
        rows = next(n for n in self.batch_sizes if n >= num_seqs)
        queries = next(q for q in self.query_sizes if q >= most)
        longest = max(ctx + len(tokens) for ctx, tokens in zip(context_lens, new_token_ids))
        width = width_bucket(-(-longest // self.block_size), self.max_blocks)
        self._fill(new_token_ids, context_lens, block_tables, rows, width, queries)
        self.num_steps += 1
        self.num_draft_steps += queries > 1
        key = (rows, width, queries)
        if key not in self._graphs:
            self._graphs[key] = self._capture(rows, width, queries)
        graph = self._graphs[key]
        if graph is None:
            self._forward(rows, width, queries)
        else:
            graph.replay()
            self.num_replays += 1
        if queries == 1:
            return self.logits[:num_seqs]
        index = [b * queries + i for b, tokens in enumerate(new_token_ids) for i in range(len(tokens))]
        return self.logits.index_select(0, torch.tensor(index, device=self.logits.device))

    def _fill(self, new_token_ids, context_lens, block_tables, rows: int, width: int, queries: int) -> None:
        array, size = self._host_array, self.block_size
        num_seqs = len(new_token_ids)
        ids, positions, slots, seq_lens, contexts = self._offsets.values()
        if queries == 1:  # the hot path: one token a sequence, no padding within a row
            array[ids:ids + num_seqs] = [tokens[0] for tokens in new_token_ids]
            array[positions:positions + num_seqs] = context_lens
            array[slots:slots + num_seqs] = [table[ctx // size] * size + ctx % size
                                             for table, ctx in zip(block_tables, context_lens)]
            array[seq_lens:seq_lens + num_seqs] = [ctx + 1 for ctx in context_lens]
        else:
            # Padding tokens of a real row: token 0 at position 0, K/V to the padding block.
            array[ids:ids + rows * queries] = 0
            array[positions:positions + rows * queries] = 0
            array[slots:slots + rows * queries] = self.padding_slot
            for b, (tokens, ctx, table) in enumerate(zip(new_token_ids, context_lens, block_tables)):
                at = b * queries
                array[ids + at:ids + at + len(tokens)] = tokens
                array[positions + at:positions + at + len(tokens)] = range(ctx, ctx + len(tokens))
                array[slots + at:slots + at + len(tokens)] = [table[p // size] * size + p % size
                                                            for p in range(ctx, ctx + len(tokens))]
                array[seq_lens + b] = ctx + len(tokens)
        array[contexts:contexts + num_seqs] = context_lens
        # Padding rows: token 0 at position 0, written to and read from the padding block alone.
        first, last = num_seqs * queries, rows * queries
        for start, value in ((ids, 0), (positions, 0), (slots, self.padding_slot)):
            array[start + first:start + last] = value
        array[seq_lens + num_seqs:seq_lens + rows] = 1
        array[contexts + num_seqs:contexts + rows] = 0
        tables = self._host_tables
        for b, table in enumerate(block_tables):
            used = min(len(table), width)
            tables[b, :used] = table[:used]
            tables[b, used:width] = self.padding_block
        tables[num_seqs:rows, :width] = self.padding_block
        if self._device is not self._host:
            end = self._tables_at + rows * self.max_blocks
            self._device[:end].copy_(self._host[:end], non_blocking=True)

    def _forward(self, rows: int, width: int, queries: int) -> None:
        buffer = self._device
        tokens = rows * queries
        # context_lens only shape the attention (every sequence as long as the width allows);
        # seq_lens, read on the device, mask each sequence to its own length.
        meta = AttentionMetadata(slot_mapping=self._vector(buffer, "slot_mapping", tokens),
                                 block_tables=self._tables(buffer)[:rows, :width],
                                 seq_lens=self._vector(buffer, "seq_lens", rows), query_lens=[queries] * rows,
                                 context_lens=[width * self.block_size - queries] * rows,
                                 num_decodes=rows if queries == 1 else 0)
        attention = self.attention_fn if queries == 1 else partial(
            fixed_query_attention, queries=queries, context_lens=self._vector(buffer, "context_lens", rows))
        hidden = self.model(self._vector(buffer, "input_ids", tokens), self._vector(buffer, "positions", tokens),
                            self.kv_caches, meta, attention)
        self.model.compute_logits(hidden, out=self.logits[:tokens])

    def _capture(self, rows: int, width: int, queries: int) -> torch.cuda.CUDAGraph | None:
        if self._pool is None:
            return None
        try:
            # A first run outside the graph loads each kernel and library workspace; the
            # inputs are this step's own, so its K/V writes are the ones the replay repeats.
            side = torch.cuda.Stream(self._device.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(rows, width, queries)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the memory watchdog may query the device from its own thread meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                self._forward(rows, width, queries)
            log.debug("captured a graph of %d sequences x %d tokens, %d blocks wide", rows, queries, width)
            self.num_captures += 1
            return graph
        except torch.cuda.OutOfMemoryError:
            # This bucket's graph does not fit beside the KV pool: its steps run eagerly (as
            # lean as before), the other buckets keep their graphs.
            self.num_skipped += 1
            torch.cuda.empty_cache()
            log.warning("no memory to capture a graph of %d sequences x %d tokens, %d blocks wide: such steps "
                        "run eagerly", rows, queries, width)
            return None
        except Exception as exc:  # an op that cannot be captured: such steps run eagerly from now on
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if queries == 1:
                self.disabled = reason
            else:
                self.drafts_disabled = reason
            log.warning("%s graphs disabled, a capture failed (%s)", "decode" if queries == 1 else "draft", reason)
            return None
