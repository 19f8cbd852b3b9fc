// Run-time ISA choice and the public kernel entry points (no SIMD here).
#include "backends/cpu_attn/kernels/cpu_attn_targets.h"
// The targets first: HWY_TARGETS follows them.
#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"

#include <hwy/targets.h>
#if HWY_ARCH_X86
#include <xmmintrin.h>
#endif

#include <atomic>

namespace pagedattn::cpu_attn {

namespace {

constexpr Isa kAllIsas[] = {Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Scalar};

std::size_t align_up(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

bool cpu_runs(Isa isa) {
  const std::int64_t supported = hwy::SupportedTargets();
  switch (isa) {
    case Isa::Avx512Bf16:
#if defined(__x86_64__) || defined(__i386__)
      // The decode path's e4m3 lookups use AVX512-VBMI byte permutes; CPUs
      // with AVX512-BF16 but no VBMI (Cooper Lake) run Isa::Avx512.
      return (supported & HWY_AVX3) != 0 && __builtin_cpu_supports("avx512bf16") &&
             __builtin_cpu_supports("avx512vbmi");
#else
      return false;
#endif
    case Isa::Avx512:
      return (supported & HWY_AVX3) != 0;
    case Isa::Avx2:
      return (supported & HWY_AVX2) != 0;
    case Isa::Scalar:
      return true;
  }
  return false;
}

struct Active {
  Isa isa;
  KernelTable table;
};

Active best_active() {
  for (Isa isa : kAllIsas) {
    if (isa_compiled(isa) && cpu_runs(isa)) return {isa, kernel_table_for(isa)};
  }
  return {Isa::Scalar, kernel_table_for(Isa::Scalar)};
}

// The selection is written only by set_isa (between forward calls); readers
// take one consistent snapshot per call.
std::atomic<Active*>& active_slot() {
  static Active initial = best_active();
  static std::atomic<Active*> slot{&initial};
  return slot;
}

// Bytes of the tile buffers every KV head of an item shares.
std::size_t shared_bytes(std::size_t d) {
  // kt, vf and ks (K elements of at most a float's size)
  return 3 * align_up(d * kTileKeys * sizeof(float)) + align_up(d * sizeof(float));
}

// Bytes of one KV head's state.
std::size_t head_state_bytes(std::size_t d, std::size_t rows) {
  return 2 * align_up(rows * d * sizeof(float)) + align_up(score_tile_floats(rows) * sizeof(float)) +
         3 * align_up(rows * sizeof(float)) + align_up(rows * sizeof(RowInfo));
}

}  // namespace

Scratch::Scratch(void* base, int head_size, int num_rows, int head, int num_heads) {
  const auto rows_count = static_cast<std::size_t>(num_rows);
  const auto d = static_cast<std::size_t>(head_size);
  auto* p =
      static_cast<unsigned char*>(base) + static_cast<std::size_t>(head) * head_state_bytes(d, rows_count);
  auto take = [&p](std::size_t bytes) {
    unsigned char* at = p;
    p += align_up(bytes);
    return at;
  };
  q = reinterpret_cast<float*>(take(rows_count * d * sizeof(float)));
  acc = reinterpret_cast<float*>(take(rows_count * d * sizeof(float)));
  s = reinterpret_cast<float*>(take(score_tile_floats(rows_count) * sizeof(float)));
  m = reinterpret_cast<float*>(take(rows_count * sizeof(float)));
  l = reinterpret_cast<float*>(take(rows_count * sizeof(float)));
  alpha = reinterpret_cast<float*>(take(rows_count * sizeof(float)));
  rows = reinterpret_cast<RowInfo*>(take(rows_count * sizeof(RowInfo)));
  p = static_cast<unsigned char*>(base) +
      static_cast<std::size_t>(num_heads) * head_state_bytes(d, rows_count);
  kt = reinterpret_cast<float*>(take(d * kTileKeys * sizeof(float)));
  vf = reinterpret_cast<float*>(take(d * kTileKeys * sizeof(float)));
  tmp = reinterpret_cast<float*>(take(d * sizeof(float)));
  ks = take(d * kTileKeys * sizeof(float));
}

std::size_t Scratch::bytes(int head_size, int num_rows, int num_heads) {
  const auto d = static_cast<std::size_t>(head_size);
  return shared_bytes(d) +
         static_cast<std::size_t>(num_heads) * head_state_bytes(d, static_cast<std::size_t>(num_rows));
}

std::size_t partial_row_floats(int head_size) { return static_cast<std::size_t>(head_size) + 2; }

std::size_t scratch_bytes(int head_size, int max_rows, int max_kv_heads) {
  return Scratch::bytes(head_size, max_rows, max_kv_heads);
}

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
      return "avx512bf16";
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2";
    case Isa::Scalar:
      return "scalar";
  }
  return "unknown";
}

