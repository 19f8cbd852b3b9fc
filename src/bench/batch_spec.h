// vLLM's batch-spec grammar (benchmarks/attention_benchmarks/batch_spec.py):
// groups joined by '_', each `[count]q<q_len>[s<seq_len>]` (the older `kv`
// spelling of `s` is accepted too); a `k` suffix multiplies by 1024 and
// seq_len defaults to q_len. "8q1s8k" = 8 decodes at 8k context, "q2k" = one
// 2k prompt, "q1k_16q1s4k" = one 1k prompt and 16 decodes at 4k.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::bench {

struct BatchRequest {
  int query_len = 0;
  int seq_len = 0;  // context + query tokens
  friend bool operator==(const BatchRequest&, const BatchRequest&) = default;
};

// Most requests one spec may describe: the batch becomes one RequestSpec
// and block-table row per request, so a count such as 2147483647 would ask
// for gigabytes before any work starts. vLLM's benchmark specs stay far below.
inline constexpr int kMaxBatchRequests = 1 << 16;

// Requests in spec order: 1 <= query_len <= seq_len <= INT_MAX each, at most
// kMaxBatchRequests of them, their query tokens summing to at most INT_MAX
// (make_common_metadata's int32 offsets). Throws InvalidArgument naming the
// bad group or the exceeded total.
std::vector<BatchRequest> parse_batch_spec(std::string_view spec);

// Canonical spelling of a batch: runs of equal requests as groups.
std::string format_batch_spec(const std::vector<BatchRequest>& requests);

}  // namespace pagedattn::bench
