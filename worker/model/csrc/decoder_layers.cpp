// A step's model up to the head in one call: the embedding lookup, every decoder layer and the
// final norm, the kernels the CPU fast path's layer-by-layer route runs
// (worker/model/cpu_fast_path.py), in the same order, the modules' order
// (worker/model/transformer.py), without the Python between them. On a decode step the Python
// dispatch between about a hundred small calls for a model's layers is a large share of the
// step (docs/benchmarks.md); here it is a few C++ calls per layer. Inside the layer loop the
// rotary embedding and decode attention take raw rows, their arguments checked once per call: a
// tensor op there pays for the caches the weights just streamed through. Qwen3's per-head q/k norms
// run in place in qkv, before the rotary embedding. A projection is a float one (packed panels,
// float32, bfloat16 or float16) or a quantized one (INT8 per channel, INT4 per group), told apart by its
// weight's dtype and layout, each through the kernel its layer-by-layer route takes: weight-only
// (linear.cpp) for row-major weights and INT8's panels, int8 activations for their
// own panels (linear_int8_activations.cpp).
#include "kernels.h"
#include "vector_math.h"

#include <optional>
#include <vector>

namespace {

// Per projection, in the order the Python side lists them (LayerWeights.one_call_tensors): the
// weight (float32, bfloat16 or float16 panels; int8 [N, K], [P, K, 16] panels or [G, K, 2, 16] grouped
// ones, uint8 [N, K/2], or either as int8-activation panels, 3-D [T, U, 64] or 4-D [P, U, 16,
// 64]), its scales and zeros (quantized
// only; zeros INT4 only), the input scale x is multiplied by first (quantized only, optional)
// and the bias (optional).
enum ProjectionTensor { kWeight, kScales, kZeros, kInputScale, kBias, kNumProjectionTensors };
// Per layer: the projections' slots start at these offsets.
enum LayerTensor {
  kInputNorm = 0,
  kQkv = 1,
  kQNorm = kQkv + kNumProjectionTensors,
  kKNorm,
  kOut,
  kPostNorm = kOut + kNumProjectionTensors,
  kGateUp,
  kDown = kGateUp + kNumProjectionTensors,
  kNumLayerTensors = kDown + kNumProjectionTensors
};

using LayerTensors = std::vector<std::optional<at::Tensor>>;

bool valid_projection(const LayerTensors& layer, int first) {
  const auto& weight = layer[first + kWeight];
  if (!weight) return false;
  if (is_float_weight(*weight))
    return !layer[first + kScales] && !layer[first + kInputScale];
  if (weight->dtype() == at::kChar) return layer[first + kScales].has_value() && !layer[first + kZeros];
  if (weight->dtype() == at::kByte) return layer[first + kScales].has_value() && layer[first + kZeros].has_value();
  return false;
}

// out [T, N] = x @ W^T (+ bias), by the projection's kind; a quantized weight held as
// int8-activation panels quantizes x per 32-block first.
void project(const at::Tensor& x, const LayerTensors& layer, int first, at::Tensor out) {
  const at::Tensor& weight = *layer[first + kWeight];
  if (is_float_weight(weight)) {
    linear_packed(x, weight, out);
  } else {
    const auto& input_scale = layer[first + kInputScale];
    const at::Tensor input = input_scale ? x.mul(*input_scale) : x.contiguous();
    const at::Tensor& scales = *layer[first + kScales];
    // Weight-only INT8 panels ([P, K, 16] or grouped [G, K, 2, 16]) end in one panel's 16
    // outputs, held INT4 tiles in a group's rows and columns; the int8-activation layouts' last
    // dimension is a 64-byte unit.
    const bool weight_only_panels = weight.dim() > 2 && (weight.size(-1) == 16 || held_int4_tiles(weight));
    const bool int8_activations = weight.dim() > 2 && !weight_only_panels;
    if (weight.dtype() == at::kChar) {
      if (int8_activations)
        linear_int8_weights_int8_activations(input, weight, scales, out);
      else
        linear_small_batch_int8(input, weight, scales, out);
    } else {
      const int64_t group_size = input.size(1) / scales.size(1);
      if (int8_activations)
        linear_int4_weights_int8_activations(input, weight, scales, *layer[first + kZeros], group_size, out);
      else
        linear_small_batch_int4(input, weight, scales, *layer[first + kZeros], group_size, out);
    }
  }
  if (const auto& bias = layer[first + kBias]) out.add_(*bias);
}

// Row ids[t] of the [V, hidden] table, widened to float32 where it is bfloat16 or float16.
at::Tensor embed(const at::Tensor& input_ids, const at::Tensor& embedding) {
  TORCH_CHECK(input_ids.dtype() == at::kLong && input_ids.dim() == 1 && input_ids.is_contiguous(),
              "input_ids: contiguous int64 [T]");
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() && is_float_weight(embedding),
              "embedding: a contiguous float32, bfloat16 or float16 [V, hidden] table");
  const int64_t tokens = input_ids.size(0), vocab = embedding.size(0), hidden = embedding.size(1);
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  at::Tensor x = embedding.new_empty({tokens, hidden}, at::kFloat);
  float* out = x.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " outside the vocabulary of ", vocab);
  auto copy_rows = [&](auto zero) {
    using T = decltype(zero);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = embedding.data_ptr<T>() + ids[t] * hidden;
      for (int64_t i = 0; i < hidden; ++i) out[t * hidden + i] = static_cast<float>(row[i]);
    }
  };
  if (embedding.dtype() == at::kFloat)
    copy_rows(float{});
  else if (embedding.dtype() == at::kBFloat16)
    copy_rows(c10::BFloat16{});
  else
    copy_rows(c10::Half{});
  return x;
}

}  // namespace

