// Sampling's share of a step on the CPU: the repetition, presence and frequency penalties, and
// each sampled row's draw from its temperature-scaled, top-k / top-p / min-p filtered
// distribution. Torch spends far more on these per vocabulary-sized row than the model's step on
// a small model (a full stable sort for top-p, a random value per token for the draw, [B, V]
// masks and counts for the penalties), and the cost grows with the vocabulary
// (docs/benchmarks.md, "Sampling").
//
// The rules are worker/logits_processors.py's and worker/sampler.py's (the torch path every
// other device runs), computed in one pass a step: s = (logit - max) / T as torch rounds it;
// top-k keeps s >= the k-th largest; top-p keeps the smallest set of most probable tokens, by
// descending probability and ascending id, whose mass reaches top_p; min-p keeps p >=
// min_p * max p; the draw takes the first token, in id order, at which the kept weights'
// running sum passes u * their total (one uniform u a row). Top-p needs no sort of the row:
// weights are binned by their float bits, and only the bin where the mass crosses top_p is
// sorted; top-k partitions only the values above a threshold that k of them reach.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// e^s below this underflows float32's normal range: such a token is under 1e-37 as likely as the
// top one, and is left out rather than carried as a denormal.
constexpr float kSmallestScaled = -87.f;
constexpr int64_t kBlock = 64;  // tokens per partial sum the draw walks
// Weight bins for top-p, by the float's exponent and top three mantissa bits (8 an octave).
// Weights lie in (0, 1] (the top token's is e^0 = 1), so bin 0 holds 1 alone.
constexpr int kBinShift = 20;
constexpr uint32_t kOneBits = 0x3F800000u;
constexpr int64_t kNumBins = (kOneBits >> kBinShift) + 1;

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// (exp8 may round a weight a hair above 1: bin 0 too.)
inline int64_t bin_of(float weight) {
  const uint32_t bits = bits_of(weight);
  return bits >= kOneBits ? 0 : static_cast<int64_t>((kOneBits - bits) >> kBinShift);
}

struct RowSettings {
  float temperature;
  int64_t top_k;
  double top_p, min_p, uniform;
};

// w[i] = e^{w[i]} for scaled logits w, 0 where a token is left out (-inf). Every token's weight
// comes from the same function (the tail through a padded vector too): equal logits must get
// equal weights, or top-p's order among them would not be by id.
void exponentiate(float* w, int64_t vocab) {
#ifdef HAVE_AVX2_FMA
  const __m256 smallest = _mm256_set1_ps(kSmallestScaled);
  auto eight = [&](float* p) {
    const __m256 s = _mm256_loadu_ps(p);
    _mm256_storeu_ps(p, _mm256_and_ps(exp8(s), _mm256_cmp_ps(s, smallest, _CMP_GE_OQ)));
  };
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) eight(w + i);
  if (i < vocab) {
    float tail[kLanes];
    std::fill(tail, tail + kLanes, kNegInf);
    std::copy(w + i, w + vocab, tail);
    eight(tail);
    std::copy(tail, tail + (vocab - i), w + i);
  }
#else
  for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] >= kSmallestScaled ? std::exp(w[i]) : 0.f;
#endif
}

// The sum of w[0 .. vocab), each kBlock tokens' partial sum in float (eight lanes, then across
// them), those summed in double; the partial sums are kept in `blocks` when it is given.
double sum_weights(const float* w, int64_t vocab, float* blocks) {
  double total = 0;
  for (int64_t start = 0, b = 0; start < vocab; start += kBlock, ++b) {
    const int64_t end = std::min(vocab, start + kBlock);
    float partial = 0;
    int64_t i = start;
#ifdef HAVE_AVX2_FMA
    if (end - start == kBlock) {
      __m256 lanes = _mm256_loadu_ps(w + i);
      for (i += kLanes; i < end; i += kLanes) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(w + i));
      partial = horizontal_sum(lanes);
    }
#endif
    for (; i < end; ++i) partial += w[i];
    if (blocks) blocks[b] = partial;
    total += partial;
  }
  return total;
}

