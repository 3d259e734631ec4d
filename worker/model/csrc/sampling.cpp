// Sampling's share of a step on the CPU: the repetition penalty, and each sampled row's draw
// from its temperature-scaled, top-k / top-p / min-p filtered distribution. Torch spends far
// more on these per vocabulary-sized row than the model's step on a small model (a full stable
// sort for top-p, a random value per token for the draw, a [B, V] mask for the penalty), and
// the cost grows with the vocabulary (docs/benchmarks.md, "Sampling").
//
// The rules are worker/logits_processors.py's and worker/sampler.py's (the torch path every
// other device runs), computed in one pass a step: s = (logit - max) / T as torch rounds it;
// top-k keeps s >= the k-th largest; top-p keeps the smallest set of most probable tokens, by
// descending probability and ascending id, whose mass reaches top_p; min-p keeps p >=
// min_p * max p; the draw takes the first token, in id order, at which the kept weights'
// running sum passes u * their total (one uniform u a row). Top-p needs no sort of the row:
// weights are binned by their exponent, and only the bin where the mass crosses top_p is sorted.
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
// Weight bins for top-p: 2^kBinBitsPerOctave a power of two, by the float's exponent and top
// mantissa bits. Weights lie in (0, 1] (the top token's is e^0 = 1), so bin 0 holds 1 alone.
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

