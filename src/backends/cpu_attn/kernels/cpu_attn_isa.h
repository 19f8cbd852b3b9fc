// Instruction-set selection of the CPU_ATTN kernels. The kernels are compiled
// once per Highway target; this picks the table that runs. Process-wide:
// the best ISA the CPU supports unless set_isa() chose another one.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace pagedattn::cpu_attn {

// Best first. Avx512Bf16 is the AVX-512 code with its bf16 x bf16 dot
// products done by the AVX512-BF16 instruction (vdpbf16ps); needs AVX512-VBMI too.
enum class Isa : std::uint8_t { Avx512Bf16, Avx512, Avx2, Scalar };

// "avx512bf16", "avx512", "avx2", "scalar" (the portable HWY_SCALAR target).
std::string_view isa_name(Isa isa);
std::optional<Isa> parse_isa(std::string_view name);

// ISAs compiled into this build, best first.
std::vector<Isa> compiled_isas();
// Compiled ISAs this CPU can run, best first (never empty: Scalar always runs).
std::vector<Isa> available_isas();

// The ISA the kernels use now.
Isa active_isa();
// Selects `isa` for every later kernel call; false (and no change) when this
// CPU or build cannot run it. Not synchronized with running kernels: call it
// between forward calls.
bool set_isa(Isa isa);

}  // namespace pagedattn::cpu_attn