// How many of s[0 .. vocab) are >= threshold.
int64_t count_at_least(const float* s, int64_t vocab, float threshold) {
  int64_t count = 0, i = 0;
#ifdef HAVE_AVX2_FMA
  const __m256 t = _mm256_set1_ps(threshold);
  for (; i + kLanes <= vocab; i += kLanes)
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), t, _CMP_GE_OQ)));
#endif
  for (; i < vocab; ++i) count += s[i] >= threshold;
  return count;
}

// The k-th largest of the scaled logits s (0 < k < vocab; each <= 0, -inf for those left out). The
// largest k lie at or above the first of 0, -1, -2, -4, ... that k values reach, so only those
// are partitioned.
float kth_largest(const float* s, int64_t vocab, int64_t k, std::vector<float>& scratch) {
  float threshold = 0.f;
  while (count_at_least(s, vocab, threshold) < k) {
    if (threshold < kSmallestScaled) return kNegInf;  // fewer than k tokens are left in
    threshold = threshold == 0.f ? -1.f : 2.f * threshold;
  }
  scratch.clear();
  for (int64_t i = 0; i < vocab; ++i)
    if (s[i] >= threshold) scratch.push_back(s[i]);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  return scratch[k - 1];
}

// Zeroes the weights top-p removes: a token stays while the mass of the tokens before it, by
// descending weight and ascending id, is under top_p of the whole (so the top token always does).
// Only tokens of weight >= floor are binned: those under it hold less than half the mass top-p
// drops, so the cut lies above them all.
void keep_top_p(float* w, int64_t vocab, double top_p, double total) {
  const double target = top_p * total;
  const float floor = std::max(static_cast<float>((1.0 - top_p) * total / (2.0 * vocab)),
                               std::numeric_limits<float>::min());  // weights of 0 are never binned
  std::vector<int64_t> candidates;
  int64_t i = 0;
#ifdef HAVE_AVX2_FMA
  const __m256 floor_v = _mm256_set1_ps(floor);
  for (; i + kLanes <= vocab; i += kLanes)
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), floor_v, _CMP_GE_OQ)); m; m &= m - 1)
      candidates.push_back(i + __builtin_ctz(m));
#endif
  for (; i < vocab; ++i)
    if (w[i] >= floor) candidates.push_back(i);
  std::vector<double> mass(kNumBins, 0.0);
  for (const int64_t c : candidates) mass[bin_of(w[c])] += w[c];
  double before = 0;
  for (int64_t bin = 0; bin < kNumBins; ++bin) {
    if (mass[bin] == 0) continue;
    if (before + mass[bin] < target) {  // every token of the bin starts under the target
      before += mass[bin];
      continue;
    }
    std::vector<std::pair<float, int64_t>> members;
    for (const int64_t c : candidates)
      if (bin_of(w[c]) == bin) members.emplace_back(w[c], c);
    std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    size_t kept = 0;
    while (kept < members.size() && before < target) before += members[kept++].first;
    if (before < target) continue;  // rounding: the bin's own sum fell short, the next bin crosses
    // Every token of an earlier bin outweighs every token of this one, so what stays is whatever
    // comes before this bin's first dropped member in (weight desc, id asc) order. Each bin starts
    // under the target, so its first member always stays (kept >= 1).
    const auto [last_weight, last_id] = members[kept - 1];
    for (int64_t t = 0; t < vocab; ++t) {
      const bool stays = w[t] > last_weight || (w[t] == last_weight && t <= last_id);
      w[t] = stays ? w[t] : 0.f;
    }
    return;
  }
  // No cut among the candidates (rounding only): whatever lies under the floor is still past it.
  for (int64_t t = 0; t < vocab; ++t) w[t] = w[t] < floor ? 0.f : w[t];
}

// The row's token: the first, in id order, at which the running sum of the kept weights passes
// uniform * their total, or -1 where nothing is kept. A block whose partial sum passes it is walked
// token by token; where rounding leaves that walk short, its last kept token is taken.
int64_t draw(const float* w, int64_t vocab, double uniform, float* blocks) {
  const double total = sum_weights(w, vocab, blocks);
  if (!(total > 0) || !std::isfinite(total)) return -1;
  const double target = uniform * total;
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  double before = 0;
  int64_t block = -1;
  bool crossed = false;
  for (int64_t b = 0; b < num_blocks && !crossed; ++b) {
    if (!(blocks[b] > 0)) continue;
    block = b;
    crossed = before + blocks[b] > target;
    if (!crossed) before += blocks[b];
  }
  if (block < 0) return -1;
  const int64_t start = block * kBlock, end = std::min(vocab, start + kBlock);
  int64_t last = -1;
  for (int64_t i = start; i < end; ++i) {
    if (!(w[i] > 0)) continue;
    last = i;
    before += w[i];
    if (crossed && before > target) return i;
  }
  return last;
}

