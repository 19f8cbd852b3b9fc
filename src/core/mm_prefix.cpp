// PrefixLM ranges of a step (metadata.h): their validation, which
// CommonAttentionMetadata::validate runs, and set_mm_prefix_ranges.
#include "core/mm_prefix.h"
#include "core/step_tensors.h"

#include <pagedattn/error.h>

#include <string>
#include <tuple>

namespace pagedattn {
namespace {

constexpr std::string_view kRangesDefined = "a defined tensor (the PrefixLM ranges come as four tensors)";

void check_i32(std::string_view where, const Tensor& t, std::string_view name, int rank, Device device) {
  check_step_tensor(where, t, name, DType::I32, rank, device, kRangesDefined);
  check_contiguous(where, t, name);
}

// The ranges, flattened, against the step's requests (validated metadata,
// so its seq_lens hold num_reqs values).
void check_ranges(std::string_view where, const CommonAttentionMetadata& md,
                  std::span<const std::int32_t> start_loc, std::span<const std::int32_t> ranges) {
  check_arg(md.causal, where, "mm_prefix_ranges", "set only on causal steps (PrefixLM widens a causal mask)",
            "set on a non-causal step");
  check_arg(!md.encoder_seq_lens_cpu.has_value(), where, "mm_prefix_ranges",
            "set only on decoder self-attention steps", "set on cross-attention metadata");
  check_arg(md.local_chunk_size == 0, where, "mm_prefix_ranges", "not with chunked local attention",
            fmt::format("set on a step split by chunk size {}", md.local_chunk_size));
  check_mm_prefix_range_values(where, md.seq_lens_host(), start_loc, ranges);
}

}  // namespace

void check_mm_prefix_range_values(std::string_view where, std::span<const std::int32_t> seq_lens,
                                  std::span<const std::int32_t> start_loc,
                                  std::span<const std::int32_t> ranges) {
  const std::size_t batch = seq_lens.size();
  check_arg(start_loc.size() == batch + 1, where, "mm_prefix_range_start_loc size", batch + 1,
            start_loc.size());
  check_arg(ranges.size() % kMmPrefixRangeWidth == 0, where, "mm_prefix_ranges size",
            "a multiple of 2 ((start, end) pairs)", ranges.size());
  const std::size_t num_ranges = ranges.size() / kMmPrefixRangeWidth;
  if (start_loc[0] != 0)
    throw_invalid(where, "mm_prefix_range_start_loc[0]", "0", std::to_string(start_loc[0]));
  if (static_cast<std::size_t>(start_loc[batch]) != num_ranges) {
    throw_invalid(where, fmt::format("mm_prefix_range_start_loc[{}]", batch),
                  fmt::format("the number of ranges ({})", num_ranges), std::to_string(start_loc[batch]));
  }
  for (std::size_t r = 0; r < batch; ++r) {
    if (start_loc[r + 1] < start_loc[r]) {
      throw_invalid(where, fmt::format("mm_prefix_range_start_loc[{}]", r + 1),
                    fmt::format(">= mm_prefix_range_start_loc[{}] ({})", r, start_loc[r]),
                    std::to_string(start_loc[r + 1]));
    }
  }
  for (std::size_t r = 0; r < batch; ++r) {
    int previous_end = 0;
    for (auto i = static_cast<std::size_t>(start_loc[r]); i < static_cast<std::size_t>(start_loc[r + 1]);
         ++i) {
      const std::int32_t start = ranges[kMmPrefixRangeWidth * i];
      const std::int32_t end = ranges[kMmPrefixRangeWidth * i + 1];
      if (start < previous_end || start >= end || end > seq_lens[r]) {
        throw_invalid(
            where, fmt::format("mm_prefix_ranges[{}] (request {})", i, r),
            fmt::format("[start, end) with {} <= start < end <= seq_lens[{}] ({}): sorted, disjoint, "
                        "non-empty, within the sequence",
                        previous_end, r, seq_lens[r]),
            fmt::format("[{}, {})", start, end));
      }
      previous_end = end;
    }
  }
}

void check_mm_prefix_ranges(std::string_view where, const CommonAttentionMetadata& md) {
  const bool any = md.mm_prefix_range_start_loc.defined() || md.mm_prefix_ranges.defined() ||
                   md.mm_prefix_range_start_loc_cpu.defined() || md.mm_prefix_ranges_cpu.defined();
  if (!any) return;
  const Device device = md.device();
  check_i32(where, md.mm_prefix_range_start_loc_cpu, "mm_prefix_range_start_loc_cpu", 1, Device::cpu());
  check_i32(where, md.mm_prefix_ranges_cpu, "mm_prefix_ranges_cpu", 2, Device::cpu());
  check_size(md.mm_prefix_ranges_cpu, 1, where, "mm_prefix_ranges_cpu", kMmPrefixRangeWidth);
  check_i32(where, md.mm_prefix_range_start_loc, "mm_prefix_range_start_loc", 1, device);
  check_i32(where, md.mm_prefix_ranges, "mm_prefix_ranges", 2, device);
  for (const auto& [host, dev, name] :
       {std::tuple{&md.mm_prefix_range_start_loc_cpu, &md.mm_prefix_range_start_loc,
                   "mm_prefix_range_start_loc"},
        std::tuple{&md.mm_prefix_ranges_cpu, &md.mm_prefix_ranges, "mm_prefix_ranges"}}) {
    if (host->shape() != dev->shape()) {
      throw_invalid(where, fmt::format("{} shape", name),
                    fmt::format("{}_cpu's {}", name, host->shape().str()), dev->shape().str());
    }
  }
  check_ranges(where, md, host_i32(md.mm_prefix_range_start_loc_cpu), host_i32(md.mm_prefix_ranges_cpu));
}

std::span<const std::int32_t> CommonAttentionMetadata::mm_prefix_ranges_host(int r) const {
  if (!has_mm_prefix_ranges()) return {};
  check_arg(r >= 0 && r < num_reqs, "CommonAttentionMetadata::mm_prefix_ranges_host", "r",
            fmt::format("in [0, {})", num_reqs), r);
  const std::span<const std::int32_t> loc = host_i32(mm_prefix_range_start_loc_cpu);
  const auto first = static_cast<std::size_t>(loc[static_cast<std::size_t>(r)]);
  const auto last = static_cast<std::size_t>(loc[static_cast<std::size_t>(r) + 1]);
  return host_i32(mm_prefix_ranges_cpu)
      .subspan(kMmPrefixRangeWidth * first, kMmPrefixRangeWidth * (last - first));
}

void set_mm_prefix_ranges(CommonAttentionMetadata& md, std::span<const std::int32_t> start_loc,
                          std::span<const std::int32_t> ranges) {
  assign_mm_prefix_ranges("set_mm_prefix_ranges", md, start_loc, ranges);
}

void assign_mm_prefix_ranges(std::string_view where, CommonAttentionMetadata& md,
                             std::span<const std::int32_t> start_loc, std::span<const std::int32_t> ranges) {
  md.validate(where);
  check_ranges(where, md, start_loc, ranges);
  const auto num_ranges = static_cast<std::int64_t>(ranges.size() / kMmPrefixRangeWidth);
  Tensor start_cpu = Tensor::from_i32(start_loc, {static_cast<std::int64_t>(start_loc.size())});
  Tensor ranges_cpu = Tensor::from_i32(ranges, {num_ranges, kMmPrefixRangeWidth});
  const Device device = md.device();
  Tensor start_dev = device.is_cpu() ? start_cpu : start_cpu.to(device);
  Tensor ranges_dev = device.is_cpu() ? ranges_cpu : ranges_cpu.to(device);
  // Assigned last: a failed check or copy leaves `md` as it was.
  md.mm_prefix_range_start_loc_cpu = std::move(start_cpu);
  md.mm_prefix_ranges_cpu = std::move(ranges_cpu);
  md.mm_prefix_range_start_loc = std::move(start_dev);
  md.mm_prefix_ranges = std::move(ranges_dev);
}

}  // namespace pagedattn
