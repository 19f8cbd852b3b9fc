// The order of K elements inside a KV cache. A cache half is logically
// [num_blocks, block_size, Hkv, D] and its strides locate a row; a packed K
// half also reorders the elements within each run of kPackedKeyGroup rows of
// one (block, KV head), so a backend can read the keys of a group across
// vector lanes (docs/kv_layouts.md, "Packed K"). Only the cache writer and the
// readers see the packing: every other op (copy_blocks, swaps) moves whole
// blocks and keeps it.
//
// Header-only and free of other pagedattn headers, so kernels may include it.
#pragma once

#include <cstdint>

namespace pagedattn {

enum class KeyPacking : std::uint8_t {
  None,     // row-major: slot s, dimension d at s * slot_stride + d
  Keys16,   // 16-key groups in dimension quads: packed_key_group_offset
};

inline constexpr int kPackedKeyGroup = 16;  // keys (slots) per group
inline constexpr int kPackedDimGroup = 4;   // head dimensions per kPackedGroupBytes bytes

// What a Keys16 group of one (block, KV head) holds per dimension quad: the
// 16 keys' four dimensions, in 4 runs of 4 keys (one 128-bit lane each).
inline constexpr int kPackedKeysPerLane = 4;
inline constexpr int kPackedGroupElements = kPackedKeyGroup * kPackedDimGroup;  // one dimension quad
inline constexpr int kPackedLaneElements = kPackedKeysPerLane * kPackedDimGroup;

// Keys16: element offset of key t (0-15 within its group) and dimension d
// from the group's first element (the row-major position of its first key,
// so rows must be head_size elements apart). Each dimension quad is one run
// of 64 elements; within it, lane t / 4 holds keys 4 (t / 4) .. + 3, first
// their dimension pair (d, d + 1) of the quad, then the second pair, key by
// key. An e4m3 quad thus loads as one 64-byte vector whose two in-lane
// unpacks give one vector per dimension pair with the 16 keys in its lanes.
constexpr std::int64_t packed_key_group_offset(int t, int d) {
  constexpr int kPairs = 2;
  return static_cast<std::int64_t>(d / kPackedDimGroup) * kPackedGroupElements +
         (t / kPackedKeysPerLane) * kPackedLaneElements + (d % kPackedDimGroup / kPairs) * (kPackedLaneElements / kPairs) +
         (t % kPackedKeysPerLane) * kPairs + d % kPairs;
}

// Element offset of (slot, d) of one (block, KV head) from its slot 0, for
// rows head_size elements apart (slot_stride == head_size) under `packing`.
constexpr std::int64_t key_offset_in_block(KeyPacking packing, int slot, int d, int head_size) {
  if (packing == KeyPacking::None) return static_cast<std::int64_t>(slot) * head_size + d;
  const int t = slot % kPackedKeyGroup;
  return static_cast<std::int64_t>(slot - t) * head_size + packed_key_group_offset(t, d);
}

}  // namespace pagedattn