// The first index of the row's largest value (NaN never wins).
int64_t first_max_index(const float* logits, int64_t vocab, float top) {
  for (int64_t i = 0; i < vocab; ++i)
    if (logits[i] == top) return i;
  return 0;
}

int64_t sample_row(const float* logits, int64_t vocab, const RowSettings& row, std::vector<float>& w,
                   std::vector<float>& scratch, std::vector<float>& blocks) {
  float top = kNegInf;
  int64_t i = 0;
#ifdef HAVE_AVX2_FMA
  if (vocab >= kLanes) {
    __m256 lanes = _mm256_set1_ps(kNegInf);
    for (; i + kLanes <= vocab; i += kLanes) lanes = _mm256_max_ps(_mm256_loadu_ps(logits + i), lanes);  // NaN skipped
    top = horizontal_max(lanes);
  }
#endif
  for (; i < vocab; ++i) top = logits[i] > top ? logits[i] : top;
  // Every logit -inf or NaN, or one +inf: no distribution to draw from (a NaN row is the
  // sampler's to report).
  if (!std::isfinite(top)) return top == kNegInf ? 0 : first_max_index(logits, vocab, top);
  const float temperature = row.temperature;
  float* weights = w.data();
  for (i = 0; i < vocab; ++i) {
    const float scaled = (logits[i] - top) / temperature;
    weights[i] = scaled >= kSmallestScaled ? scaled : kNegInf;  // NaN fails the test too
  }
  if (row.top_k > 0 && row.top_k < vocab) {
    const float kth = kth_largest(weights, vocab, row.top_k, scratch);
    for (i = 0; i < vocab; ++i) weights[i] = weights[i] < kth ? kNegInf : weights[i];
  }
  exponentiate(weights, vocab);
  if (row.top_p < 1.0) keep_top_p(weights, vocab, row.top_p, sum_weights(weights, vocab, nullptr));
  if (row.min_p > 0.0) {
    // The top token's weight is e^0 = 1 (top-k and top-p keep it), so p >= min_p * max p is w >= min_p.
    const float floor = static_cast<float>(row.min_p);
    for (i = 0; i < vocab; ++i) weights[i] = weights[i] < floor ? 0.f : weights[i];
  }
  const int64_t token = draw(weights, vocab, row.uniform, blocks.data());
  return token >= 0 ? token : first_max_index(logits, vocab, top);
}

}  // namespace

at::Tensor sample_rows(at::Tensor logits, std::vector<double> temperatures, std::vector<int64_t> top_k,
                       std::vector<double> top_p, std::vector<double> min_p, std::vector<double> uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "sample_rows: float32 [S, V] logits on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "sample_rows: empty rows");
  TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == rows && static_cast<int64_t>(top_k.size()) == rows &&
                  static_cast<int64_t>(top_p.size()) == rows && static_cast<int64_t>(min_p.size()) == rows,
              "sample_rows: one temperature, top_k, top_p and min_p per row");
  TORCH_CHECK(static_cast<int64_t>(uniforms.size()) == rows, "sample_rows: one uniform per row");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(temperatures[r] > 0 && top_k[r] >= 0 && top_p[r] > 0 && top_p[r] <= 1 && min_p[r] >= 0 &&
                    min_p[r] <= 1, "sample_rows: row ", r, " has temperature ", temperatures[r], ", top_k ",
                top_k[r], ", top_p ", top_p[r], ", min_p ", min_p[r]);
  at::Tensor out = logits.new_empty({rows}, at::kLong);
  int64_t* out_ptr = out.data_ptr<int64_t>();
  const float* in = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, rows, rows * vocab >= kMinParallelWork ? 1 : rows, [&](int64_t begin, int64_t end) {
    std::vector<float> w(vocab), scratch, blocks((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      // A temperature float32 cannot hold (under its smallest normal, over its largest) is held to its
      // range, as torch's path does: 0 or inf would make the scaled row NaN.
      const float temperature = std::clamp(static_cast<float>(temperatures[r]), std::numeric_limits<float>::min(),
                                           std::numeric_limits<float>::max());
      const RowSettings row{temperature, top_k[r], top_p[r], min_p[r], uniforms[r]};
      out_ptr[r] = sample_row(in + r * row_stride, vocab, row, w, scratch, blocks);
    }
  });
  return out;
}

