"""Structured output, the worker's half: an llguidance matcher per constrained request, built from
the grammar the gateway checked, and the per-step token masks of a batch's constrained rows.

Matchers are compiled once per distinct grammar (a bounded cache keyed by its hash) and each
request gets a copy of the compiled one. A matcher's state is exactly the request's output tokens:
it advances with every token the request takes (the scheduler calls `advance`), a preempted
request keeps its tokens and so its matcher (recompute replays nothing), and a request resumed
from another worker's tokens replays them into a fresh matcher at admission. The masks of a step
are filled together (llguidance's executor, on its own threads, outside the GIL) and applied in
place (unpacked with numpy), one bitmask row per constrained row: an allowed token's logit is untouched, every other is
-inf, EOS included unless the grammar accepts here.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import llguidance
import numpy as np
import torch

DEFAULT_CACHE_SIZE = 64


class GrammarError(ValueError):
    """The grammar cannot be compiled, or a resumed request's tokens do not fit it."""


class Constraint:
    """One request's matcher: what the grammar allows next, given every token taken so far."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        """Take the request's next token. A token the grammar refuses (only possible when the
        mask could not be applied) puts the matcher in its error state, which `dead_end` reports."""
        self.matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """The grammar is complete and allows nothing more (its EOS was taken, or it has no
        continuation): the request ends here, `stop`. A matcher in its error state reports itself
        stopped too (a refused token, or one of llguidance's limits met mid-output, e.g. a row of
        more than 2,000 Earley items): that is a dead end, never a completed output."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def dead_end(self) -> str:
        """Why no token can follow ("" while the output can still go on)."""
        return (self.matcher.get_error() or "the matcher is in its error state") if self.matcher.is_error() else ""


class ConstraintCompiler:
    """Builds a request's Constraint from its grammar, compiling each distinct grammar once."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"{model_dir} has no tokenizer.json, which structured output compiles against")
        self.tokenizer = llguidance.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses)

    def constraint(self, grammar: str, output_token_ids: Sequence[int] = ()) -> Constraint:
        """A fresh Constraint for `grammar`, advanced past `output_token_ids` (a resumed request's)."""
        key = hashlib.blake2b(grammar.encode(), digest_size=16).digest()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(f"the grammar does not compile: {compiled.get_error()}")
            self.num_compiled += 1
            self._compiled[key] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        constraint = Constraint(compiled.deep_copy())
        for token_id in output_token_ids:
            constraint.advance(token_id)
        if constraint.dead_end:
            raise GrammarError(f"the request's tokens so far do not fit its grammar: {constraint.dead_end}")
        return constraint


_executor: llguidance.LLExecutor | None = None


def mask_rows(logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[Constraint]) -> None:
    """Set to -inf, in place, every logit of `rows` of logits [B, V] (float32) that its row's
    Constraint does not allow next."""
    if rows:
        apply_bitmask(logits, rows, fill_bitmask(constraints, logits.shape[1]))


def fill_bitmask(constraints: Sequence[Constraint], vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32, bit t of row i set where constraints[i] allows token t next. Filled
    by llguidance's executor directly, not through llguidance.torch, whose import alone (it builds
    a torch.compile kernel, so torch's compiler comes with it) took seconds of every worker's start."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    bitmask = torch.full((len(constraints), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, len(constraints))
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """-inf, in place, where row rows[i] of logits is not allowed by bitmask row i. Unpacked with numpy
    rather than llguidance's own kernel, which torch.compile builds on its first call (seconds, during
    which every request of the batch would wait)."""
    num_rows, vocab = len(rows), logits.shape[1]
    # The complement's bits are the forbidden tokens, and numpy's 0/1 bytes read as bools without a copy.
    bits = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [R, V]
    forbidden = torch.from_numpy(bits.view(np.bool_)).to(logits.device)  # [R, V]
    if num_rows == logits.shape[0] and list(rows) == list(range(num_rows)):
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(list(rows), device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))