// w[i] = e^{w[i]} for scaled logits w, 0 where a token is left out (-inf).
void exponentiate(float* w, int64_t vocab) {
  int64_t i = 0;
#ifdef HAVE_AVX2_FMA
  const __m256 smallest = _mm256_set1_ps(kSmallestScaled);
  for (; i + kLanes <= vocab; i += kLanes) {
    const __m256 s = _mm256_loadu_ps(w + i);
    const __m256 kept = _mm256_cmp_ps(s, smallest, _CMP_GE_OQ);
    _mm256_storeu_ps(w + i, _mm256_and_ps(exp8(s), kept));
  }
#endif
  for (; i < vocab; ++i) w[i] = w[i] >= kSmallestScaled ? std::exp(w[i]) : 0.f;
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

// Bins of a row's values, in the order top-k and top-p walk them (largest first), for finding
// where a count or a mass is reached without sorting the row: by the float's exponent and top
// three mantissa bits. Scaled logits lie in [-87, 0], weights in (0, 1].
constexpr int64_t kNumScaledBins = (0x42B00000u >> kBinShift) + 1;  // |s| < 88
// By |s|'s bits (the sign cleared: the top token's s is +0, the rest negative).
inline int64_t scaled_bin(float scaled) { return static_cast<int64_t>((bits_of(scaled) & 0x7FFFFFFFu) >> kBinShift); }

// The k-th largest of the scaled logits s (0 < k < vocab; -inf for those left out).
float kth_largest(const float* s, int64_t vocab, int64_t k, std::vector<float>& scratch) {
  std::vector<int64_t> counts(kNumScaledBins, 0);
  int64_t finite = 0;
  for (int64_t i = 0; i < vocab; ++i)
    if (s[i] != kNegInf) {
      ++counts[scaled_bin(s[i])];
      ++finite;
    }
  if (finite < k) return kNegInf;
  int64_t bin = 0, above = 0;
  while (above + counts[bin] < k) above += counts[bin++];
  scratch.clear();
  for (int64_t i = 0; i < vocab; ++i)
    if (s[i] != kNegInf && scaled_bin(s[i]) == bin) scratch.push_back(s[i]);
  const int64_t rank = k - above - 1;  // within the bin, largest first
  std::nth_element(scratch.begin(), scratch.begin() + rank, scratch.end(), std::greater<float>());
  return scratch[rank];
}

// Zeroes the weights top-p removes: a token stays while the mass of the tokens before it, by
// descending weight and ascending id, is under top_p of the whole (so the top token always does).
void keep_top_p(float* w, int64_t vocab, double top_p, double total) {
  const double target = top_p * total;
  std::vector<double> mass(kNumBins, 0.0);
  for (int64_t i = 0; i < vocab; ++i)
    if (w[i] > 0) mass[bin_of(w[i])] += w[i];
  double before = 0;
  for (int64_t bin = 0; bin < kNumBins; ++bin) {
    if (mass[bin] == 0) continue;
    if (before + mass[bin] < target) {  // every token of the bin starts under the target
      before += mass[bin];
      continue;
    }
    std::vector<std::pair<float, int64_t>> members;
    for (int64_t i = 0; i < vocab; ++i)
      if (w[i] > 0 && bin_of(w[i]) == bin) members.emplace_back(w[i], i);
    std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    size_t kept = 0;
    while (kept < members.size() && before < target) before += members[kept++].first;
    if (kept == members.size()) continue;  // rounding: the bin's own sum fell short, the next bin crosses
    // Kept: bins before this one, and this bin's first `kept` members in the sorted order.
    const auto [last_weight, last_id] = kept ? members[kept - 1] : std::pair<float, int64_t>{2.f, -1};
    for (int64_t i = 0; i < vocab; ++i) {
      if (w[i] <= 0) continue;
      const int64_t b = bin_of(w[i]);
      const bool stays = b < bin || (b == bin && (w[i] > last_weight || (w[i] == last_weight && i <= last_id)));
      if (!stays) w[i] = 0;
    }
    return;
  }
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
                       std::vector<double> top_p, std::vector<double> min_p, at::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "sample_rows: float32 [S, V] logits on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "sample_rows: empty rows");
  TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == rows && static_cast<int64_t>(top_k.size()) == rows &&
                  static_cast<int64_t>(top_p.size()) == rows && static_cast<int64_t>(min_p.size()) == rows,
              "sample_rows: one temperature, top_k, top_p and min_p per row");
  TORCH_CHECK(uniforms.device().is_cpu() && uniforms.dtype() == at::kDouble && uniforms.dim() == 1 &&
                  uniforms.size(0) == rows, "sample_rows: float64 uniforms [S] on the CPU");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(temperatures[r] > 0 && top_k[r] >= 0 && top_p[r] > 0 && top_p[r] <= 1 && min_p[r] >= 0 &&
                    min_p[r] <= 1, "sample_rows: row ", r, " has temperature ", temperatures[r], ", top_k ",
                top_k[r], ", top_p ", top_p[r], ", min_p ", min_p[r]);
  const at::Tensor u = uniforms.contiguous();
  const double* u_ptr = u.data_ptr<double>();
  at::Tensor out = logits.new_empty({rows}, at::kLong);
  int64_t* out_ptr = out.data_ptr<int64_t>();
  const float* in = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, rows, rows * vocab >= kMinParallelWork ? 1 : rows, [&](int64_t begin, int64_t end) {
    std::vector<float> w(vocab), scratch, blocks((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      const RowSettings row{static_cast<float>(temperatures[r]), top_k[r], top_p[r], min_p[r], u_ptr[r]};
      out_ptr[r] = sample_row(in + r * row_stride, vocab, row, w, scratch, blocks);
    }
  });
  return out;
}

std::optional<int64_t> repetition_penalty_rows(at::Tensor logits, std::vector<int64_t> rows,
                                               std::vector<std::vector<int64_t>> histories,
                                               std::vector<double> penalties) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "repetition_penalty_rows: float32 [B, V] logits on the CPU with contiguous rows");
  TORCH_CHECK(rows.size() == histories.size() && rows.size() == penalties.size(),
              "repetition_penalty_rows: one history and one penalty per row");
  const int64_t vocab = logits.size(1);
  for (size_t j = 0; j < rows.size(); ++j) {
    TORCH_CHECK(rows[j] >= 0 && rows[j] < logits.size(0), "repetition_penalty_rows: row ", rows[j], " outside the ",
                logits.size(0), " rows");
    for (const int64_t id : histories[j])
      if (id < 0 || id >= vocab) return id;  // nothing is changed: the caller reports the id
  }
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