namespace {

// The checks both in-place edits make before changing anything: float32 logits with contiguous
// rows, each listed row inside them with a token list of its own; returns the first token id
// outside the vocabulary, which the caller reports (nothing is edited then).
std::optional<int64_t> id_outside_vocabulary(const at::Tensor& logits, const std::vector<int64_t>& rows,
                                             const std::vector<std::vector<int64_t>>& token_lists, const char* kernel) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              kernel, ": float32 [B, V] logits on the CPU with contiguous rows");
  TORCH_CHECK(rows.size() == token_lists.size(), kernel, ": one token list per row");
  for (size_t j = 0; j < rows.size(); ++j) {
    TORCH_CHECK(rows[j] >= 0 && rows[j] < logits.size(0), kernel, ": row ", rows[j], " outside the ", logits.size(0),
                " rows");
    for (const int64_t id : token_lists[j])
      if (id < 0 || id >= logits.size(1)) return id;
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> repetition_penalty_rows(at::Tensor logits, std::vector<int64_t> rows,
                                               std::vector<std::vector<int64_t>> histories,
                                               std::vector<double> penalties) {
  TORCH_CHECK(histories.size() == penalties.size(), "repetition_penalty_rows: one history and one penalty per row");
  if (const auto bad = id_outside_vocabulary(logits, rows, histories, "repetition_penalty_rows")) return bad;
  const int64_t vocab = logits.size(1);
  std::vector<uint8_t> seen(vocab);
  for (size_t j = 0; j < rows.size(); ++j) {
    float* row = logits.data_ptr<float>() + rows[j] * logits.stride(0);
    // float32 like torch's penalty tensor, and the same division and product, so each value is
    // bit for bit what the torch path writes.
    const float penalty = static_cast<float>(penalties[j]);
    std::fill(seen.begin(), seen.end(), 0);
    for (const int64_t id : histories[j]) {
      if (seen[id]) continue;  // each distinct token once
      seen[id] = 1;
      row[id] = row[id] > 0 ? row[id] / penalty : row[id] * penalty;
    }
  }
  return std::nullopt;
}

std::optional<int64_t> presence_frequency_rows(at::Tensor logits, std::vector<int64_t> rows,
                                               std::vector<std::vector<int64_t>> outputs,
                                               std::vector<double> presence, std::vector<double> frequency) {
  TORCH_CHECK(outputs.size() == presence.size() && outputs.size() == frequency.size(),
              "presence_frequency_rows: one output history and two penalties per row");
  if (const auto bad = id_outside_vocabulary(logits, rows, outputs, "presence_frequency_rows")) return bad;
  const int64_t vocab = logits.size(1);
  std::vector<int64_t> counts(vocab), seen;
  for (size_t j = 0; j < rows.size(); ++j) {
    float* row = logits.data_ptr<float>() + rows[j] * logits.stride(0);
    for (const int64_t id : outputs[j])
      if (counts[id]++ == 0) seen.push_back(id);
    // torch's float32 ops in torch's order: presence x 1, frequency x count, their sum, then
    // logit + (-sum). The products go through double and are rounded back one by one, so no
    // fused multiply-add can round them differently.
    const float present = static_cast<float>(presence[j]), per_count = static_cast<float>(frequency[j]);
    for (const int64_t id : seen) {
      const float counted = static_cast<float>(static_cast<double>(per_count) * static_cast<double>(counts[id]));
      const float penalty = static_cast<float>(static_cast<double>(present) + static_cast<double>(counted));
      row[id] = row[id] + (-penalty);
      counts[id] = 0;
    }
    seen.clear();
  }
  return std::nullopt;
}
