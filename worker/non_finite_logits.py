"""What a step does with logits that are not finite (NaN or inf: an activation overflowed its
dtype): the token a row chose becomes 0 where its raw logit is not finite, and only a step where
some row took token 0 looks at those rows' whole logits again, to name the rows whose tokens mean
nothing. On the CPU with float32 logits the first part is one call into our kernels."""
from __future__ import annotations

from typing import Callable

import torch

# Our kernel's finite_choices(logits, tokens) -> list[int], where it is built.
FiniteChoices = Callable[[torch.Tensor, torch.Tensor], list]


def non_finite_to_zero(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [R] with 0 where a row's chosen logit in logits [R, V] is not finite (NaN or inf)."""
    return tokens.masked_fill_(~torch.isfinite(logits.gather(1, tokens.unsqueeze(1)).squeeze(1)), 0)


def finite_token_ids(logits: torch.Tensor, tokens: torch.Tensor, kernel: FiniteChoices | None) -> list[int]:
    """tokens [R] as a list, 0 where the row's raw logit at its token is not finite: one kernel call on
    float32 logits with contiguous rows (what a decode step's fixed cost would otherwise spend on a
    handful of torch ops), else the torch ops."""
    if kernel is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return kernel(logits, tokens)
    return non_finite_to_zero(logits, tokens).tolist()


def non_finite_rows(logits: torch.Tensor, token_ids: list[int]) -> list[int] | None:
    """The rows that took token 0 whose logits [B, V] are not all finite; None if there are none."""
    rows = [i for i, t in enumerate(token_ids) if t == 0]
    finite = torch.isfinite(logits[rows]).all(dim=-1).tolist()  # logits[rows]: a copy of those rows only
    return [i for i, ok in zip(rows, finite) if not ok] or None
