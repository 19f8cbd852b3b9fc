// The conformance suite (docs/testing.md): a declarative grid of attention
// problems, a dense fp64 oracle written independently of every backend, one
// tolerance table, and a harness that drives any backend exactly as the
// Attention layer does (metadata -> builder -> do_kv_cache_update -> forward)
// and checks its output, LSE, guard regions, cache and determinism.
#pragma once

#include <pagedattn/backend/backend.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagedattn {

// ---------------------------------------------------------------- oracle ----

// One request, dense: exactly the values attention reads (queries rounded to
// the model dtype; keys/values after the cache's dtype rounding or fp8
// quantize/dequantize).
struct OracleRequest {
  int query_len = 0;
  int kv_len = 0;
  std::vector<float> query;  // [query_len, H, D]
  std::vector<float> key;    // [kv_len, Hkv, D]
  std::vector<float> value;  // [kv_len, Hkv, D]
  // PrefixLM ranges (causal decoder only): a query in [start, end) also sees
  // every key of that range.
  std::vector<MmPrefixRange> mm_prefix_ranges{};
};

// Query token i of a request sits at position p = kv_len - query_len + i.
struct OracleProblem {
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  double scale = 1.0;
  AttentionType attn_type = AttentionType::Decoder;
  bool causal = true;                 // decoder only; the other types are bidirectional
  std::optional<int> sliding_window;  // ignored for cross-attention
  std::optional<int> attention_chunk_size;  // decoder only: j in p's chunk, floor(j / C) == floor(p / C)
  std::optional<double> soft_cap;
  std::vector<float> alibi_slopes;  // [H] or empty
  std::vector<float> sinks;         // [H] or empty, unscaled logits
  std::vector<OracleRequest> requests;
};

struct OracleOutput {
  int num_tokens = 0;  // sum of query_len
  int num_heads = 0;
  int head_size = 0;
  std::vector<double> output;  // [T, H, D]
  std::vector<double> lse;     // [H, T], natural log, sink included, -inf for rows with no visible key
};

// Attention as docs/semantics.md defines it, on dense per-request data, in double.
// Throws InvalidArgument when the vectors disagree with the sizes.
OracleOutput dense_attention(const OracleProblem& problem);

// The standard ALiBi slopes (BLOOM / MPT, vLLM's _get_alibi_slopes).
std::vector<float> alibi_slopes(int num_heads);

// ------------------------------------------------------------- tolerances ---

struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
};

enum class CheckedQuantity { Output, Lse };

// The one tolerance table: |got - want| <= atol + rtol * |want|. Output rows
// by query dtype (f32, f16, bf16); LSE has one row for every dtype. fp8-KV
// cases use the same rows: the oracle reads the same dequantized values.
Tolerance tolerance(CheckedQuantity quantity, DType query_dtype);

// Checks a backend's result against the oracle: every element finite and in
// tolerance. `output` is [T, H, D] row-major; `lse` is [H, T] or empty (not
// checked). Returns nullopt when it passes, else a message with the number of
// bad elements, the worst one (where, got, want) and the maximum error.
std::optional<std::string> compare_with_oracle(const OracleOutput& expected, std::span<const float> output,
                                               std::span<const float> lse, DType query_dtype);

// ------------------------------------------------------------------ grid ----

// A batch: (query_len, seq_len) per request, as vLLM's BatchSpec. For
// cross-attention seq_len is the request's encoder length; for encoder and
// encoder-only attention query_len must equal seq_len.
struct BatchSpec {
  std::string name;
  std::vector<std::pair<int, int>> requests;
  // PrefixLM ranges per request (empty, or one list per request), which
  // cases with mm_prefix run; positions of the whole sequence.
  std::vector<std::vector<MmPrefixRange>> mm_prefix_ranges{};
};

// The named batches the grid uses: vLLM's BATCH_SPECS at their real size and
// scaled-down variants ("_div4", "_div8", ...), plus encoder and cross batches.
const std::vector<BatchSpec>& conformance_batch_specs();
// Throws InvalidArgument for an unknown name.
const BatchSpec& conformance_batch_spec(std::string_view name);

