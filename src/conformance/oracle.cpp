// The dense fp64 oracle. Deliberately shaped unlike the REFERENCE kernel: it
// never sees a page table, builds each request's full score matrix per head,
// masks it with -inf element by element and applies a softmax with the sink
// as an extra column (the shape of vLLM's ref_paged_attn).
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagedattn {

namespace {

constexpr std::string_view kOracleWhere = "dense_attention";
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Output rows by query dtype, and the one LSE row.
constexpr Tolerance kF32Tolerance{1e-4, 1e-4};
constexpr Tolerance kF16Tolerance{5e-3, 5e-3};
constexpr Tolerance kBF16Tolerance{1.5e-2, 1e-2};  // vLLM's test_flash_attn / test_triton_unified_attention
constexpr Tolerance kLseTolerance{2e-3, 1e-3};

// The mask without PrefixLM ranges.
bool masked_visible(const OracleProblem& pb, int pos, int j) {
  if (pb.attn_type == AttentionType::Decoder && pb.causal && j > pos) return false;
  if (pb.attn_type == AttentionType::Decoder && pb.attention_chunk_size &&
      j / *pb.attention_chunk_size != pos / *pb.attention_chunk_size) {
    return false;
  }
  if (!pb.sliding_window || pb.attn_type == AttentionType::EncoderDecoder) return true;
  const int w = *pb.sliding_window;
  if (pb.attn_type == AttentionType::Decoder) return j > pos - w && j <= pos;
  return std::abs(pos - j) <= w - 1;
}

// vLLM's rule, FlexAttention's or_masks: (causal and window) or (query and
// key in one PrefixLM range).
bool key_visible(const OracleProblem& pb, const OracleRequest& rq, int pos, int j) {
  if (masked_visible(pb, pos, j)) return true;
  return std::any_of(rq.mm_prefix_ranges.begin(), rq.mm_prefix_ranges.end(), [&](const MmPrefixRange& r) {
    return r.start <= pos && pos < r.end && r.start <= j && j < r.end;
  });
}

void check_request(const OracleProblem& pb, const OracleRequest& rq, std::size_t index) {
  const auto q_elems = static_cast<std::size_t>(rq.query_len) * pb.num_heads * pb.head_size;
  const auto kv_elems = static_cast<std::size_t>(rq.kv_len) * pb.num_kv_heads * pb.head_size;
  const std::string name = fmt::format("requests[{}]", index);
  check_arg(rq.query_len >= 0 && rq.kv_len >= 0, kOracleWhere, name + " lengths", "non-negative",
            fmt::format("query_len {}, kv_len {}", rq.query_len, rq.kv_len));
  check_arg(rq.query.size() == q_elems, kOracleWhere, name + ".query.size()", q_elems, rq.query.size());
  check_arg(rq.key.size() == kv_elems, kOracleWhere, name + ".key.size()", kv_elems, rq.key.size());
  check_arg(rq.value.size() == kv_elems, kOracleWhere, name + ".value.size()", kv_elems, rq.value.size());
  if (rq.mm_prefix_ranges.empty()) return;
  check_arg(pb.attn_type == AttentionType::Decoder && pb.causal && !pb.attention_chunk_size, kOracleWhere,
            name + ".mm_prefix_ranges", "only with causal decoder attention without chunking",
            fmt::format("{} ranges", rq.mm_prefix_ranges.size()));
  for (const MmPrefixRange& r : rq.mm_prefix_ranges) {
    check_arg(r.start >= 0 && r.start < r.end && r.end <= rq.kv_len, kOracleWhere, name + ".mm_prefix_ranges",
              fmt::format("ranges within [0, {}]", rq.kv_len), fmt::format("[{}, {})", r.start, r.end));
  }
}

std::string describe_index(const OracleOutput& ex, std::size_t flat, bool lse) {
  if (lse) return fmt::format("lse[head {}, token {}]", flat / ex.num_tokens, flat % ex.num_tokens);
  const auto d = static_cast<std::size_t>(ex.head_size);
  const auto h = static_cast<std::size_t>(ex.num_heads);
  return fmt::format("output[token {}, head {}, dim {}]", flat / (h * d), flat / d % h, flat % d);
}

// Scans one quantity; returns a message on failure.
std::optional<std::string> compare_quantity(const OracleOutput& ex, std::span<const double> want,
                                            std::span<const float> got, Tolerance tol, bool lse) {
  const char* what = lse ? "lse" : "output";
  if (want.size() != got.size()) {
    return fmt::format("{} has {} elements, the oracle {}", what, got.size(), want.size());
  }
  std::size_t bad = 0;
  std::size_t worst = 0;
  double worst_excess = -1.0;
  double max_err = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    const double w = want[i];
    double excess = 0.0;  // error beyond the tolerance, +inf for a wrong non-finite value
    if (std::isinf(w) && w < 0) {
      excess = g == w ? 0.0 : std::numeric_limits<double>::infinity();
    } else if (!std::isfinite(g)) {
      excess = std::numeric_limits<double>::infinity();
    } else {
      const double err = std::abs(g - w);
      max_err = std::max(max_err, err);
      excess = err - (tol.atol + tol.rtol * std::abs(w));
    }
    if (excess > 0.0) ++bad;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return std::nullopt;
  return fmt::format(
      "{} of {} {} elements outside atol {} / rtol {}; worst {}: got {}, want {}; max |err| {:.3g}", bad,
      want.size(), what, tol.atol, tol.rtol, describe_index(ex, worst, lse), got[worst], want[worst],
      max_err);
}

}  // namespace

OracleOutput dense_attention(const OracleProblem& pb) {
  check_arg(pb.num_heads > 0 && pb.num_kv_heads > 0 && pb.num_heads % pb.num_kv_heads == 0, kOracleWhere,
            "num_heads / num_kv_heads", "positive, num_heads a multiple of num_kv_heads",
            fmt::format("{} / {}", pb.num_heads, pb.num_kv_heads));
  check_arg(pb.head_size > 0, kOracleWhere, "head_size", "> 0", pb.head_size);
  check_arg(pb.alibi_slopes.empty() || std::ssize(pb.alibi_slopes) == pb.num_heads, kOracleWhere,
            "alibi_slopes.size()", fmt::format("0 or {}", pb.num_heads), pb.alibi_slopes.size());
  check_arg(pb.sinks.empty() || std::ssize(pb.sinks) == pb.num_heads, kOracleWhere, "sinks.size()",
            fmt::format("0 or {}", pb.num_heads), pb.sinks.size());
  if (pb.sliding_window)
    check_arg(*pb.sliding_window > 0, kOracleWhere, "sliding_window", "> 0", *pb.sliding_window);
  if (pb.attention_chunk_size) {
    check_arg(*pb.attention_chunk_size > 0, kOracleWhere, "attention_chunk_size", "> 0", *pb.attention_chunk_size);
  }

  const int H = pb.num_heads;
  const int Hkv = pb.num_kv_heads;
  const int D = pb.head_size;
  const int group = H / Hkv;
  OracleOutput out;
  out.num_heads = H;
  out.head_size = D;
  for (std::size_t r = 0; r < pb.requests.size(); ++r) {
    check_request(pb, pb.requests[r], r);
    out.num_tokens += pb.requests[r].query_len;
  }
  const auto T = static_cast<std::size_t>(out.num_tokens);
  out.output.assign(T * H * D, 0.0);
  out.lse.assign(static_cast<std::size_t>(H) * T, kNegInf);

  std::size_t first_token = 0;
  std::vector<double> scores;
  for (const OracleRequest& rq : pb.requests) {
    const int M = rq.query_len;
    const int N = rq.kv_len;
    scores.assign(static_cast<std::size_t>(M) * N, 0.0);
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      // Masked scores [M, N].
      for (int i = 0; i < M; ++i) {
        const int pos = N - M + i;
        const float* q = &rq.query[(static_cast<std::size_t>(i) * H + h) * D];
        for (int j = 0; j < N; ++j) {
          double& s = scores[static_cast<std::size_t>(i) * N + j];
          if (!key_visible(pb, rq, pos, j)) {
            s = kNegInf;
            continue;
          }
          const float* k = &rq.key[(static_cast<std::size_t>(j) * Hkv + kvh) * D];
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * static_cast<double>(k[d]);
          s = pb.scale * dot;
          if (pb.soft_cap && *pb.soft_cap > 0.0) s = *pb.soft_cap * std::tanh(s / *pb.soft_cap);
          if (!pb.alibi_slopes.empty()) s += static_cast<double>(pb.alibi_slopes[h]) * (j - pos);
        }
      }
      // Softmax over [sink, scores...] per row, the sink column dropped after.
      for (int i = 0; i < M; ++i) {
        // data() + offset, not &scores[...]: with no keys (N == 0) the vector is empty.
        const double* row = scores.data() + static_cast<std::size_t>(i) * N;
        const bool any_visible = std::any_of(row, row + N, [](double s) { return s != kNegInf; });
        const std::size_t token = first_token + i;
        if (!any_visible) continue;  // zeros, LSE -inf
        double m = *std::max_element(row, row + N);
        const bool sink = !pb.sinks.empty();
        if (sink) m = std::max(m, static_cast<double>(pb.sinks[h]));
        double total = sink ? std::exp(static_cast<double>(pb.sinks[h]) - m) : 0.0;
        for (int j = 0; j < N; ++j) total += std::exp(row[j] - m);
        double* o = &out.output[(token * H + h) * D];
        for (int j = 0; j < N; ++j) {
          if (row[j] == kNegInf) continue;
          const double p = std::exp(row[j] - m) / total;
          const float* v = &rq.value[(static_cast<std::size_t>(j) * Hkv + kvh) * D];
          for (int d = 0; d < D; ++d) o[d] += p * static_cast<double>(v[d]);
        }
        out.lse[static_cast<std::size_t>(h) * T + token] = m + std::log(total);
      }
    }
    first_token += static_cast<std::size_t>(M);
  }
  return out;
}

