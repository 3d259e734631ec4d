"""Teacher-forced scoring with our own transformer: the log-likelihood of known text.

Owns perplexity as the engine computes it. The text runs through the engine's model in
prompt chunks over a paged KV cache of its own (the chunked-prefill path the runner
drives), and the logits of every position are kept instead of only the last one.
Long texts are cut into windows no longer than the model's context; each window is
scored from scratch, as transformers scores one forward call. The modules compute (forward
hooks see them: calibration records through this), or the CPU fast path when one is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from worker.kv_cache import allocate_kv_cache, resolve_kv_cache_dtype
from worker.model.attention import AttentionMetadata, paged_attention
from worker.model.cpu_fast_path import CpuFastPath
from worker.model.transformer import AttentionFn, Transformer


@dataclass(frozen=True)
class Score:
    nll: float  # summed negative log-likelihood, nats
    num_predicted: int  # tokens that had a prediction (each window's first has none)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.num_predicted)


@torch.inference_mode()
def window_logits(model: Transformer, token_ids: Sequence[int], *, block_size: int = 16, chunk_size: int = 128,
                  attention_fn: AttentionFn = paged_attention, fast_path: CpuFastPath | None = None,
                  kv_cache_dtype: str = "") -> torch.Tensor:
    """Logits [L, V] (float32) of the next token after each of token_ids' L positions, the whole
    window as one sequence, over a KV cache of `kv_cache_dtype` (as EngineConfig names it)."""
    device = model.input_device
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model.compute_dtype)
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, dtype, model.layer_devices)
    # Reversed, so the attention has to follow the table rather than luck into identity.
    table = list(reversed(range(num_blocks)))
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    rows = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        positions = torch.arange(start, end, device=device)
        meta = AttentionMetadata.build([table], [start], [end - start], block_size, device)
        if fast_path is not None:
            hidden = fast_path.forward(ids[start:end], positions, kv_caches, meta)  # [T, hidden]
            logits = fast_path.compute_logits(hidden)
        else:
            hidden = model(ids[start:end], positions, kv_caches, meta, attention_fn)
            logits = model.compute_logits(hidden)  # [T, V]
        rows.append(logits.float().to(device))
    return torch.cat(rows)


@torch.inference_mode()
def window_logprobs(model: Transformer, token_ids: Sequence[int], *, block_size: int = 16, chunk_size: int = 128,
                    attention_fn: AttentionFn = paged_attention, fast_path: CpuFastPath | None = None,
                    kv_cache_dtype: str = "") -> torch.Tensor:
    """Log-probabilities [L, V] (float32) of the next token after each of token_ids' L
    positions, the whole window as one sequence."""
    return window_logits(model, token_ids, block_size=block_size, chunk_size=chunk_size, attention_fn=attention_fn,
                         fast_path=fast_path, kv_cache_dtype=kv_cache_dtype).log_softmax(dim=-1)


def window_nll(model: Transformer, token_ids: Sequence[int], *, block_size: int = 16, chunk_size: int = 128,
               attention_fn: AttentionFn = paged_attention, fast_path: CpuFastPath | None = None) -> Score:
    """NLL of token_ids[1:] given their prefixes, the whole window as one sequence."""
    # Row i predicts token i + 1; the last row predicts past the window.
    logprobs = window_logprobs(model, token_ids, block_size=block_size, chunk_size=chunk_size,
                               attention_fn=attention_fn, fast_path=fast_path)[:-1]  # [L - 1, V]
    num_tokens = len(token_ids)
    targets = torch.tensor(list(token_ids[1:]), dtype=torch.int64, device=logprobs.device).unsqueeze(1)  # [L - 1, 1]
    nll = -logprobs.gather(1, targets).sum().item()
    return Score(nll, num_tokens - 1)


def score(model: Transformer, token_ids: Sequence[int], *, window: int, block_size: int = 16,
          chunk_size: int = 128, attention_fn: AttentionFn = paged_attention,
          fast_path: CpuFastPath | None = None) -> Score:
    """Sum of `window_nll` over consecutive windows of at most `window` tokens."""
    if window > model.config.max_position_embeddings:
        raise ValueError(f"window {window} exceeds max_position_embeddings {model.config.max_position_embeddings}")
    nll, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        piece = token_ids[start:start + window]
        if len(piece) < 2:
            continue
        part = window_nll(model, piece, block_size=block_size, chunk_size=chunk_size, attention_fn=attention_fn,
                          fast_path=fast_path)
        nll, count = nll + part.nll, count + part.num_predicted
    if count == 0:
        raise ValueError("nothing to score: every window is shorter than 2 tokens")
    return Score(nll, count)
