// The kernels the extension exports (bindings.cpp), each defined in the file named beside it.
// All float32 on the CPU, but for the KV pools, which may also hold float16 or bfloat16
// (kv_cache_dtype); the Python side (worker/model/cpu_kernels.py) falls back to torch for
// anything else.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// decode_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale);

// prefill_attention.cpp
bool prefill_attention_supported(int64_t head_dim);
void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_starts, double scale, at::Tensor out);

// rotary.cpp
void rotary_and_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                         at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads);

// linear.cpp
void linear_packed(at::Tensor x, at::Tensor packed, at::Tensor out);
void linear_small_batch_int8(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor out);
void linear_small_batch_int4(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros,
                             int64_t group_size, at::Tensor out);

// linear_int8_activations.cpp
bool int8_activations_supported(int64_t in_features, int64_t group_size);
void linear_int8_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor out);
void linear_int4_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor zeros,
                                          int64_t group_size, at::Tensor out);

// pointwise.cpp
at::Tensor argmax_rows(at::Tensor logits);
void rms_norm(at::Tensor x, at::Tensor weight, double eps, at::Tensor out);
void add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps, at::Tensor out);
void silu_and_mul(at::Tensor gate_up, at::Tensor out);
void head_rms_norm(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t num_heads,
                   int64_t num_kv_heads, double eps);

// decoder_layers.cpp
at::Tensor decoder_layers(at::Tensor x, std::vector<std::vector<std::optional<at::Tensor>>> layers, at::Tensor cos,
                          at::Tensor sin, at::Tensor slot_mapping, std::vector<at::Tensor> k_caches,
                          std::vector<at::Tensor> v_caches, at::Tensor block_tables, at::Tensor seq_lens,
                          at::Tensor query_starts, int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t intermediate_size, double scale, double eps);
