// Case-insensitive helpers for parsing user-facing names (dtypes, backends, ...).
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace pagedattn::detail {

inline std::string to_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

inline bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace pagedattn::detail
