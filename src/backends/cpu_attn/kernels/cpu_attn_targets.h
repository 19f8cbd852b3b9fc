// The Highway targets CPU_ATTN compiles: AVX-512, AVX2 and the portable
// HWY_SCALAR (this toolchain's baseline fallback). Every file that compiles
// per target or reads HWY_TARGETS includes this first, before Highway.
#pragma once

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4 | HWY_AVX3_DL)
#endif
