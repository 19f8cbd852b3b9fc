// fuzz_batch_spec: the vLLM batch-spec parser (src/bench/batch_spec.h) on
// arbitrary bytes. Every input is either parsed or rejected with an
// InvalidArgument naming the group or the exceeded total, and the verdict and
// the requests agree with a second reading of the grammar written here from
// the header's description. A parsed batch satisfies the grammar's
// invariants, and format_batch_spec round-trips it.
#include <pagedattn/error.h>

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/batch_spec.h"
#include "fuzz_check.h"

namespace pagedattn::fuzz {
namespace {

using bench::BatchRequest;

constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
constexpr std::int64_t kKilo = 1024;
constexpr std::string_view kWhere = "batch spec";

struct Group {
  std::int64_t count = 1;
  std::int64_t query_len = 0;
  std::int64_t seq_len = 0;
};

// Digits, then a 'k' (x1024) unless the 'k' begins the "kv" separator.
// nullopt when there is no digit or the value exceeds INT_MAX.
std::optional<std::int64_t> read_length(std::string_view group, std::size_t& i) {
  const std::size_t first = i;
  std::int64_t value = 0;
  for (; i < group.size() && std::isdigit(static_cast<unsigned char>(group[i])) != 0; ++i) {
    value = std::min(value * 10 + (group[i] - '0'), kIntMax + 1);
  }
  if (i == first) return std::nullopt;
  const bool kv_follows = i + 1 < group.size() && group[i + 1] == 'v';
  if (i < group.size() && group[i] == 'k' && !kv_follows) {
    value *= kKilo;
    ++i;
  }
  if (value > kIntMax) return std::nullopt;
  return value;
}

// `[count]q<q_len>[(s|kv)<seq_len>]`; nullopt when malformed.
std::optional<Group> read_group(std::string_view group) {
  Group g;
  std::size_t i = 0;
  if (!group.empty() && std::isdigit(static_cast<unsigned char>(group[0])) != 0) {
    const auto count = read_length(group, i);
    if (!count || *count < 1) return std::nullopt;
    g.count = *count;
  }
  if (i >= group.size() || group[i] != 'q') return std::nullopt;
  ++i;
  const auto q = read_length(group, i);
  if (!q || *q < 1) return std::nullopt;
  g.query_len = g.seq_len = *q;
  if (i == group.size()) return g;
  if (group[i] == 's') {
    i += 1;
  } else if (group.substr(i, 2) == "kv") {
    i += 2;
  } else {
    return std::nullopt;
  }
  const auto s = read_length(group, i);
  if (!s || i != group.size() || *s < *q) return std::nullopt;
  g.seq_len = *s;
  return g;
}

// The whole spec: '_'-separated non-empty groups within the batch limits.
std::optional<std::vector<Group>> read_spec(std::string_view spec) {
  if (spec.empty()) return std::nullopt;
  std::vector<Group> groups;
  std::int64_t requests = 0;
  std::int64_t tokens = 0;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = spec.find('_', begin);
    const auto g = read_group(spec.substr(begin, end == std::string_view::npos ? end : end - begin));
    if (!g) return std::nullopt;
    requests += g->count;
    tokens += g->count * g->query_len;
    if (requests > bench::kMaxBatchRequests || tokens > kIntMax) return std::nullopt;
    groups.push_back(*g);
    if (end == std::string_view::npos) return groups;
    begin = end + 1;
  }
}

void check_batch(const std::vector<BatchRequest>& requests, const std::vector<Group>& groups) {
  std::size_t next = 0;
  for (const Group& g : groups) {
    for (std::int64_t i = 0; i < g.count; ++i, ++next) {
      require(next < requests.size(), "fewer requests ({}) than the groups describe", requests.size());
      const BatchRequest& r = requests[next];
      require(r.query_len == g.query_len && r.seq_len == g.seq_len,
              "request {} is ({}, {}), expected ({}, {})", next, r.query_len, r.seq_len, g.query_len,
              g.seq_len);
    }
  }
  require(next == requests.size(), "{} requests, the groups describe {}", requests.size(), next);
  require(!requests.empty() && std::ssize(requests) <= bench::kMaxBatchRequests, "{} requests",
          requests.size());
  std::int64_t tokens = 0;
  for (const BatchRequest& r : requests) {
    require(r.query_len >= 1 && r.query_len <= r.seq_len, "request ({}, {})", r.query_len, r.seq_len);
    tokens += r.query_len;
  }
  require(tokens <= kIntMax, "{} query tokens", tokens);

  const std::string canonical = bench::format_batch_spec(requests);
  const std::vector<BatchRequest> again = bench::parse_batch_spec(canonical);
  require(again == requests, "'{}' does not parse back into the batch", canonical);
  require(bench::format_batch_spec(again) == canonical, "'{}' is not canonical", canonical);
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pagedattn;
  const std::string_view spec(reinterpret_cast<const char*>(data), size);
  const auto groups = fuzz::read_spec(spec);
  std::vector<bench::BatchRequest> requests;
  try {
    requests = bench::parse_batch_spec(spec);
  } catch (const Error& e) {
    fuzz::require_error(e, ErrorKind::InvalidArgument, fuzz::kWhere);
    fuzz::require(!groups, "the parser rejected a well-formed spec: {}", e.what());
    return 0;
  }
  fuzz::require(groups.has_value(), "the parser accepted a malformed spec");
  fuzz::check_batch(requests, *groups);
  return 0;
}
