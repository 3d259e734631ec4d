"""Turns one step's logits [B, V] into next tokens for a batch of requests with different SamplingParams.
Owns logits processing (with worker/logits_processors.py), the draw (with worker/sampling_draws.py, which says
where each row's randomness comes from) and logprobs: it never schedules, never detokenizes, never checks stop
conditions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from shared.sampling_params import SamplingParams, TopLogprobs
from worker.constraints import mask_rows
from worker.logits_processors import (
    apply_logit_bias,
    apply_min_tokens,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p_min_p,
)
from worker.model import cpu_kernels
from worker.non_finite_logits import finite_token_ids, non_finite_rows
from worker.sampling_draws import position_uniform, sample_rows_torch

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_repetition_penalty",
    "apply_top_k_top_p_min_p",
    "top_logprobs",
]


@dataclass(slots=True)
class SamplingBatch:
    """One row per request in the step, in the order of the logits rows."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # the request's own generator if it has a seed, else None
    token_histories: list[Sequence[int]]  # prompt + generated ids so far; read only when repetition_penalty != 1
    # Generated ids so far, resumed ones included (what presence/frequency penalties count and min_tokens
    # compares with); read only for rows that use those. None: no row does (a ValueError if one does).
    output_token_ids: list[Sequence[int]] | None = None
    # The model's EOS ids per row, banned with the row's stop_token_ids while it is under min_tokens
    # (ignore_eos or not, as vLLM does). None: no EOS ids.
    eos_token_ids: list[Sequence[int]] | None = None
    # Per row, the request's structured-output Constraint (worker/constraints.py) or None. None: no row has one.
    constraints: list | None = None
    # Per row, the seed of the row's output position (token_seed), from which it draws (position_uniform), or
    # None to draw from its generator as it stands. A seed per position lets several rows of one request (a
    # speculative draft's positions) draw apart, and a retried or resumed step draw the same.
    seeds: list[int | None] | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: log-prob of the chosen token under the RAW distribution: log_softmax of the model's logits as
    # given, before logit bias, penalties, min_tokens and temperature (what the model thinks, not how we
    # steered it; vLLM's default too). None when no row asked; when some row asked, one entry per row: the
    # value for each row that asked (params.logprobs), None for the others (never computed for them).
    logprobs: list[float | None] | None
    # Per row: its top_logprobs most likely tokens under the same raw distribution (top_logprobs()); () for
    # rows that asked for none. None when no row asked.
    top_logprobs: list[TopLogprobs] | None = None
    # The rows whose raw logits are not all finite (NaN or inf: an activation overflowed, e.g. K/V past a
    # float16 pool's range); their tokens mean nothing. None on a step without such a row.
    non_finite_rows: list[int] | None = None


def top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    """The k most likely (token id, logprob) of one row logprobs [V], by descending logprob, ties by ascending
    token id (so the answer never depends on how topk orders equal values). k is clamped to V."""
    k = min(k, logprobs.shape[0])
    if k <= 0:
        return ()
    kth = torch.topk(logprobs, k, sorted=True).values[-1]
    # Every token at least as likely as the k-th: k of them, plus any tied with it. nonzero lists them by
    # ascending id, and a stable sort keeps that order among equals.
    candidates = torch.nonzero(logprobs >= kth).flatten()  # [C], C >= k
    values = logprobs.index_select(0, candidates)  # [C]
    order = torch.sort(values, descending=True, stable=True).indices[:k]  # [k]
    return tuple(zip(candidates[order].tolist(), values[order].tolist()))