std::optional<Isa> parse_isa(std::string_view name) {
  for (Isa isa : kAllIsas) {
    if (isa_name(isa) == name) return isa;
  }
  return std::nullopt;
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas) {
    if (isa_compiled(isa)) out.push_back(isa);
  }
  return out;
}

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas) {
    if (isa_compiled(isa) && cpu_runs(isa)) out.push_back(isa);
  }
  return out;
}

Isa active_isa() { return active_slot().load(std::memory_order_acquire)->isa; }

KeyPacking preferred_key_packing(DType kv_dtype, int head_size) {
  const bool packed_scores =
      active_isa() == Isa::Avx512Bf16 && kv_dtype == DType::FP8_E4M3 && head_size % kDecodeDotChunk == 0;
  return packed_scores ? KeyPacking::Keys16 : KeyPacking::None;
}

bool set_isa(Isa isa) {
  if (!isa_compiled(isa) || !cpu_runs(isa)) return false;
  // One immutable entry per ISA, so a reader's snapshot never changes under it.
  static Active entries[] = {{Isa::Avx512Bf16, {}}, {Isa::Avx512, {}}, {Isa::Avx2, {}}, {Isa::Scalar, {}}};
  Active& entry = entries[static_cast<int>(isa)];
  if (entry.table.run_decode == nullptr) entry.table = kernel_table_for(isa);
  active_slot().store(&entry, std::memory_order_release);
  return true;
}

namespace {

// Runs its scope under the IEEE defaults for SSE/AVX arithmetic, whatever the
// calling thread set (flush-to-zero and denormals-are-zero, as
// torch.set_flush_denormal does, or another rounding mode), and puts the
// caller's mode back: the kernels keep subnormals (the AVX2 e4m3 decode reads
// e4m3 subnormals as float subnormals) and round to nearest.
class IeeeFloatMode {
 public:
#if HWY_ARCH_X86
  IeeeFloatMode() : saved_(_mm_getcsr()) {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_ & ~kModeBits);
  }
  ~IeeeFloatMode() {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_);
  }
#endif
  IeeeFloatMode(const IeeeFloatMode&) = delete;
  IeeeFloatMode& operator=(const IeeeFloatMode&) = delete;

 private:
#if HWY_ARCH_X86
  // MXCSR fields.
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  static constexpr unsigned kRoundingControl = 0x6000;
  static constexpr unsigned kModeBits = kFlushToZero | kDenormalsAreZero | kRoundingControl;
  unsigned saved_;
#endif
};

}  // namespace

KernelTable kernel_table_for(Isa isa) {
  return KernelTable{decode_entry_for(isa), tiles_entry_for(isa), merge_entry_for(isa)};
}

void run_work_item(const AttentionParams& params, const KernelVariant& variant, const WorkItem& item,
                   const PartialState& partials, void* scratch) {
  const IeeeFloatMode mode;
  const KernelTable& table = active_slot().load(std::memory_order_acquire)->table;
  const ItemKernel& kernel = variant.for_rows((item.q_end - item.q_begin) * (params.num_heads / params.num_kv_heads));
  const RunItemFn run = kernel.algorithm == ItemAlgorithm::kDecode ? table.run_decode : table.run_tiles;
  run(params, variant, kernel, item, partials, scratch);
}

void run_merge_item(const AttentionParams& params, const MergeItem& item, const PartialState& partials) {
  const IeeeFloatMode mode;
  active_slot().load(std::memory_order_acquire)->table.run_merge(params, item, partials);
}

}  // namespace pagedattn::cpu_attn
