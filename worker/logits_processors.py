"""Per-request edits of a step's logits [B, V] that depend on a request's own tokens or settings: logit bias,
repetition / presence / frequency penalties, and min_tokens' ban on stopping. Each works IN PLACE on the rows
it is given and leaves every other row bit-identical; the Sampler decides which rows from the Python params,
so a batch where no row uses one costs nothing. Also the sampled rows' top-k / top-p / min-p filters. No
randomness (sampler.py)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "apply_logit_bias",
    "apply_min_tokens",
    "apply_presence_frequency_penalties",
    "apply_repetition_penalty",
    "apply_top_k_top_p_min_p",
]


def _flatten(
    token_lists: Sequence[Sequence[int]], labels: Sequence[int], vocab_size: int, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels[i], token) for every token of token_lists[i], as flat CPU tensors [N], [N]. ValueError naming
    `what` for an id outside [0, vocab_size), which would otherwise index out of range (or wrap, if negative)."""
    tokens = [torch.as_tensor(t, dtype=torch.long).reshape(-1).cpu() for t in token_lists]
    if not tokens:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    token_ids = torch.cat(tokens)  # [N]
    if token_ids.numel():
        lowest, highest = int(token_ids.min()), int(token_ids.max())
        if lowest < 0 or highest >= vocab_size:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")
    labels_flat = torch.cat([torch.full((len(t),), label, dtype=torch.long) for label, t in zip(labels, tokens)])
    return labels_flat, token_ids


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]], rows: Sequence[int] | None = None
) -> torch.Tensor:
    """Add each row's (token id, bias) pairs to its logits [B, V], IN PLACE; returns `logits`.

    `biases` has one entry per row (SamplingParams.logit_bias: each id at most once); `rows`, when given,
    lists the rows with a non-empty one. A token id >= V is a ValueError: the gateway bounds ids by the
    vocabulary, so reaching here with one is a bug to report, not a token to skip."""
    num_rows, vocab_size = logits.shape
    if len(biases) != num_rows:
        raise ValueError(f"need one logit_bias per row: {num_rows} rows, {len(biases)} entries")
    if rows is None:
        rows = [i for i, b in enumerate(biases) if b]
    if not rows:
        return logits
    row_ids, token_ids = _flatten([[t for t, _ in biases[r]] for r in rows], rows, vocab_size, "logit_bias")
    values = torch.tensor([float(b) for r in rows for _, b in biases[r]], dtype=logits.dtype)  # [N]
    device = logits.device
    # accumulate=True: a value added where it lands, as "bias" means, even if a caller repeated an id.
    logits.index_put_((row_ids.to(device), token_ids.to(device)), values.to(device), accumulate=True)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor,
    token_histories: Sequence[Sequence[int]],
    penalties: Sequence[float],
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """HF/CTRL repetition penalty, IN PLACE on logits [B, V]; returns `logits`.

    For each distinct token id in row b's history, logit l becomes l / p if l > 0 else l * p (p = penalties[b]),
    so a penalty > 1 always makes a seen token less likely. Rows with p == 1 are untouched and their history is
    not read; `rows`, when given, lists the rows with p != 1 so the caller's scan is not repeated."""
    num_rows, vocab_size = logits.shape
    if len(token_histories) != num_rows or len(penalties) != num_rows:
        raise ValueError(
            f"need one history and one penalty per row: {num_rows} rows, "
            f"{len(token_histories)} histories, {len(penalties)} penalties"
        )
    if rows is None:
        rows = [i for i, p in enumerate(penalties) if p != 1.0]
    if not rows:
        return logits
    row_ids, token_ids = _flatten([token_histories[r] for r in rows], rows, vocab_size, "token history")
    if token_ids.numel() == 0:
        return logits
    # A boolean mask makes a token repeated in the history count once, as "distinct tokens" requires.
    seen = torch.zeros((num_rows, vocab_size), dtype=torch.bool)  # [B, V]
    seen[row_ids, token_ids] = True
    seen = seen.to(logits.device)
    penalty = torch.tensor([float(p) for p in penalties], dtype=torch.float32)  # [B]
    penalty = penalty.to(device=logits.device, dtype=logits.dtype).unsqueeze(1)  # [B, 1]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
    logits.copy_(torch.where(seen, penalised, logits))
    return logits


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    output_token_ids: Sequence[Sequence[int]],
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """OpenAI's penalties, IN PLACE on logits [B, V]; returns `logits`:
    logit[t] -= presence * (count[t] > 0) + frequency * count[t], count[t] being how often t occurs in the row's
    GENERATED tokens (the prompt is not counted: vLLM's and OpenAI's rule). `rows`, when given, lists the rows
    with a non-zero penalty; only their outputs are read, and counts are built for them alone ([R, V])."""
    num_rows, vocab_size = logits.shape
    if not len(output_token_ids) == len(presence_penalties) == len(frequency_penalties) == num_rows:
        raise ValueError(
            f"need one output history and two penalties per row: {num_rows} rows, {len(output_token_ids)} "
            f"histories, {len(presence_penalties)} presence and {len(frequency_penalties)} frequency penalties"
        )
    if rows is None:
        rows = [i for i in range(num_rows) if presence_penalties[i] or frequency_penalties[i]]
    if not rows:
        return logits
    # Counts are indexed by position in `rows`, so a batch of many rows and few penalised ones stays small.
    local_ids, token_ids = _flatten([output_token_ids[r] for r in rows], range(len(rows)), vocab_size,
                                    "output history")
    device, dtype = logits.device, logits.dtype
    counts = torch.zeros((len(rows), vocab_size), dtype=dtype, device=device)  # [R, V]
    counts.index_put_((local_ids.to(device), token_ids.to(device)),
                      torch.ones(token_ids.numel(), dtype=dtype, device=device), accumulate=True)
    presence = torch.tensor([float(presence_penalties[r]) for r in rows], dtype=dtype, device=device)  # [R]
    frequency = torch.tensor([float(frequency_penalties[r]) for r in rows], dtype=dtype, device=device)  # [R]
    penalty = presence.unsqueeze(1) * (counts > 0).to(dtype) + frequency.unsqueeze(1) * counts  # [R, V]
    row_index = torch.tensor(list(rows), dtype=torch.long, device=device)  # [R]
    # Adding the negation is exact, so each entry is exactly logit - penalty.
    logits.index_add_(0, row_index, penalty.neg_())
    return logits


