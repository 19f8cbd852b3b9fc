// The CPU_ATTN plan. The work list (make_work_list), which the metadata
// builder makes once per step and every layer's forward runs: a pure function
// of the batch shape (tile sizes and split points are fixed constants, so a
// request's result never depends on the other requests in the batch or on the
// thread count; the backend's determinism and batch-invariance claims rest on
// this). And which kernel runs each item (choose_kernel_variant), chosen once
// per forward call from the layer, the cache and the ISA.
#pragma once

#include "backends/cpu_attn/cpu_attn_workspace.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

#include <cstdint>
#include <span>
#include <vector>

namespace pagedattn::cpu_attn {

// Query tokens per prefill work item. With GQA group G a tile has 16 G rows,
// enough to amortize packing K/V tiles over the rows.
inline constexpr int kQueryTileTokens = 16;
// Requests with at most this many query tokens (decodes, short speculative
// steps) are split along their keys so that all threads share long sequences.
inline constexpr int kSplitMaxQueryTokens = 8;
// Keys per split: small enough that one 8k decode gives 6 independent pieces
// and a 2k one (the conformance grid's longest) still splits in two; large
// enough that what each split costs (item setup, its first tile's cold
// reads, its share of the merge) stays small: at 1024 it measured 5-10% of
// an 8k decode (docs/cpu_attn.md).
inline constexpr int kSplitKeys = 1536;

struct WorkList {
  std::vector<WorkItem> items;    // costliest first (a better dynamic schedule)
  std::vector<MergeItem> merges;  // run after every item
  std::int64_t partial_tokens = 0;  // partial-state token slots the splits write
  int max_item_tokens = 0;          // most query tokens of one item
  int max_item_kv_heads = 1;        // most KV heads of one item
};

// query_start_loc [B+1] and seq_lens [B] (key counts) on the host. Items of
// requests that are split (decodes) cover as many KV heads together as leave
// at least `min_items` such items, so one core reads whole blocks of a
// head-major cache; the grouping changes no result, only the order of reads.
WorkList make_work_list(std::span<const std::int32_t> query_start_loc, std::span<const std::int32_t> seq_lens,
                        int num_kv_heads, bool causal, int min_items);

// The workspace a forward call of `plan` needs for a layer of `head_size` and
// `group` query heads per KV head, on `thread_slots` threads.
WorkspaceSize plan_workspace(const WorkList& plan, int head_size, int group, int thread_slots);

// The kernels `isa` runs the items of a forward call with: `params` as the
// kernel will read them (dtypes, head size, K/V source, strides, K packing).
// Only kernels that `isa` compiles and runs are named.
KernelVariant choose_kernel_variant(const AttentionParams& params, Isa isa);

}  // namespace pagedattn::cpu_attn