// One declarative conformance case.
struct ConformanceCase {
  int num_heads = 4;
  int num_kv_heads = 4;
  int head_size = 64;
  int block_size = 16;
  BatchSpec batch;
  DType dtype = DType::BF16;  // query, key, value and output dtype
  CacheDType kv_cache_dtype = CacheDType::Auto;
  bool per_head_kv_scales = false;  // fp8: [Hkv] scales instead of [1]
  KVCacheLayout layout = KVCacheLayout::NHD;
  std::optional<int> sliding_window;
  std::optional<int> attention_chunk_size;  // decoder only; a multiple of block_size
  // Batch invariance: the step is planned with BuilderParams::batch_invariant
  // (the backend's per-request plan; skipped where it is not declared).
  bool batch_invariant = false;
  // PrefixLM: the layer has use_mm_prefix and the step the batch's
  // mm_prefix_ranges (causal decoder only, not with chunking or a cascade).
  bool mm_prefix = false;
  // Cascade: every request's first shared_prefix tokens are the same blocks
  // (same keys and values), and the step is planned by a CascadeBuilder,
  // which must plan a cascade exactly when the layer allows one
  // (cascade_applies) and the prefix is long enough (cascade_pays). A
  // multiple of block_size, at most every context.
  int shared_prefix = 0;
  std::optional<float> soft_cap;
  std::optional<float> scale;  // default head_size^-0.5
  bool alibi = false;          // standard slopes
  bool sinks = false;          // uniform [0, 5) fp32 per head
  AttentionType attn_type = AttentionType::Decoder;
  bool causal = true;  // decoder only
  bool strided_qkv =
      false;  // q/k/v are views into one fused [T, (H + 2 Hkv) D] buffer; output rows strided too
  // Trailing padding rows past num_actual_tokens in q/k/v/output, slot -1 for
  // some, and a slot_mapping shorter than key (not with cross-attention).
  bool padded_slots = false;
  bool want_lse = false;
  std::uint32_t seed = 0;

  // Printable, unique within the grid, and no id is a substring of another
  // (it is bracketed), so `--filter <id>` reproduces exactly this case.
  std::string id() const;
};

// The grid every backend runs: a base sweep (head size x heads x block size,
// rotating batch, dtype, layout, strides, padding, LSE) plus feature sweeps.
std::vector<ConformanceCase> conformance_grid();

// ----------------------------------------------------------------- runner ---

enum class CaseStatus { Passed, Failed, Skipped };
std::string_view case_status_name(CaseStatus status);

struct CaseResult {
  CaseStatus status = CaseStatus::Passed;
  std::string message;  // why it failed, or why it was skipped
  // XXH3-64 of the bytes of every forward's output and LSE buffers, guard
  // regions included, in step order; 0 when no forward ran. Equal digests from
  // two builds mean bitwise-equal results.
  std::uint64_t digest = 0;
};

// Runs one case on `backend`. Unsupported combinations (the backend's
// validate_configuration reasons, another device type, missing feature flags,
// a required KV layout, or problem_support reasons) are Skipped; an exception from the backend or any
// failed check is Failed. Never throws.
CaseResult run_conformance_case(const AttentionBackend& backend, const ConformanceCase& c,
                                Device device = Device::cpu());

struct ConformanceSummary {
  int passed = 0;
  int failed = 0;
  int skipped = 0;
  bool ok() const { return failed == 0; }
};

// Called once per case, in grid order, from one thread at a time.
using CaseCallback = std::function<void(const ConformanceCase&, const CaseResult&)>;

// Runs every grid case whose id contains `filter` (empty = all) on up to
// `max_threads` threads. Exceptions from the callback are rethrown after the
// workers stop.
ConformanceSummary run_conformance(const AttentionBackend& backend, std::string_view filter,
                                   Device device = Device::cpu(), const CaseCallback& on_case = {},
                                   int max_threads = 2);
// The same over the cases whose id contains any of `filters` (empty = all).
ConformanceSummary run_conformance(const AttentionBackend& backend, std::span<const std::string> filters,
                                   Device device = Device::cpu(), const CaseCallback& on_case = {},
                                   int max_threads = 2);
// Whether `c`'s id contains one of `filters` (every case when empty).
bool matches_any(const ConformanceCase& c, std::span<const std::string> filters);

// "conformance: N passed, M failed, K skipped"
std::string format_summary(const ConformanceSummary& summary);

}  // namespace pagedattn
