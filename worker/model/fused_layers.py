"""The CPU fast path through a step's decoder layers: one call into our kernels
(csrc/decoder_layers.cpp) runs every layer with the kernels the modules themselves would call, in
the same order, without Python between them.

It applies only where the modules would take those kernels anyway: float32 on the CPU, float
weights packed into panels, the default attention, and no hooks on any layer module (calibration and tests observe activations through forward hooks). Anywhere
else `run_fused_layers` returns None and the modules run as before.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_state

from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata
from worker.model.layers import Linear


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    return bool(module_state._global_forward_hooks or module_state._global_forward_pre_hooks)


def _linear_tensors(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if not isinstance(linear, Linear) or _hooked(linear):
        return None
    panels = linear.packed_weight()
    return None if panels is None else (panels, linear._parameters["bias"])


def layer_tensors(layer: nn.Module) -> list[torch.Tensor | None] | None:
    """The tensors `decoder_layers` takes for one layer, in its order (norm, qkv, qkv bias, q norm,
    k norm, o, o bias, norm, gate_up, gate_up bias, down, down bias; a missing bias or q/k norm is
    None), or None if the layer cannot take it."""
    # Submodules straight from `_modules`: this runs for every layer on every step, and
    # nn.Module.__getattr__ costs a microsecond a lookup.
    modules = layer._modules
    attn, mlp = modules["self_attn"], modules["mlp"]
    input_norm, post_norm = modules["input_layernorm"], modules["post_attention_layernorm"]
    q_norm, k_norm = attn.q_norm, attn.k_norm
    head_norms = (q_norm, k_norm) if q_norm is not None else ()
    if any(map(_hooked, (layer, attn, mlp, input_norm, post_norm, *head_norms))):
        return None
    tensors: list[torch.Tensor | None] = [input_norm._parameters["weight"]]
    if (pair := _linear_tensors(attn._modules["qkv_proj"])) is None:
        return None
    tensors.extend(pair)
    tensors.extend([norm._parameters["weight"] for norm in head_norms] or [None, None])
    if (pair := _linear_tensors(attn._modules["o_proj"])) is None:
        return None
    tensors.extend(pair)
    tensors.append(post_norm._parameters["weight"])
    for linear in (mlp._modules["gate_up_proj"], mlp._modules["down_proj"]):
        if (pair := _linear_tensors(linear)) is None:
            return None
        tensors.extend(pair)
    return tensors


def run_fused_layers(layers: nn.ModuleList, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> torch.Tensor | None:
    """x [T, hidden] through every layer (x itself is overwritten): the residual stream after
    the last layer, before the final norm; or None where the modules must run instead."""
    if not layers or _global_hooks():
        return None
    k_caches = [k for k, _ in kv_caches]
    v_caches = [v for _, v in kv_caches]
    kernels = cpu_kernels.for_tensors(x, *k_caches, *v_caches)
    if kernels is None or not x.is_contiguous():
        return None
    first = layers[0].self_attn
    num_decodes = meta.num_decodes
    if num_decodes < x.shape[0] and not kernels.prefill_attention_supported(first.head_dim):
        return None
    tensors = []
    for layer in layers:
        if (one := layer_tensors(layer)) is None:
            return None
        tensors.append(one)
    cos, sin = rope
    return kernels.decoder_layers(x, tensors, cos.squeeze(1), sin.squeeze(1), meta.slot_mapping, k_caches, v_caches,
                                  meta.block_tables, meta.seq_lens, meta.prefill_query_starts, num_decodes,
                                  first.num_heads, first.num_kv_heads, first.head_dim,
                                  layers[0].mlp.intermediate_size, first.scale, layers[0].input_layernorm.eps)
