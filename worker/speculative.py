"""Speculative decoding by prompt lookup (n-gram): one request's draft proposer and how long its drafts are.

`NgramSpeculation` belongs to one request (the scheduler's view of it, `Request.speculation`). It
proposes up to k tokens by finding the latest earlier occurrence of the sequence's last n tokens
(n from max_n down to min_n) in prompt + output and copying what followed it, and it shortens, then
pauses, its drafts while they keep failing. Verifying a draft is the runner's and the scheduler's job
(docs/architecture.md, "Speculative decoding"); nothing here changes which tokens a request produces,
only how many a step may confirm. Pure Python.
"""
from __future__ import annotations

from typing import Sequence

# Adaptivity: after this many drafts in a row with nothing accepted the request stops proposing for
# PAUSE_STEPS decode steps, doubled for every further miss up to MAX_PAUSE_STEPS; one accepted token
# ends the streak. Each miss also halves k, and a wholly accepted draft doubles it back.
MISSES_BEFORE_PAUSE = 2
PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 128


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> the position right after its latest occurrence whose
    next token is known. Built incrementally over one request's tokens (prompt + output), which only
    ever grow, so each step indexes just the tokens it added."""

    __slots__ = ("sizes", "_tables", "_num_indexed")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first: the most specific match wins
        self._tables: tuple[dict[tuple[int, ...], int], ...] = tuple({} for _ in self.sizes)
        self._num_indexed = 0  # positions [0, _num_indexed) have their preceding n-grams recorded

    def _update(self, token_ids: Sequence[int]) -> None:
        # Position i (its token known) follows the n-gram token_ids[i - n:i]. The sequence's own last
        # n-gram has no known successor yet, so it is recorded only once the next token arrives: a
        # lookup never finds the suffix itself.
        end = len(token_ids)
        for i in range(self._num_indexed, end):
            for n, table in zip(self.sizes, self._tables):
                if i >= n:
                    table[tuple(token_ids[i - n:i])] = i
        self._num_indexed = end

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram of
        `token_ids` found; [] when none occurs. A match near the end continues into its own copy (what
        followed "a b c" in "... a b c a b" is "c a b ..."), so a repeating span yields whole drafts."""
        self._update(token_ids)
        length = len(token_ids)
        for n, table in zip(self.sizes, self._tables):
            if length <= n:
                continue
            start = table.get(tuple(token_ids[length - n:]))
            if start is None:
                continue
            draft: list[int] = []
            for j in range(k):
                # start < length, so a position past the end is an earlier draft token: p - length < j.
                p = start + j
                draft.append(token_ids[p] if p < length else draft[p - length])
            return draft
        return []


class NgramSpeculation:
    """One request's proposer, its current draft length and its acceptance counters."""

    __slots__ = ("max_k", "k", "index", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "_misses",
                 "_pause")

    def __init__(self, k: int, min_n: int, max_n: int):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.max_k = k
        self.k = k  # the draft length asked of the next proposal
        self.index = NgramIndex(min_n, max_n)
        self.num_drafts = 0  # drafts verified
        self.num_draft_tokens = 0  # tokens in them
        self.num_accepted_tokens = 0  # of those, the ones sampling agreed with
        self._misses = 0  # drafts in a row with nothing accepted
        self._pause = 0  # decode steps left without proposing

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """A draft of at most min(k, limit) tokens to verify after `token_ids`, or [] (no match, or paused)."""
        if self._pause:
            self._pause -= 1
            return []
        k = min(self.k, limit)
        return self.index.propose(token_ids, k) if k > 0 else []

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """A verified draft of `num_proposed` tokens whose first `num_accepted` were confirmed."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if num_accepted == 0:
            self._misses += 1
            self.k = max(1, self.k // 2)
            if self._misses >= MISSES_BEFORE_PAUSE:
                self._pause = min(MAX_PAUSE_STEPS, PAUSE_STEPS << min(self._misses - MISSES_BEFORE_PAUSE, 8))
            return
        self._misses = 0
        # A partly accepted draft says how long copies run here; a wholly accepted one may be longer.
        grown = 2 * self.k if num_accepted == num_proposed else num_accepted + 1
        self.k = max(1, min(self.max_k, grown))

