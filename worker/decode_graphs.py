"""Decode steps replayed from captured CUDA graphs.

A decode step of a small batch launches hundreds of small kernels (a few per projection, norm
and rotation in every layer), and on a GPU their launch cost, not the weights' memory traffic,
sets the step's time. A captured graph launches them all at once. Graphs have fixed shapes and
fixed addresses, so this module owns the step's inputs in buffers of its own and captures one
graph per (batch size, context width) bucket on first use: the batch padded up to a bucket
size with rows that write their K/V into a block no request owns (the padding block) and
attend to one slot of it, the block tables padded to a bucket width in blocks (a power of two)
that the attention masks by each sequence's length. Logits land in the runner's buffer.

Steps with a prompt chunk or a draft to verify, and batches past the largest bucket, run
eagerly. `capture=False` runs the same padded, fixed-shape forward without capturing (how the
CPU tests check everything but the capture itself).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from worker.model.attention import AttentionMetadata
from worker.model.transformer import Transformer

log = logging.getLogger(__name__)
_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def width_bucket(blocks: int, max_blocks: int) -> int:
    """The next power of two at or above `blocks`, capped at `max_blocks`."""
    return min(1 << max(0, blocks - 1).bit_length(), max_blocks)


class DecodeGraphs:
    def __init__(self, model: Transformer, kv_caches: list, block_size: int, max_num_seqs: int,
                 max_blocks_per_seq: int, attention_fn, logits: torch.Tensor, padding_block: int,
                 capture: bool = True):
        self.model, self.kv_caches, self.attention_fn = model, kv_caches, attention_fn
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.logits = logits
        self.padding_slot = padding_block * block_size
        self.padding_block = padding_block
        self.capture = capture
        self.batch_sizes = batch_buckets(max_num_seqs)
        rows = self.batch_sizes[-1]
        device = model.input_device
        # One flat buffer, so a step's inputs cross to the device in one copy: four vectors of
        # `rows`, then the block tables [rows, max_blocks].
        size = rows * (len(_FIELDS) + max_blocks_per_seq)
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=on_cuda)
        self._device = torch.zeros(size, dtype=torch.int64, device=device) if on_cuda else self._host
        self._host_array = self._host.numpy()
        self._rows = rows
        self._host_tables = self._tables(self._host).numpy()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture and on_cuda else None
        self.disabled: str | None = None  # why graphs stopped being used, once a capture failed
        self.num_steps = 0  # decode steps run here, captured or not
        self.num_replays = 0
        self.num_captures = 0

    def _vector(self, buffer: torch.Tensor, index: int, rows: int) -> torch.Tensor:
        return buffer[index * self._rows:index * self._rows + rows]

    def _tables(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[len(_FIELDS) * self._rows:].view(self._rows, self.max_blocks)

    def takes(self, num_seqs: int, max_context_len: int) -> bool:
        """Whether a decode step of this many sequences, the longest with this many cached tokens,
        can run from a graph."""
        return (self.disabled is None and num_seqs <= self._rows
                and max_context_len // self.block_size < self.max_blocks)

    def widths(self) -> list[int]:
        """Every width bucket: powers of two below max_blocks, then max_blocks."""
        return sorted({width_bucket(1 << i, self.max_blocks) for i in range(self.max_blocks.bit_length() + 1)})

    def capture_all(self) -> int:
        """Capture every (batch, width) bucket now, rows all padding, so no step of a running
        server pays for a capture; the number captured (0 without capture, or once one failed)."""
        captured = 0
        for rows in reversed(self.batch_sizes):  # the largest first: the pool grows once
            for width in reversed(self.widths()):
                if self.disabled is not None or self._pool is None:
                    return captured
                if (rows, width) not in self._graphs:
                    self._fill([], [], [], rows, width)
                    self._graphs[rows, width] = self._capture(rows, width)
                    captured += self._graphs[rows, width] is not None
        return captured

    def run(self, token_ids: Sequence[int], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """The logits [B, V] (a view of the runner's buffer) of one decode step: sequence b feeds
        token_ids[b] at position context_lens[b], its K/V going where block_tables[b] says."""
        num_seqs = len(token_ids)
        rows = next(n for n in self.batch_sizes if n >= num_seqs)
        width = width_bucket(max(context_lens) // self.block_size + 1, self.max_blocks)
        self._fill(token_ids, context_lens, block_tables, rows, width)
        self.num_steps += 1
        key = (rows, width)
        if key not in self._graphs:
            self._graphs[key] = self._capture(rows, width)
        graph = self._graphs[key]
        if graph is None:
            self._forward(rows, width)
        else:
            graph.replay()
            self.num_replays += 1
        return self.logits[:num_seqs]

    def _fill(self, token_ids, context_lens, block_tables, rows: int, width: int) -> None:
        array, size = self._host_array, self.block_size
        num_seqs = len(token_ids)
        stride = self._rows
        array[0:num_seqs] = token_ids
        array[stride:stride + num_seqs] = context_lens
        array[2 * stride:2 * stride + num_seqs] = [table[ctx // size] * size + ctx % size
                                                   for table, ctx in zip(block_tables, context_lens)]
        array[3 * stride:3 * stride + num_seqs] = [ctx + 1 for ctx in context_lens]
        # Padding rows: token 0 at position 0, written to and read from the padding block alone.
        for index, value in enumerate((0, 0, self.padding_slot, 1)):
            array[index * stride + num_seqs:index * stride + rows] = value
        tables = self._host_tables
        for b, table in enumerate(block_tables):
            used = min(len(table), width)
            tables[b, :used] = table[:used]
            tables[b, used:width] = self.padding_block
        tables[num_seqs:rows, :width] = self.padding_block
        if self._device is not self._host:
            end = len(_FIELDS) * stride + rows * self.max_blocks
            self._device[:end].copy_(self._host[:end], non_blocking=True)

    def _forward(self, rows: int, width: int) -> None:
        buffer = self._device
        # context_lens only shape the attention (every sequence as long as the width allows);
        # seq_lens, read on the device, mask each sequence to its own length.
        meta = AttentionMetadata(slot_mapping=self._vector(buffer, 2, rows),
                                 block_tables=self._tables(buffer)[:rows, :width],
                                 seq_lens=self._vector(buffer, 3, rows), query_lens=[1] * rows,
                                 context_lens=[width * self.block_size - 1] * rows, num_decodes=rows)
        hidden = self.model(self._vector(buffer, 0, rows), self._vector(buffer, 1, rows), self.kv_caches, meta,
                            self.attention_fn)
        self.model.compute_logits(hidden, out=self.logits[:rows])

    def _capture(self, rows: int, width: int) -> torch.cuda.CUDAGraph | None:
        if self._pool is None:
            return None
        try:
            # A first run outside the graph loads each kernel and library workspace; the
            # inputs are this step's own, so its K/V writes are the ones the replay repeats.
            side = torch.cuda.Stream(self._device.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(rows, width)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the memory watchdog may query the device from its own thread meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(rows, width)
            log.debug("captured a decode graph of %d sequences, %d blocks wide", rows, width)
            self.num_captures += 1
            return graph
        except Exception as exc:  # an op that cannot be captured: every later step runs eagerly
            self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("decode graphs disabled, a capture failed (%s)", self.disabled)
            return None
