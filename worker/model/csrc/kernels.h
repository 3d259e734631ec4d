// The kernels the extension exports (bindings.cpp), each defined in the file named beside it.
// All float32 on the CPU, but for the KV pools, which may also hold float16 or bfloat16
// (kv_cache_dtype); the Python side (worker/model/cpu_kernels.py) falls back to torch for
// anything else.
#pragma once

// The tensor type alone, its methods included (new_empty, mul, ...): ATen/ATen.h brings every operator's
// declaration into every file's build, and even one operator's header (ATen/ops/empty.h) adds much of it.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

// Float weights as the kernels read them (packed panels, the embedding table): float32, or
// bfloat16 / float16 widened to float32 as they are read.
inline bool is_float_weight(const at::Tensor& weight) {
  return weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16 || weight.dtype() == at::kHalf;
}

// decode_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale);
// The same per layer of a step (decoder_layers.cpp), from raw rows: what every layer shares (the
// task order, checked tables) worked out once by plan_decode_attention, whose tensors must
// outlive the plan.
struct DecodeAttentionPlan {
  const int64_t* tables = nullptr;  // [B, table_width]
  const int64_t* lens = nullptr;    // [B]
  int64_t num_seqs = 0, table_width = 0, splits = 1;
  std::vector<int64_t> order;  // sequences, longest first
};
DecodeAttentionPlan plan_decode_attention(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                          int64_t num_kv_heads);
void decode_attention_layer(const DecodeAttentionPlan& plan, const float* q, int64_t q_seq_stride,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_heads, int64_t head_dim,
                            double scale, float* out);

// prefill_attention.cpp
bool prefill_attention_supported(int64_t head_dim);
void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_starts, double scale, at::Tensor out);

// rotary.cpp
void rotary_and_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                         at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads);
// The same per layer of a step from raw rows, its arguments checked by the caller: token t's
// cos and sin rows are row positions[t] of the [P, D/2] tables (row t where positions is null).
void rotary_and_write_kv_rows(float* qkv, int64_t tokens, const float* cos, const float* sin, const int64_t* positions,
                              const int64_t* slots, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              int64_t num_heads);

// linear.cpp
void linear_packed(at::Tensor x, at::Tensor packed, at::Tensor out);
void linear_small_batch_int8(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor out);
int64_t int8_weight_panel_group();
void linear_small_batch_int4(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros,
                             int64_t group_size, at::Tensor out);
std::string int4_row_kernel(const std::string& choice);
bool int4_weight_tiles_supported(int64_t in_features, int64_t group_size);
bool held_int4_tiles(const at::Tensor& weight);

// linear_int8_activations.cpp
bool int8_activations_supported(int64_t in_features, int64_t group_size);
bool int8_activations_output_major();
at::Tensor int8_activation_group_columns(at::Tensor scales, std::optional<at::Tensor> zeros);
void linear_int8_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor out);
void linear_int4_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor zeros,
                                          int64_t group_size, at::Tensor out);

// pointwise.cpp
at::Tensor argmax_rows(at::Tensor logits);
std::vector<int64_t> finite_choices(at::Tensor logits, at::Tensor tokens);
void rms_norm(at::Tensor x, at::Tensor weight, double eps, at::Tensor out);
void add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps, at::Tensor out);
void silu_and_mul(at::Tensor gate_up, at::Tensor out);
void head_rms_norm(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t num_heads,
                   int64_t num_kv_heads, double eps);

// sampling.cpp
at::Tensor sample_rows(at::Tensor logits, std::vector<double> temperatures, std::vector<int64_t> top_k,
                       std::vector<double> top_p, std::vector<double> min_p, std::vector<double> uniforms);
std::optional<int64_t> repetition_penalty_rows(at::Tensor logits, std::vector<int64_t> rows,
                                               std::vector<std::vector<int64_t>> histories,
                                               std::vector<double> penalties);
std::optional<int64_t> presence_frequency_rows(at::Tensor logits, std::vector<int64_t> rows,
                                               std::vector<std::vector<int64_t>> outputs,
                                               std::vector<double> presence, std::vector<double> frequency);

// decoder_layers.cpp
at::Tensor decoder_layers(at::Tensor input_ids, at::Tensor embedding, at::Tensor positions, at::Tensor cos,
                          at::Tensor sin, at::Tensor final_norm,
                          std::vector<std::vector<std::optional<at::Tensor>>> layers, at::Tensor slot_mapping, std::vector<at::Tensor> k_caches,
                          std::vector<at::Tensor> v_caches, at::Tensor block_tables, at::Tensor seq_lens,
                          at::Tensor query_starts, int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t intermediate_size, double scale, double eps);
