"""The decoder-only transformer (Llama, Qwen2, Qwen3) over packed tokens and a paged KV cache.

Reads top to bottom like the paper, in plain torch: the reference the tests trust, which the
CPU fast path (worker/model/cpu_fast_path.py) computes again with our kernels. Takes token ids,
positions, the KV pools and one AttentionMetadata per step; returns hidden states. Knows
nothing of requests or sockets.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from worker.model.attention import AttentionMetadata, paged_attention, write_kv
from worker.model.config import ModelConfig
from worker.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: K and V pools, each [N, S, Hkv, D]
AttentionFn = Callable[..., torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions, each [T, 1, D/2]


class LayerPlacement(Protocol):
    """Runs the decoder layers over x [T, hidden] when they do not all sit on one device."""

    layer_devices: list[torch.device]

    def run_layers(self, layers: nn.ModuleList, x: torch.Tensor, rope: Rope, kv_caches: list[KVCache],
                   meta: AttentionMetadata, attention_fn: AttentionFn) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        # q, k and v fused into one matmul; the loader concatenates the checkpoint's three.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                attention_fn: AttentionFn) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        cos, sin = rope
        if self.q_norm is None:
            # q and k sit side by side in qkv: rotate both with one pass.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                           self.head_dim)
            q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            q = apply_rotary(self.q_norm(q), cos, sin)
            k = apply_rotary(self.k_norm(k), cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = attention_fn(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x, rope, kv_cache, meta, attention_fn):
        # The sublayers' outputs are fresh tensors, so the residual adds go into them in place
        # (the caller's x is left as it was).
        residual = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, attention_fn)
        normed = self.post_attention_layernorm.add_then_norm(residual, x)  # residual = x + attention
        return self.mlp(normed).add_(residual)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        max_positions = max_positions or config.max_position_embeddings
        # One rotary table for every layer.
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # How the decoder layers run when not all on one device (worker/model/placement.py:
        # sharded stages, or on-demand copies from host memory); None runs them where they are.
        self.placement: LayerPlacement | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so. Call again
        after anything that re-creates parameters (e.g. `to_empty`), which unties them."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # a quantized head stands alone
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, attention_fn: AttentionFn = paged_attention) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(input_ids).to(self.compute_dtype)
        rope = self.rotary(positions)
        if self.placement is not None:
            x = self.placement.run_layers(self.layers, x, rope, kv_caches, meta, attention_fn)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(x, rope, kv_cache, meta, attention_fn)
        return self.norm(x)

    def store_weights_in(self, dtype: torch.dtype) -> None:
        """Hold the embedding and every float projection's weight (the head's too) in `dtype`,
        leaving norms, biases and the activations in the dtype the model was built in: bfloat16 or
        float16 weights on the CPU, read as such and widened to float32 where they are used. Call before
        the weights are materialized or loaded (the loader copies into each parameter's dtype)."""
        for module in [self.embed_tokens, *(m for m in self.modules() if isinstance(m, Linear))]:
            module.weight.data = module.weight.data.to(dtype)
        self.tie_weights()

    @property
    def compute_dtype(self) -> torch.dtype:
        """What activations, logits and the KV cache are computed in (the final norm is held in
        it whatever the weights are stored in)."""
        return self.norm.weight.dtype

    @property
    def input_device(self) -> torch.device:
        """Where token ids and positions go in."""
        return self.embed_tokens.weight.device

    @property
    def output_device(self) -> torch.device:
        """Where final hidden states and logits come out (the final norm sits with the head)."""
        return self.norm.weight.device

    @property
    def layer_devices(self) -> list[torch.device]:
        """Where each layer computes, so where its KV pools must be."""
        if self.placement is not None:
            return list(self.placement.layer_devices)
        return [layer.input_layernorm.weight.device for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, hidden] (only the positions we sample from) -> logits [B, V], into
        `out` when the caller keeps a buffer."""
        if isinstance(self.lm_head, Linear):
            return self.lm_head(hidden, out=out)  # through the module: forward hooks see the head's input
        logits = self.lm_head(hidden)  # a quantized head (an opt-in `head` rule)
        return logits if out is None else out.copy_(logits)
