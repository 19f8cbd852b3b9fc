#include <pagedattn/support_matrix.h>

#include <functional>

namespace pagedattn {
namespace {

std::string yes_no(bool b) { return b ? "yes" : "no"; }

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::string dtypes_cell(const AttentionBackend& b) {
  std::vector<std::string> names;
  for (DType t : b.supported_dtypes()) names.emplace_back(dtype_name(t));
  return join(names);
}

std::string kv_dtypes_cell(const AttentionBackend& b) {
  std::vector<std::string> names;
  for (CacheDType t : b.supported_kv_cache_dtypes()) names.emplace_back(cache_dtype_name(t));
  return names.empty() ? "any" : join(names);
}

std::string head_sizes_cell(const AttentionBackend& b) {
  std::vector<std::string> names;
  for (int h : b.supported_head_sizes()) names.push_back(std::to_string(h));
  if (!names.empty()) return join(names);
  // No list: summarize the accepted sizes over the usual range (a rule such as
  // "multiple of 8, at most 256" shows as exactly that).
  constexpr int kProbeMax = 512;
  std::vector<int> accepted;
  for (int h = 1; h <= kProbeMax; ++h) {
    if (b.supports_head_size(h)) accepted.push_back(h);
  }
  if (static_cast<int>(accepted.size()) == kProbeMax) return "any";
  if (accepted.empty()) return "none";
  const int step = accepted.front();
  bool progression = true;
  for (std::size_t i = 0; i < accepted.size(); ++i) {
    progression = progression && accepted[i] == step * static_cast<int>(i + 1);
  }
  if (!progression) {
    for (int h : accepted) names.push_back(std::to_string(h));
    return join(names);
  }
  if (accepted.back() == kProbeMax - kProbeMax % step) return fmt::format("multiples of {}", step);
  return fmt::format("multiples of {} up to {}", step, accepted.back());
}

std::string block_sizes_cell(const AttentionBackend& b) {
  std::vector<std::string> names;
  for (const KernelBlockSize& s : b.supported_kernel_block_sizes()) {
    if (const auto* m = std::get_if<MultipleOf>(&s)) {
      names.push_back(m->base == 1 ? "any" : fmt::format("multiple of {}", m->base));
    } else {
      names.push_back(std::to_string(std::get<int>(s)));
    }
  }
  return join(names);
}

std::string attn_types_cell(const AttentionBackend& b) {
  std::vector<std::string> names;
  for (AttentionType t : {AttentionType::Decoder, AttentionType::Encoder, AttentionType::EncoderOnly,
                          AttentionType::EncoderDecoder}) {
    if (b.supports_attn_type(t)) names.emplace_back(attention_type_name(t));
  }
  return join(names);
}

std::string layouts_cell(const AttentionBackend& b) {
  if (auto required = b.required_kv_cache_layout()) return std::string(kv_cache_layout_name(*required));
  return "NHD, HND";
}

}  // namespace

std::vector<SupportRow> support_matrix(const std::vector<const AttentionBackend*>& backends) {
  using Cell = std::function<std::string(const AttentionBackend&)>;
  const std::vector<std::pair<std::string, Cell>> features = {
      {"device", [](const AttentionBackend& b) { return std::string(device_type_name(b.device_type())); }},
      {"dtypes", dtypes_cell},
      {"KV cache dtypes", kv_dtypes_cell},
      {"head sizes", head_sizes_cell},
      {"kernel block sizes", block_sizes_cell},
      {"KV layouts", layouts_cell},
      {"attention types", attn_types_cell},
      {"non-causal decoder", [](const AttentionBackend& b) { return yes_no(b.supports_non_causal()); }},
      {"sliding window", [](const AttentionBackend& b) { return yes_no(b.supports_sliding_window()); }},
      {"logits soft cap", [](const AttentionBackend& b) { return yes_no(b.supports_soft_cap()); }},
      {"ALiBi", [](const AttentionBackend& b) { return yes_no(b.supports_alibi()); }},
      {"chunked local attention",
       [](const AttentionBackend& b) { return yes_no(b.supports_chunked_local_attention()); }},
      {"PrefixLM ranges (mm_prefix)", [](const AttentionBackend& b) { return yes_no(b.supports_mm_prefix()); }},
      {"cascade (shared prefix)", [](const AttentionBackend& b) { return yes_no(b.supports_cascade()); }},
      {"attention sinks", [](const AttentionBackend& b) { return yes_no(b.supports_sink()); }},
      {"per-KV-head fp8 scales", [](const AttentionBackend& b) { return yes_no(b.supports_per_head_quant_scales()); }},
      {"returns LSE", [](const AttentionBackend& b) { return yes_no(b.can_return_lse()); }},
      {"deterministic", [](const AttentionBackend& b) { return yes_no(b.is_deterministic()); }},
      {"batch invariant", [](const AttentionBackend& b) { return yes_no(b.supports_batch_invariance()); }},
      {"MLA", [](const AttentionBackend& b) { return yes_no(b.is_mla()); }},
      {"caller output buffer", [](const AttentionBackend& b) { return yes_no(b.accept_output_buffer()); }},
      {"KV write inside forward", [](const AttentionBackend& b) { return yes_no(b.forward_includes_kv_cache_update()); }},
  };
  std::vector<SupportRow> rows;
  for (const auto& [feature, cell] : features) {
    SupportRow row{feature, {}};
    for (const AttentionBackend* b : backends) row.cells.push_back(cell(*b));
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string support_matrix_markdown(const std::vector<const AttentionBackend*>& backends) {
  std::string out =
      "# Support matrix\n\n"
      "Generated from the backends' capability queries by `pagedattn info --markdown`; a test\n"
      "fails when this file and the code disagree. Regenerate it after changing a backend.\n\n"
      "| feature |";
  std::string rule = "|---|";
  for (const AttentionBackend* b : backends) {
    out += fmt::format(" {} |", b->name());
    rule += "---|";
  }
  out += "\n" + rule + "\n";
  for (const SupportRow& row : support_matrix(backends)) {
    out += "| " + row.feature + " |";
    for (const std::string& c : row.cells) out += " " + c + " |";
    out += "\n";
  }
  return out;
}

}  // namespace pagedattn