std::vector<float> alibi_slopes(int num_heads) {
  check_arg(num_heads > 0, "alibi_slopes", "num_heads", "> 0", num_heads);
  int closest = 1;
  while (closest * 2 <= num_heads) closest *= 2;
  const double base = std::exp2(-8.0 / closest);
  std::vector<float> slopes;
  for (int k = 1; k <= closest; ++k) slopes.push_back(static_cast<float>(std::pow(base, k)));
  if (closest != num_heads) {
    // The remaining heads take the odd powers of the next power of two's base.
    const double extra_base = std::exp2(-4.0 / closest);
    const int remaining = std::min(closest, num_heads - closest);
    for (int k = 0; k < remaining; ++k) slopes.push_back(static_cast<float>(std::pow(extra_base, 2 * k + 1)));
  }
  return slopes;
}

Tolerance tolerance(CheckedQuantity quantity, DType query_dtype) {
  if (quantity == CheckedQuantity::Lse) return kLseTolerance;
  switch (query_dtype) {
    case DType::F32:
      return kF32Tolerance;
    case DType::F16:
      return kF16Tolerance;
    case DType::BF16:
      return kBF16Tolerance;
    default:
      throw_invalid("tolerance", "query_dtype", "f32, f16 or bf16", dtype_name(query_dtype));
  }
}

std::optional<std::string> compare_with_oracle(const OracleOutput& expected, std::span<const float> output,
                                               std::span<const float> lse, DType query_dtype) {
  if (auto failure = compare_quantity(expected, expected.output, output,
                                      tolerance(CheckedQuantity::Output, query_dtype), false)) {
    return failure;
  }
  if (lse.empty()) return std::nullopt;
  return compare_quantity(expected, expected.lse, lse, tolerance(CheckedQuantity::Lse, query_dtype), true);
}

}  // namespace pagedattn
