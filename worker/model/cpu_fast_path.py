"""The CPU fast path: a step through the transformer computed by our C++ kernels (csrc/), built
once per engine from the modules' final weights and chosen once by `choose_fast_path`, which
says why when it declines.

It computes what the modules compute (worker/model/transformer.py is the reference; the tests
hold the two together), with the weights in the kernels' layouts: float projections as packed
panels (float32, or bfloat16 and float16 widened in registers), quantized ones through their own
QuantizedLinear (by the path their plan chose). Activations are float32 whatever the weights.
One call runs every layer of a step (csrc/decoder_layers.cpp) where every projection of the
decoder layers is packed or quantized with our kernels as its path for the step's size (INT8
and INT4 widen their weights in registers there too); otherwise the kernels run one call at a
time, layer by layer, and the quantized projections through their modules. The KV pools may hold
float16 or bfloat16 (`kv_cache_dtype`) as well as float32: the kernels round K/V to the pool's
type as they write it and widen it as they read, so the step computes in float32 either way.

Build it only once the weights are final (after calibration, quantization and placement): it
keeps its own references to them, so later changes to the modules do not reach it, and forward
hooks on the modules do not fire through it (calibration observes the modules, so it runs
without a fast path). Must not know about requests or sockets.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata, paged_attention, prefill_attention
from worker.model.layers import PANEL_DTYPES, Linear
from worker.model.quantization import SMALL_ROWS, QuantizedLinear
from worker.model.transformer import AttentionFn, KVCache, Transformer

# x [M, K] -> x W^T (+ b) [M, N], into `out` when given.
Projection = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class PackedLinear:
    """A float projection through our packed-panel kernel (panels from `pack_panels`)."""

    def __init__(self, kernels, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int):
        self.kernels, self.panels, self.bias, self.out_features = kernels, panels, bias, out_features

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = x.new_empty((x.shape[0], self.out_features))
        self.kernels.linear_packed(x, self.panels, out)
        return out if self.bias is None else out.add_(self.bias)


class ModuleLinear:
    """A projection with no packed form (a QuantizedLinear): its own forward computes it."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward = module.forward  # the module's compute, without nn.Module's call machinery

    def one_call_tensors(self, rows: int) -> list[torch.Tensor | None] | None:
        """(weight, scales, zeros, input scale, bias) for `decoder_layers`, where this layer's
        path for steps of `rows` rows is our kernel, the one the call runs; else None."""
        m = self.module
        if not isinstance(m, QuantizedLinear):
            return None
        if (m.small_path if rows <= SMALL_ROWS else m.path) != "ours" or m.bits not in (8, 4):
            return None
        return [m.kernel_weight(), m.kernel_scales(), m.zeros if m.bits == 4 else None, m.input_scale, m.bias]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and isinstance(self.module, QuantizedLinear):
            return self.module.forward_into(x, out)
        y = self.forward(x)
        return y if out is None else out.copy_(y)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the kernels take them."""

    input_norm: torch.Tensor
    qkv: Projection
    q_norm: torch.Tensor | None  # Qwen3's per-head norms, else None
    k_norm: torch.Tensor | None
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection

    def one_call_tensors(self, rows: int) -> list[torch.Tensor | None] | None:
        """The list `decoder_layers` takes for this layer on steps of `rows` rows, in its order
        (norm, qkv, q norm, k norm, o, norm, gate_up, down; each projection as its weight,
        scales, zeros, input scale and bias; whatever it lacks is None), or None if a projection
        is neither packed nor quantized with our kernel as its path for that size."""
        tensors = [self.input_norm]
        for name in ("qkv", "o", "gate_up", "down"):
            projection = getattr(self, name)
            if isinstance(projection, PackedLinear):
                tensors += [projection.panels, None, None, None, projection.bias]
            elif (quantized := projection.one_call_tensors(rows)) is not None:
                tensors += quantized
            else:
                return None
            if name == "qkv":
                tensors += [self.q_norm, self.k_norm]
            elif name == "o":
                tensors.append(self.post_norm)
        return tensors


def _projection(kernels, module: nn.Module, release: bool) -> Projection:
    if isinstance(module, QuantizedLinear):
        return ModuleLinear(module)
    panels = module.panels()
    if release:
        module.release_float_weight(panels)  # the module and the fast path share one copy
    return PackedLinear(kernels, panels, module.bias, module.out_features)


def kernel_paged_attention(kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           prefill_kernel: bool = True) -> torch.Tensor:
    """`paged_attention` by our kernels: the decodes in one call, then every prompt chunk in one
    call, K/V read in place through the block tables (this step's already written). Without
    `prefill_kernel` (a head_dim it does not take) the chunks run through torch's SDPA."""
    num_decodes = meta.num_decodes
    if num_decodes == q.shape[0]:  # a decode-only step: the kernel's output is all of it
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty(q.shape, dtype=q.dtype)
    if num_decodes:
        out[:num_decodes] = kernels.paged_decode_attention(q[:num_decodes], k_cache, v_cache,
                                                           meta.block_tables[:num_decodes],
                                                           meta.seq_lens[:num_decodes], scale)
    if prefill_kernel:
        kernels.paged_prefill_attention(q[num_decodes:], k_cache, v_cache, meta.block_tables[num_decodes:],
                                        meta.seq_lens[num_decodes:], meta.prefill_query_starts, scale,
                                        out[num_decodes:])
    else:
        prefill_attention(q, k, v, k_cache, v_cache, meta, scale, out)
    return out


class CpuFastPath:
    """`forward` and `compute_logits` with the model's signature (no attention_fn: the fast path
    is the default attention's), computed by our kernels from weights taken once. `one_call =
    False` keeps to the layer-by-layer route even where every projection is packed (tests and
    benchmarks compare the routes)."""

    def __init__(self, model: Transformer, kernels, release_float_weights: bool = True, one_call: bool = True):
        config = model.config
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.intermediate_size = config.q_size, config.intermediate_size
        self.scale, self.eps = config.head_dim ** -0.5, config.rms_norm_eps
        self.embedding = model.embed_tokens.weight  # [V, hidden]
        self.cos, self.sin = model.rotary.cos, model.rotary.sin  # [P, D/2] each
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            has_head_norms = attn.q_norm is not None
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=_projection(kernels, attn.qkv_proj, release_float_weights),
                q_norm=attn.q_norm.weight if has_head_norms else None,
                k_norm=attn.k_norm.weight if has_head_norms else None,
                o=_projection(kernels, attn.o_proj, release_float_weights),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=_projection(kernels, mlp.gate_up_proj, release_float_weights),
                down=_projection(kernels, mlp.down_proj, release_float_weights)))
        self.norm_weight = model.norm.weight
        # A head tied to the embedding keeps the float weight the lookup reads; panels are a copy.
        tied = isinstance(model.lm_head, Linear) and model.lm_head.weight is model.embed_tokens.weight
        self.head = _projection(kernels, model.lm_head, release_float_weights and not tied)
        # For the description: the call itself tells int8-activation layers by their weights' layout.
        self.int8_activations = any(isinstance(m, QuantizedLinear) and m.int8_activations for m in model.modules())
        # Every layer in one call needs every projection packed or quantized with our kernel as
        # its path; a quantized layer may take it for small steps only, its plan having measured
        # torch's kernels faster on large ones.
        self.one_call_tensors = self._all_layers(one_call, SMALL_ROWS)  # steps of up to SMALL_ROWS tokens
        self.one_call_tensors_large = self._all_layers(one_call, SMALL_ROWS + 1)  # larger ones
        self.prefill_kernel = bool(kernels.prefill_attention_supported(config.head_dim))
        # What a step without prompt chunks passes as their starts: the call reads them only for
        # chunks, and building the metadata's own tensor would cost every decode step a conversion.
        self._no_chunk_starts = torch.zeros(1, dtype=torch.int64)

    def _all_layers(self, one_call: bool, rows: int) -> list | None:
        tensors = [layer.one_call_tensors(rows) for layer in self.layers]
        return tensors if one_call and tensors and all(t is not None for t in tensors) else None

    def _one_call_for(self, num_tokens: int) -> list | None:
        return self.one_call_tensors if num_tokens <= SMALL_ROWS else self.one_call_tensors_large

    def describe(self) -> str:
        if self.one_call_tensors_large is not None:
            route = "every decoder layer in one call"
            if self.int8_activations:
                route += " (int8 activations)"
        elif self.one_call_tensors is not None:
            route = (f"every decoder layer in one call for steps of up to {SMALL_ROWS} tokens, layer by layer "
                     f"beyond (quantized projections through their modules)")
        else:
            route = "one kernel call at a time, layer by layer (quantized projections through their modules)"
        if not self.prefill_kernel:
            route += f"; prompt chunks attend through SDPA (the prefill kernel does not take head_dim {self.head_dim})"
        return route

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed)."""
        num_tokens = input_ids.shape[0]
        one_call = self._one_call_for(num_tokens)
        all_decodes = meta.num_decodes == num_tokens
        if one_call is not None and (self.prefill_kernel or all_decodes):
            # The embedding lookup, the rotary tables' rows and the final norm are in the call too.
            chunk_starts = self._no_chunk_starts if all_decodes else meta.prefill_query_starts
            return self.kernels.decoder_layers(
                input_ids, self.embedding, positions, self.cos, self.sin, self.norm_weight, one_call,
                meta.slot_mapping, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.block_tables,
                meta.seq_lens, chunk_starts, meta.num_decodes, self.num_heads, self.num_kv_heads, self.head_dim,
                self.intermediate_size, self.scale, self.eps)
        x = F.embedding(input_ids, self.embedding)  # [T, hidden]
        if x.dtype != torch.float32:  # a half table's rows widened; a float32 one's taken as they are
            x = x.float()
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2] each
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self._layer(layer, x, cos, sin, k_cache, v_cache, meta)
        out = torch.empty_like(x)
        self.kernels.rms_norm(x, self.norm_weight, self.eps, out)
        return out

    def _layer(self, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decoder layer, the modules' order: x [T, hidden] -> the residual stream after it."""
        kernels, num_tokens = self.kernels, x.shape[0]
        normed = torch.empty_like(x)
        kernels.rms_norm(x, w.input_norm, self.eps, normed)
        qkv = w.qkv(normed)  # [T, (H + 2 Hkv) D]
        if w.q_norm is not None:
            kernels.head_rms_norm(qkv, w.q_norm, w.k_norm, self.num_heads, self.num_kv_heads, self.eps)
        # q and k rotated in place inside qkv, then k and v written to their slots.
        kernels.rotary_and_write_kv(qkv, cos, sin, meta.slot_mapping, k_cache, v_cache, self.num_heads)
        q, k, v = qkv.view(num_tokens, -1, self.head_dim).split([self.num_heads, self.num_kv_heads,
                                                                 self.num_kv_heads], dim=1)
        attended = kernel_paged_attention(kernels, q, k, v, k_cache, v_cache, meta, self.scale, self.prefill_kernel)
        residual = w.o(attended.reshape(num_tokens, self.q_size))
        kernels.add_rms_norm(residual, x, w.post_norm, self.eps, normed)  # residual = x + attention
        hidden = torch.empty(num_tokens, self.intermediate_size)
        kernels.silu_and_mul(w.gate_up(normed), hidden)
        return w.down(hidden).add_(residual)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, V], into `out` when the caller keeps a buffer."""
        return self.head(hidden, out)


def choose_fast_path(model: Transformer, attention_fn: AttentionFn = paged_attention,
                     release_float_weights: bool = True) -> tuple[CpuFastPath | None, str]:
    """The CPU fast path for `model`, built now from its final weights, or None where the modules
    must run; and why, for the log. With `release_float_weights`, every float Linear the fast
    path packs then holds only the panels (a head tied to the embedding keeps its weight)."""
    devices = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    if devices != {"cpu"}:
        return None, f"the model is on {', '.join(sorted(devices))}, not only the CPU: the modules run"
    dtype = model.compute_dtype
    if dtype != torch.float32:
        return None, f"the model computes in {dtype}, our kernels in float32: the modules run"
    stored = {m.weight.dtype for m in model.modules() if isinstance(m, Linear) and "weight" in m._parameters}
    if not stored <= set(PANEL_DTYPES):
        return None, f"weights stored in {', '.join(sorted(map(str, stored)))}, which our kernels do not read"
    if attention_fn is not paged_attention:
        return None, f"attention {getattr(attention_fn, '__name__', attention_fn)} asked for: the modules run"
    if model.placement is not None:
        return None, "the layers run through their placement (sharded or on demand): the modules run"
    kernels = cpu_kernels.load()
    if kernels is None:
        return None, ("our CPU kernels are not built (no compiler, or "
                      f"{cpu_kernels.DISABLE_ENV} set): the modules run")
    fast_path = CpuFastPath(model, kernels, release_float_weights)
    return fast_path, f"CPU kernels: {fast_path.describe()}"