def apply_min_tokens(
    logits: torch.Tensor, blocked_token_ids: Sequence[Sequence[int]], rows: Sequence[int]
) -> torch.Tensor:
    """Set blocked_token_ids[r] of each row r in `rows` to -inf, IN PLACE; returns `logits`.

    For a request still under its min_tokens: its EOS ids and stop_token_ids, so it cannot stop on them. Ids
    outside the vocabulary are skipped: a token the model cannot produce needs no ban."""
    num_rows, vocab_size = logits.shape
    if len(blocked_token_ids) != num_rows:
        raise ValueError(f"need one blocked-id list per row: {num_rows} rows, {len(blocked_token_ids)} lists")
    in_vocab = [[t for t in blocked_token_ids[r] if 0 <= t < vocab_size] for r in rows]
    row_ids = [r for r, ids in zip(rows, in_vocab) for _ in ids]
    token_ids = [t for ids in in_vocab for t in ids]
    if not token_ids:
        return logits
    device = logits.device
    index = (torch.tensor(row_ids, dtype=torch.long, device=device),
             torch.tensor(token_ids, dtype=torch.long, device=device))
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set the logits of tokens removed by top-k, then top-p, then min-p to -inf, IN PLACE; returns `logits`.

    logits [B, V] float (already temperature-scaled). Each of top_k [B] int (0 = off), top_p [B] float (1 = off),
    min_p [B] float (0 = off) may be None, meaning no row uses that filter: its work is skipped entirely (the
    Sampler decides this from the Python params, so the common case costs no device sync). Rows with a filter
    off are left untouched by it.
    - top-k keeps every token whose logit is >= the k-th largest logit of the row: ties AT the boundary are all
      kept (HF's rule), so the kept set never depends on sort order. k >= V keeps everything.
    - top-p keeps the smallest set of most probable tokens whose cumulative probability reaches top_p (at least
      one token), with probabilities taken after top-k. Among equal probabilities, lower token ids come first.
    - min-p keeps tokens with p >= min_p * max(p), p being the softmax after top-k and top-p.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [B, V], got shape {tuple(logits.shape)} {logits.dtype}")
    num_rows, vocab_size = logits.shape
    for name, t in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if t is not None and tuple(t.shape) != (num_rows,):
            raise ValueError(f"{name} must have shape [{num_rows}] (one value per row), got {tuple(t.shape)}")
    if top_k is not None and top_k.is_floating_point():
        raise ValueError(f"top_k must be an integer tensor, got {top_k.dtype}")

    neg_inf = float("-inf")
    if top_p is not None:
        # Top-p needs the full descending order anyway, so top-k is done on the same sorted copy.
        # stable=True: equal logits keep ascending token-id order, so top-p ties resolve deterministically.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [B, V], [B, V]
        if top_k is not None:
            _mask_below_kth(sorted_logits, sorted_logits, top_k)
        probs = torch.softmax(sorted_logits.float(), dim=-1)  # [B, V]
        cumulative = probs.cumsum(dim=-1)  # [B, V]
        # Token i is removed when the tokens before it already reach top_p; column 0 is always kept.
        remove = torch.zeros_like(cumulative, dtype=torch.bool)  # [B, V]
        remove[:, 1:] = cumulative[:, :-1] >= top_p.to(cumulative.dtype).unsqueeze(1)
        # top_p == 1 must keep everything, even where float cumsum rounds up to 1 before the last token.
        remove &= (top_p < 1).unsqueeze(1)
        sorted_logits.masked_fill_(remove, neg_inf)
        # Sorted values are original values or -inf, so scattering them back is exact.
        logits.scatter_(1, order, sorted_logits)
    elif top_k is not None:
        # No top-p: a partial top-k over the largest requested k is enough to find each row's threshold.
        max_k = min(int(top_k.max().item()), vocab_size)
        if max_k > 0:
            top_values = torch.topk(logits, max_k, dim=-1, sorted=True).values  # [B, max_k]
            _mask_below_kth(logits, top_values, top_k)

    if min_p is not None:
        # Computed in the original order (not on the sorted copy) so the result does not depend on which other
        # filters the batch happens to use.
        probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
        threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits.masked_fill_(probs < threshold, neg_inf)
    return logits


def _mask_below_kth(target: torch.Tensor, descending_values: torch.Tensor, top_k: torch.Tensor) -> None:
    """Set target entries below each row's k-th largest value to -inf, in place; rows with k == 0 untouched.

    descending_values [B, W] holds each row's W largest values in descending order (W >= every k in use,
    or W == V); k is clamped to W."""
    width = descending_values.shape[1]
    k = top_k.to(device=descending_values.device, dtype=torch.long)
    kth_index = k.clamp(min=1, max=width).sub(1).unsqueeze(1)  # [B, 1]
    kth_value = descending_values.gather(1, kth_index)  # [B, 1]
    # Disabled rows get a -inf threshold, which removes nothing.
    kth_value = kth_value.masked_fill((k == 0).unsqueeze(1), float("-inf"))
    target.masked_fill_(target < kth_value, float("-inf"))
