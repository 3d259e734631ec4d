"""Where a sampled row's randomness comes from, and torch's path from a row's logits and its uniform to its
token: the generator the engine keeps for a seeded request, the seed of each output position (token_seed)
and the uniform drawn from it (position_uniform); the filters and the inverse-CDF draw by torch
(sample_rows_torch, draw_by_uniforms), which every device runs but a CPU with our kernels
(worker/model/csrc/sampling.cpp computes the same). Used by the Sampler (worker/sampler.py) and the engine."""
from __future__ import annotations

from typing import Sequence

import torch

from shared.sampling_params import MAX_SEED, SamplingParams
from worker.logits_processors import apply_top_k_top_p_min_p

__all__ = ["draw_by_uniforms", "make_generator", "position_uniform", "sample_rows_torch", "token_seed"]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator the engine keeps for one seeded request, for the request's whole life: a row of it draws
    from it only where the batch gives no seed for the row's position (SamplingBatch.seeds; the engine gives
    one for every seeded row, so its rows draw position_uniform's).

    Only that request draws from it, which is what makes its tokens independent of the rest of the batch."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def token_seed(seed: int, output_index: int) -> int:
    """The seed for a seeded request's output token number `output_index`.

    Deriving each token's randomness from (seed, position) rather than from a generator's
    running state makes a seeded request resumable: a worker that picks it up after another
    worker died, or after a preemption, draws exactly what the first one would have."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed % MAX_SEED


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int) -> float:
    """The uniform in [0, 1) a seeded row draws with, from its position's seed (token_seed): splitmix64's
    finaliser over the seed's bits, the top 53 as the fraction. A function of (seed, output index) alone, so
    it reproduces whatever the batch, the worker or the version of torch, and costs no generator."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def sample_rows_torch(x: torch.Tensor, params: list[SamplingParams], uniforms: Sequence[float]) -> torch.Tensor:
    """Token ids [S] for logits x [S, V] (float, modified in place) by torch on any device: each row's
    temperature, top-k, top-p and min-p (apply_top_k_top_p_min_p's rules), then draw_by_uniforms. Our CPU
    kernel (sample_rows) computes the same."""
    device = x.device
    # Held to float32's normal range: a temperature rounding to 0 or inf would make the row NaN.
    finfo = torch.finfo(torch.float32)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device).clamp_(
        finfo.tiny, finfo.max)  # [S]
    # Shift so each row's max is 0 before dividing: softmax is unchanged, and a tiny temperature then sends
    # the rest to -inf instead of overflowing to inf (inf - inf would be NaN in softmax).
    x.sub_(x.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1))
    top_k = top_p = min_p = None
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
    return draw_by_uniforms(torch.softmax(x, dim=-1), torch.as_tensor(uniforms, dtype=torch.float64, device=device))


def draw_by_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [S] for probabilities [S, V] (rows need not sum to 1) and uniforms [S] in [0, 1): per row the
    first token, in id order, at which the running sum passes u times the row's total. A token of probability
    0 is never taken; where u * total rounds to the total itself, the row's last token with probability is."""
    cumulative = probs.double().cumsum(dim=-1)  # [S, V]
    target = uniforms.unsqueeze(1) * cumulative[:, -1:]  # [S, 1]
    chosen = torch.searchsorted(cumulative, target, right=True).squeeze(1)  # [S], V where nothing passes
    vocab_size = probs.shape[1]
    last = vocab_size - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)  # [S]
    return torch.minimum(chosen, last)