at::Tensor decoder_layers(at::Tensor input_ids, at::Tensor embedding, at::Tensor positions, at::Tensor cos,
                          at::Tensor sin, at::Tensor final_norm, std::vector<LayerTensors> layers,
                          at::Tensor slot_mapping, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                          at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_starts, int64_t num_decodes,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                          double scale, double eps) {
  const int64_t num_layers = static_cast<int64_t>(layers.size());
  TORCH_CHECK(num_layers >= 1, "at least one layer");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers && static_cast<int64_t>(v_caches.size()) == num_layers,
              "one K and one V pool per layer");
  for (const auto& layer : layers)
    TORCH_CHECK(layer.size() == kNumLayerTensors && layer[kInputNorm] && layer[kPostNorm] &&
                valid_projection(layer, kQkv) && valid_projection(layer, kOut) && valid_projection(layer, kGateUp) &&
                valid_projection(layer, kDown) && layer[kQNorm].has_value() == layer[kKNorm].has_value(),
                "each layer lists its ", kNumLayerTensors, " tensors: float projections as panels, quantized ones "
                "with their scales (and INT4 zeros); biases, input scales, and q/k norms together, may be None");
  // Everything the per-layer kernels read from raw pointers is checked here, once per step.
  at::Tensor residual = embed(input_ids, embedding);
  const int64_t tokens = residual.size(0), hidden = residual.size(1);
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= tokens, "num_decodes within the step's tokens");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() && positions.numel() == tokens &&
              slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "positions and slot_mapping: contiguous int64 [T]");
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.dim() == 2 && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(),
              "cos and sin: contiguous float32 [P, head_dim / 2] tables");
  const int64_t* position_ids = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(position_ids[t] >= 0 && position_ids[t] < cos.size(0), "position ", position_ids[t],
                " outside the rotary tables' ", cos.size(0));
  for (int64_t l = 0; l < num_layers; ++l) {
    check_kv_pools(k_caches[l], v_caches[l], "decoder_layers");
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].size(2) == num_kv_heads && k_caches[l].size(3) == head_dim &&
                v_caches[l].sizes() == k_caches[l].sizes(), "K/V pools [N, S, Hkv, D]");
    const int64_t num_slots = k_caches[l].size(0) * k_caches[l].size(1);
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " beyond the pool's ", num_slots);
  }
  const int64_t q_size = num_heads * head_dim;
  const int64_t qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
  // One set of scratch for the whole call; every layer writes each before it reads it.
  at::Tensor normed = residual.new_empty({tokens, hidden});
  at::Tensor qkv = residual.new_empty({tokens, qkv_size});
  at::Tensor attention = residual.new_empty({tokens, num_heads, head_dim});
  at::Tensor gate_up = residual.new_empty({tokens, 2 * intermediate_size});
  at::Tensor activation = residual.new_empty({tokens, intermediate_size});
  // The residual stream alternates between two buffers: a sublayer's output becomes the stream
  // once the old stream is added into it (add_rms_norm adds in place), so nothing is copied.
  at::Tensor spare = residual.new_empty({tokens, hidden});
  const at::Tensor q = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim}).narrow(1, 0, num_heads);
  const at::Tensor attended = attention.view({tokens, q_size});
  const bool all_decodes = num_decodes == tokens;
  // The plan points into these: they live as long as it.
  const at::Tensor decode_tables = block_tables.narrow(0, 0, num_decodes).contiguous();
  const at::Tensor decode_lens = seq_lens.narrow(0, 0, num_decodes).contiguous();
  const DecodeAttentionPlan decodes = plan_decode_attention(decode_tables, decode_lens, num_kv_heads);
  const int64_t num_seqs = block_tables.size(0);

  rms_norm(residual, *layers[0][kInputNorm], eps, normed);
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerTensors& layer = layers[l];
    project(normed, layer, kQkv, qkv);
    if (layer[kQNorm]) head_rms_norm(qkv, *layer[kQNorm], *layer[kKNorm], num_heads, num_kv_heads, eps);
    rotary_and_write_kv_rows(qkv.data_ptr<float>(), tokens, cos.data_ptr<float>(), sin.data_ptr<float>(), position_ids,
                             slots, k_caches[l], v_caches[l], num_heads);
    if (num_decodes > 0)
      decode_attention_layer(decodes, qkv.data_ptr<float>(), qkv_size, k_caches[l], v_caches[l], num_heads, head_dim,
                             scale, attention.data_ptr<float>());
    if (!all_decodes)
      paged_prefill_attention(q.narrow(0, num_decodes, tokens - num_decodes), k_caches[l], v_caches[l],
                              block_tables.narrow(0, num_decodes, num_seqs - num_decodes),
                              seq_lens.narrow(0, num_decodes, num_seqs - num_decodes), query_starts, scale,
                              attention.narrow(0, num_decodes, tokens - num_decodes));
    project(attended, layer, kOut, spare);
    add_rms_norm(spare, residual, *layer[kPostNorm], eps, normed);  // spare = residual + attention
    std::swap(residual, spare);
    project(normed, layer, kGateUp, gate_up);
    silu_and_mul(gate_up, activation);
    project(activation, layer, kDown, spare);
    // spare = residual + mlp, normed for the next layer or, after the last, by the final norm.
    add_rms_norm(spare, residual, l + 1 < num_layers ? *layers[l + 1][kInputNorm] : final_norm, eps, normed);
    std::swap(residual, spare);
  }
  return normed;
}