class Sampler:
    """Stateless apart from the generator used by rows without a seed."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()  # nondeterministic, like an unseeded API call should be
        else:
            self._generator.manual_seed(seed)
        # Greedy rows' argmax by our kernel where it runs (float32 logits on the CPU): torch's
        # costs far more per vocabulary-sized row (docs/benchmarks.md). Chosen once, here.
        kernels = cpu_kernels.load() if self.device.type == "cpu" else None
        self._argmax_rows = kernels.argmax_rows if kernels is not None else None
        self._finite_choices = kernels.finite_choices if kernels is not None else None
        # Sampled rows' filters and draw, and the penalties, by our kernels on the CPU: the torch
        # path's sort, masks and per-token ops cost several times a small model's step.
        self._sample_rows = kernels.sample_rows if kernels is not None else None
        self._repetition_penalty_rows = kernels.repetition_penalty_rows if kernels is not None else None
        self._presence_frequency_rows = kernels.presence_frequency_rows if kernels is not None else None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Next token of each row. Processing order, per row and only where the row asks: logit bias,
        repetition penalty, presence/frequency penalties, min_tokens' ban, the grammar's mask (structured
        output), then (sampled rows) temperature,
        top-k, top-p, min-p and the draw; greedy rows take the argmax of the processed logits. `logits` is
        never modified: logprobs are read from it raw.

        Work is per row, not per batch: a row that needs nothing but a greedy argmax takes it on the raw
        logits (our kernel on CPU float32, no copy) even when other rows of the batch use features; only the
        rows that edit or sample their logits get the float32 copy, and only the rows that ask for logprobs
        get a log_softmax. Each row's result is what it would be alone."""
        num_rows = self._validate(logits, batch)
        params = batch.params
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=None)

        # One pass over the Python params decides which work this step needs at all, and for which rows.
        sampled_rows, repeated_rows, counted_rows, biased_rows, min_token_rows = [], [], [], [], []
        processed = []  # rows whose logits are edited or sampled (min_tokens' bans are added below)
        logprob_rows = []
        want_top = False
        for i, (p, g) in enumerate(zip(params, batch.generators)):
            if g is not None or type(p) is not SamplingParams or p.seed is not None:
                # Only such a row can be refused: the plain one (no seed, no generator) passes as it is.
                self._validate_row(i, p, g, logits)
            edited = False
            if not p.is_greedy:
                sampled_rows.append(i)
                edited = True
            if p.repetition_penalty != 1.0:
                repeated_rows.append(i)
                edited = True
            if p.presence_penalty or p.frequency_penalty:
                counted_rows.append(i)
                edited = True
            if p.logit_bias:
                biased_rows.append(i)
                edited = True
            if p.min_tokens:
                min_token_rows.append(i)
            if edited:
                processed.append(i)
            if p.logprobs:
                logprob_rows.append(i)
                want_top |= p.top_logprobs > 0
        if (counted_rows or min_token_rows) and batch.output_token_ids is None:
            raise ValueError("batch.output_token_ids is required: some row uses presence_penalty, "
                             "frequency_penalty or min_tokens")
        banned = self._banned_for_min_tokens(batch, min_token_rows) if min_token_rows else {}
        constraints = batch.constraints
        constrained_rows = [i for i, c in enumerate(constraints) if c is not None] if constraints is not None else []
        if banned or constrained_rows:
            processed = sorted(set(processed).union(banned, constrained_rows))

        if not processed:
            # Common greedy case: no copy, no float32 conversion (an upcast cannot change the argmax).
            tokens = self._greedy(logits)  # [B]
        elif len(processed) == num_rows:
            # Copy once: the edits work in place and the caller's logits (needed raw for logprobs) stay intact.
            x = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)  # [B, V]
            tokens = self._process(x, batch, processed, sampled_rows, repeated_rows, counted_rows, biased_rows,
                                   banned, constrained_rows)  # [B]
        else:
            device = logits.device
            processed_index = torch.tensor(processed, device=device)  # [P]
            x = logits.index_select(0, processed_index).to(dtype=torch.float32)  # [P, V], a copy
            is_processed = set(processed)
            plain = [i for i in range(num_rows) if i not in is_processed]  # [G], G = B - P
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)  # [B]
            tokens.index_copy_(0, processed_index, self._process(
                x, batch, processed, sampled_rows, repeated_rows, counted_rows, biased_rows, banned, constrained_rows))
            tokens.index_copy_(0, torch.tensor(plain, device=device), self._greedy_rows(logits, plain))

        logprobs = tops = None
        if logprob_rows:
            # Raw log_softmax of the rows that asked only; the others get None (and () for top_logprobs).
            if len(logprob_rows) == num_rows:
                raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
                chosen = tokens
            else:
                index = torch.tensor(logprob_rows, device=logits.device)  # [L]
                raw_logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [L, V]
                chosen = tokens.index_select(0, index)  # [L]
            values = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            logprobs = [None] * num_rows
            for j, i in enumerate(logprob_rows):
                logprobs[i] = values[j]
            if want_top:
                tops = [()] * num_rows
                for j, i in enumerate(logprob_rows):
                    if params[i].top_logprobs:
                        tops[i] = top_logprobs(raw_logprobs[j], params[i].top_logprobs)
        # Whichever path drew it, a token whose raw logit is not finite (a NaN row; one inf that argmax
        # takes) becomes 0, so only a step where some row took 0 looks at its whole logits again.
        token_ids = finite_token_ids(logits, tokens, self._finite_choices)
        non_finite = non_finite_rows(logits, token_ids) if 0 in token_ids else None
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=tops, non_finite_rows=non_finite)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax of each row of the raw logits [R, V] (any float dtype, never copied); token ids [R]."""
        if self._argmax_rows is not None and logits.dtype == torch.float32:
            return self._argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _greedy_rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """_greedy on the given rows (ascending) of logits [B, V] only; token ids [len(rows)]. Each run of
        consecutive rows is a view, so the kernel reads them in place; torch's argmax gets one gathered copy."""
        runs = []  # [start, stop) of consecutive rows
        for i in rows:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        if len(runs) == 1:
            return self._greedy(logits[runs[0][0]:runs[0][1]])
        if self._argmax_rows is not None and logits.dtype == torch.float32:
            return torch.cat([self._argmax_rows(logits[start:stop]) for start, stop in runs])
        return logits.index_select(0, torch.tensor(rows, device=logits.device)).argmax(dim=-1)

    def _process(self, x: torch.Tensor, batch: SamplingBatch, rows: list[int], sampled_rows: list[int],
                 repeated_rows: list[int], counted_rows: list[int], biased_rows: list[int],
                 banned: dict[int, list[int]], constrained_rows: list[int] = ()) -> torch.Tensor:
        """Tokens [P] of the batch rows `rows` (ascending), whose logits x [P, V] (a float32 copy, modified in
        place) are given in that order: edit them as their params ask, then take the argmax (greedy rows) or
        draw (sampled rows). The other lists name batch rows, each a subset of `rows`."""
        num_rows = len(rows)
        # Position of each batch row in `logits`; the identity when every row of the batch is here.
        local = (lambda i: i) if rows[-1] == num_rows - 1 else {row: j for j, row in enumerate(rows)}.__getitem__
        params = [batch.params[i] for i in rows]
        if biased_rows:
            apply_logit_bias(x, [p.logit_bias for p in params], rows=[local(i) for i in biased_rows])
        if repeated_rows and not self._edited_by_kernel(
                self._repetition_penalty_rows, x, "token history", [local(i) for i in repeated_rows],
                [batch.token_histories[i] for i in repeated_rows],
                [batch.params[i].repetition_penalty for i in repeated_rows]):
            apply_repetition_penalty(x, [batch.token_histories[i] for i in rows],
                                     [p.repetition_penalty for p in params], rows=[local(i) for i in repeated_rows])
        if counted_rows and not self._edited_by_kernel(
                self._presence_frequency_rows, x, "output history", [local(i) for i in counted_rows],
                [batch.output_token_ids[i] for i in counted_rows],
                [batch.params[i].presence_penalty for i in counted_rows],
                [batch.params[i].frequency_penalty for i in counted_rows]):
            apply_presence_frequency_penalties(
                x, [batch.output_token_ids[i] for i in rows], [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params], rows=[local(i) for i in counted_rows]
            )
        if banned:
            # Last of the edits, so no later addition can lift a banned token off -inf.
            apply_min_tokens(x, [banned.get(i, ()) for i in rows], rows=[local(i) for i in banned])
        if constrained_rows:
            # The grammar's mask goes last too: what it forbids stays forbidden whatever else was added.
            mask_rows(x, [local(i) for i in constrained_rows], [batch.constraints[i] for i in constrained_rows])

        sampled_params = [batch.params[i] for i in sampled_rows]
        sampled_generators = [batch.generators[i] for i in sampled_rows]
        sampled_seeds = [batch.seeds[i] for i in sampled_rows] if batch.seeds is not None else None
        if len(sampled_rows) == num_rows:
            return self._sample(x, sampled_params, sampled_generators, sampled_seeds)  # [P]
        tokens = self._greedy(x)  # [P]; final for greedy rows, overwritten below for sampled rows
        if sampled_rows:
            row_index = torch.tensor([local(i) for i in sampled_rows], device=x.device)  # [S]
            xs = x.index_select(0, row_index)  # [S, V]
            tokens.index_copy_(0, row_index, self._sample(xs, sampled_params, sampled_generators, sampled_seeds))
        return tokens

    def _edited_by_kernel(self, kernel, x: torch.Tensor, what: str, *args) -> bool:
        """Runs one of our in-place edits of x's rows; False where it cannot (none built, x not on the CPU, a
        history the binding cannot read as a list of ints: a tensor, an array), so the caller runs torch's.
        An id outside the vocabulary is a ValueError naming `what`, and nothing is edited."""
        if kernel is None or not x.is_cpu:
            return False
        try:
            bad = kernel(x, *args)
        except TypeError:
            return False
        if bad is not None:
            raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {x.shape[1]})")
        return True

    @staticmethod
    def _banned_for_min_tokens(batch: SamplingBatch, rows: list[int]) -> dict[int, list[int]]:
        """Row -> the ids it may not sample this step: EOS and stop_token_ids while it has generated fewer
        than min_tokens. Rows past their min_tokens (or with nothing to ban) are absent."""
        banned = {}
        for i in rows:
            p = batch.params[i]
            if len(batch.output_token_ids[i]) >= p.min_tokens:
                continue
            eos = batch.eos_token_ids[i] if batch.eos_token_ids is not None else ()
            ids = [*p.stop_token_ids, *eos]
            if ids:
                banned[i] = ids
        return banned

    def _sample(
        self, x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
        seeds: list[int | None] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row of x [S, V] (float32; torch's path modifies it in place); returns token
        ids [S].

        Each row draws one uniform u (its position's, from its seed; else from its generator, or the sampler's
        for unseeded rows) and takes the first token, in id order, at which the running sum of its filtered
        probabilities passes u: inverse-CDF sampling, exact for any distribution, so a row's token depends
        only on its logits and its u, never on the batch around it."""
        uniforms = self._uniforms(generators, seeds)  # [S]
        if self._sample_rows is not None and x.is_cpu:
            return self._sample_rows(x, [p.temperature for p in params], [p.top_k for p in params],
                                     [p.top_p for p in params], [p.min_p for p in params], uniforms)
        return sample_rows_torch(x, params, uniforms)

    def _uniforms(self, generators: list[torch.Generator | None], seeds: list[int | None] | None) -> list[float]:
        """One uniform in [0, 1) per row: a row with a seed for this draw takes its position's
        (position_uniform), a seeded row without one draws from its generator as it stands, and the others
        draw from the sampler's generator, one call for all of them."""
        uniforms = [0.0] * len(generators)
        unseeded = []
        for i, g in enumerate(generators):
            seed = seeds[i] if seeds is not None else None
            if seed is not None:
                uniforms[i] = position_uniform(seed)
            elif g is not None:
                uniforms[i] = torch.rand((), dtype=torch.float64, generator=g, device=g.device).item()
            else:
                unseeded.append(i)
        if unseeded:
            drawn = torch.rand(len(unseeded), dtype=torch.float64, generator=self._generator, device=self.device)
            for i, u in zip(unseeded, drawn.tolist()):
                uniforms[i] = u
        return uniforms

    def _validate(self, logits: torch.Tensor, batch: SamplingBatch) -> int:
        """The checks of the logits and the batch's shape; returns the number of rows. Each row's params and
        generator are checked in __call__'s pass over the rows (`_validate_row`), before any work, where one
        could be wrong. Each tensor attribute read costs a call into torch: a valid step reads few."""
        if not isinstance(logits, torch.Tensor):
            raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        shape = logits.shape
        if len(shape) != 2:
            raise ValueError(f"logits must be 2-D [B, V], got shape {tuple(shape)}")
        if not logits.dtype.is_floating_point:
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        num_rows, vocab_size = shape
        if vocab_size == 0:
            raise ValueError("logits have an empty vocabulary dimension (V == 0)")
        outputs, eos, seeds = batch.output_token_ids, batch.eos_token_ids, batch.seeds
        if (len(batch.params) != num_rows or len(batch.generators) != num_rows
                or len(batch.token_histories) != num_rows or (outputs is not None and len(outputs) != num_rows)
                or (eos is not None and len(eos) != num_rows) or (seeds is not None and len(seeds) != num_rows)):
            lengths = {
                "batch.params": len(batch.params),
                "batch.generators": len(batch.generators),
                "batch.token_histories": len(batch.token_histories),
            }
            for name in ("output_token_ids", "eos_token_ids", "seeds"):
                if getattr(batch, name) is not None:
                    lengths[f"batch.{name}"] = len(getattr(batch, name))
            for name, length in lengths.items():
                if length != num_rows:
                    raise ValueError(f"logits have {num_rows} rows but {name} has {length} entries")
        # is_cpu first: it costs far less than building the device's type string.
        if logits.is_cpu != self._on_cpu or (not self._on_cpu and logits.device.type != self.device.type):
            raise ValueError(f"logits are on {logits.device} but this Sampler draws noise on {self.device}")
        return num_rows

    @staticmethod
    def _validate_row(i: int, p: SamplingParams, g: torch.Generator | None, logits: torch.Tensor) -> None:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"batch.params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if p.seed is not None and g is None:
            # Falling back to the shared generator would silently break the seed's reproducibility.
            raise ValueError(f"row {i} has seed={p.seed} but no generator; create one with make_generator")
        if g is not None and g.device.type != logits.device.type:
            raise ValueError(f"row {i}'s generator is on {g.device} but logits are on {logits.device}")
