#include "bench/batch_spec.h"

#include <fmt/format.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>
#include <optional>

namespace pagedattn::bench {

namespace {

constexpr std::string_view kWhere = "batch spec";
constexpr int kKilo = 1024;
constexpr long long kMaxValue = std::numeric_limits<int>::max();

class Cursor {
 public:
  explicit Cursor(std::string_view group) : s_(group) {}
  bool done() const { return pos_ == s_.size(); }
  bool eat(std::string_view token) {
    if (s_.substr(pos_, token.size()) != token) return false;
    pos_ += token.size();
    return true;
  }
  // Digits with an optional 'k' (x1024); nullopt when no digit is here.
  std::optional<int> number() {
    long long value = 0;
    const std::size_t start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_])) != 0) {
      value = value * 10 + (s_[pos_] - '0');
      if (value > kMaxValue) return std::nullopt;
      ++pos_;
    }
    if (pos_ == start) return std::nullopt;
    // "q1kv1k": a 'k' that starts the "kv" separator is not a suffix.
    if (s_.substr(pos_, 2) != "kv" && eat("k")) value *= kKilo;
    if (value > kMaxValue) return std::nullopt;
    return static_cast<int>(value);
  }
  bool at_digit() const { return pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_])) != 0; }

 private:
  std::string_view s_;
  std::size_t pos_ = 0;
};

// The group as the message quotes it: bytes outside printable ASCII as \xNN,
// since a NUL would end what() before the expected and the given value.
std::string printable(std::string_view group) {
  std::string out;
  for (const char ch : group) {
    const auto byte = static_cast<unsigned char>(ch);
    if (std::isprint(byte) != 0 && ch != '\\') {
      out += ch;
    } else {
      out += fmt::format("\\x{:02x}", byte);
    }
  }
  return out;
}

[[noreturn]] void bad_group(std::string_view group, std::string_view why) {
  throw_invalid(kWhere, fmt::format("group '{}'", printable(group)),
                "[count]q<q_len>[s<seq_len>] with optional k suffixes", std::string(why));
}

}  // namespace

std::vector<BatchRequest> parse_batch_spec(std::string_view spec) {
  check_arg(!spec.empty(), kWhere, "spec", "a non-empty batch spec such as 8q1s8k", "''");
  std::vector<BatchRequest> out;
  std::int64_t total_query_tokens = 0;
  std::size_t begin = 0;
  while (begin <= spec.size()) {
    const std::size_t end = std::min(spec.find('_', begin), spec.size());
    const std::string_view group = spec.substr(begin, end - begin);
    if (group.empty()) bad_group(group, "an empty group");
    Cursor c(group);
    int count = 1;
    if (c.at_digit()) {
      const auto n = c.number();
      if (!n || *n <= 0) bad_group(group, "a bad count");
      count = *n;
    }
    if (!c.eat("q")) bad_group(group, "no 'q'");
    const auto q_len = c.number();
    if (!q_len || *q_len <= 0) bad_group(group, "a bad query length");
    int seq_len = *q_len;
    if (c.eat("s") || c.eat("kv")) {
      const auto s = c.number();
      if (!s) bad_group(group, "a bad sequence length");
      seq_len = *s;
    }
    if (!c.done()) bad_group(group, "trailing characters");
    if (seq_len < *q_len) bad_group(group, fmt::format("seq_len {} < q_len {}", seq_len, *q_len));
    // Checked before inserting. In int64: the totals so far are at most
    // INT_MAX and count * q_len at most INT_MAX squared.
    const std::int64_t requests = std::ssize(out) + count;
    check_arg(requests <= kMaxBatchRequests, kWhere, "requests", fmt::format("<= {}", kMaxBatchRequests),
              requests);
    total_query_tokens += static_cast<std::int64_t>(count) * *q_len;
    check_arg(total_query_tokens <= kMaxValue, kWhere, "total query tokens", fmt::format("<= {}", kMaxValue),
              total_query_tokens);
    out.insert(out.end(), static_cast<std::size_t>(count), BatchRequest{*q_len, seq_len});
    begin = end + 1;
  }
  return out;
}

std::string format_batch_spec(const std::vector<BatchRequest>& requests) {
  auto length = [](int n) { return n % kKilo == 0 ? fmt::format("{}k", n / kKilo) : std::to_string(n); };
  std::string out;
  for (std::size_t i = 0; i < requests.size();) {
    std::size_t j = i;
    while (j < requests.size() && requests[j] == requests[i]) ++j;
    if (!out.empty()) out += '_';
    if (j - i > 1) out += std::to_string(j - i);
    out += fmt::format("q{}", length(requests[i].query_len));
    if (requests[i].seq_len != requests[i].query_len) out += fmt::format("s{}", length(requests[i].seq_len));
    i = j;
  }
  return out;
}

}  // namespace pagedattn::bench
