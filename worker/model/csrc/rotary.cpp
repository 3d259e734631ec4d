// Rotary position embedding applied in place to q and k inside the fused qkv projection, and
// the step's K/V written to their cache slots, in one pass over the tokens (torch takes a
// dozen small ops for the same: four per rotation, two index copies, temporaries). A half pool
// (float16, bfloat16) gets K/V rounded to nearest even, as torch's .to() rounds.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

namespace {

// x [D] in the half-split ("rotate_half") layout of Hugging Face Llama checkpoints:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in place.
inline void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  float* x2 = x + half;
  int64_t i = 0;
#ifdef HAVE_AVX2_FMA
  for (; i + kLanes <= half; i += kLanes) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x2 + i);
    const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    _mm256_storeu_ps(x + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
    _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
  }
#endif
  for (; i < half; ++i) {
    const float a = x[i], b = x2[i];
    x[i] = a * cos[i] - b * sin[i];
    x2[i] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

void rotary_and_write_kv_rows(float* qkv, int64_t tokens, const float* cos, const float* sin, const int64_t* positions,
                              const int64_t* slots, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              int64_t num_heads) {
  const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t half = head_dim / 2, kv_floats = num_kv_heads * head_dim, row = (num_heads + 2 * num_kv_heads) * head_dim;
  with_kv_type(k_cache, v_cache, "rotary_and_write_kv", [&](auto zero) {
    using KV = decltype(zero);
    KV* k_pool = static_cast<KV*>(k_cache.data_ptr());
    KV* v_pool = static_cast<KV*>(v_cache.data_ptr());
    at::parallel_for(0, tokens, grain_for(row), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float* q = qkv + t * row;
        float* k = q + num_heads * head_dim;
        const float* v = k + kv_floats;
        const int64_t table_row = positions ? positions[t] : t;
        const float* c = cos + table_row * half;
        const float* s = sin + table_row * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate(q + h * head_dim, c, s, half);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        store_row(k_pool + slot * kv_floats, k, kv_floats);
        store_row(v_pool + slot * kv_floats, v, kv_floats);
      }
    });
  });
}

// qkv [T, (H + 2 Hkv) D] float32 contiguous (q heads, then k heads, then v heads); cos, sin
// [T, D/2] float32; slot_mapping [T] int64 (a negative slot is not written); k_cache, v_cache
// [N, S, Hkv, D] float32, float16 or bfloat16 (both the same).
void rotary_and_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                         at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat,
              "rotary_and_write_kv: qkv, cos and sin must be float32");
  TORCH_CHECK(qkv.is_contiguous(), "rotary_and_write_kv: qkv must be contiguous");
  check_kv_pools(k_cache, v_cache, "rotary_and_write_kv");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong, "int64 slot mapping");
  cos = cos.contiguous();
  sin = sin.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = qkv.size(0), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && cos.size(0) == tokens &&
              cos.size(-1) == head_dim / 2 && sin.sizes() == cos.sizes() && slot_mapping.size(0) == tokens,
              "qkv [T, (H + 2 Hkv) D], cos and sin [T, D/2], slot_mapping [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " beyond the pool's ", num_slots);
  rotary_and_write_kv_rows(qkv.data_ptr<float>(), tokens, cos.data_ptr<float>(), sin.data_ptr<float>(), nullptr, slots,
                           k_cache, v_cache, num_heads);
}
