// Attention across several ranks (docs/parallel.md): tensor-parallel head
// sharding, and vLLM's decode context parallelism (DCP), where every sequence's
// KV cache is spread over the ranks of a group and the ranks' partial results
// are merged by their log-sum-exp after an all-gather.
//
// Core code: it drives backends only through Attention and the op front-ends.
#pragma once

#include <pagedattn/attention.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace pagedattn {

// ------------------------------------------------------- tensor parallel ----

// One rank's share of a layer's heads under tensor parallelism (vLLM's
// Attention built with num_heads / tp and max(1, num_kv_heads / tp)).
// Query heads are split evenly; KV heads are split when tp <= num_kv_heads
// and replicated over tp / num_kv_heads consecutive ranks otherwise.
struct TensorParallelShard {
  int tp_size = 1;
  int tp_rank = 0;
  int total_num_heads = 0;
  int total_num_kv_heads = 0;
  int num_heads = 0;         // query heads on this rank
  int num_kv_heads = 0;      // KV heads on this rank
  int first_head = 0;        // global index of the rank's first query head
  int first_kv_head = 0;     // global index of the rank's first KV head
  int kv_head_replicas = 1;  // ranks holding each KV head (1 unless tp > num_kv_heads)

  // Global query heads [first_head, first_head + num_heads).
  int end_head() const { return first_head + num_heads; }
  int end_kv_head() const { return first_kv_head + num_kv_heads; }
};

// Throws InvalidArgument naming the argument when num_heads or num_kv_heads
// is < 1, num_heads % num_kv_heads != 0, tp_size < 1, tp_rank outside
// [0, tp_size), num_heads % tp_size != 0, or tp_size neither divides nor is a
// multiple of num_kv_heads.
TensorParallelShard shard_heads(int num_heads, int num_kv_heads, int tp_size, int tp_rank);

// The rank's KV-cache spec: `spec` (made for all total_num_kv_heads heads)
// with the rank's num_kv_heads; its page_size_bytes() is the rank's bytes per
// block. Throws InvalidArgument when spec's num_kv_heads is not the shard's total.
KVCacheSpec shard_kv_cache_spec(const KVCacheSpec& spec, const TensorParallelShard& shard);

// ---------------------------------------------------------- communicator ----

// A group of ranks exchanging device buffers. Collective calls must be made by
// every rank of the group, in the same order, with equal shapes and dtypes.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Gathers every rank's `send` into `recv`, in rank order.
  //   send  [...]           contiguous, any dtype
  //   recv  [size, ...]     contiguous, send's dtype and device; recv[r] = rank r's send
  // Throws InvalidArgument (before communicating) when the shapes, dtypes or
  // devices disagree.
  void all_gather(const TensorView& send, const TensorView& recv);

 protected:
  virtual void do_all_gather(const TensorView& send, const TensorView& recv) = 0;
};

// In-process ranks (threads of one process sharing memory): a barrier-based
// loopback group for tests and for one-device runs. Each rank's communicator
// must be used by one thread at a time; buffers may be on any device the
// allocator can reach (copies go through copy_tensor).
class LoopbackGroup {
 public:
  // Throws InvalidArgument on size < 1.
  explicit LoopbackGroup(int size);
  ~LoopbackGroup();
  LoopbackGroup(const LoopbackGroup&) = delete;
  LoopbackGroup& operator=(const LoopbackGroup&) = delete;

  int size() const;
  // Throws InvalidArgument on a rank outside [0, size).
  Communicator& communicator(int rank);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// NCCL (ncclAllGather on a CUDA stream). Present only in builds with CUDA and
// NCCL; elsewhere nccl_available() is false and the two factories throw
// Unsupported.
bool nccl_available();
// ncclUniqueId's bytes: rank 0 makes it and ships it to the other ranks.
using NcclUniqueId = std::array<char, 128>;
NcclUniqueId make_nccl_unique_id();
// Joins the group as `rank` of `size` on CUDA device `device`; collectives are
// enqueued on `stream` (a cudaStream_t; null = the legacy default stream) and
// do not synchronize with the host. Blocks until every rank has joined.
// Throws Device on an NCCL or CUDA failure.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int size, int rank, int device,
                                                     void* stream = nullptr);

// ---------------------------------------------- decode context parallelism ----

// A DCP group: its `size` ranks take turns holding runs of `interleave`
// consecutive tokens of every sequence (vLLM's decode_context_parallel_size
// and cp_kv_cache_interleave_size).
struct DcpConfig {
  int size = 1;
  int rank = 0;
  int interleave = 1;
};

// Throws InvalidArgument on size < 1, rank outside [0, size), interleave < 1,
// or (when block_size > 0) block_size % interleave != 0.
void validate_dcp_config(const DcpConfig& dcp, std::string_view where, int block_size = 0);

// Rank storing sequence position `position`: (position / interleave) % size.
int dcp_owner_rank(std::int64_t position, const DcpConfig& dcp);
// Index of `position` among the positions its owner stores:
// (position / (interleave * size)) * interleave + position % interleave.
std::int64_t dcp_local_position(std::int64_t position, const DcpConfig& dcp);
// How many of positions [0, seq_len) dcp.rank stores (vLLM's get_dcp_local_seq_lens).
int dcp_local_seq_len(int seq_len, const DcpConfig& dcp);

// dcp.rank's slots of positions [first, first + count) of one request:
// kPadSlotId where another rank owns the position, otherwise
// blocks[p / (block_size * size)] * block_size + dcp_local_position(p) % block_size.
// `blocks` is the request's block-table row, shared by every rank of the group:
// entry b stands for positions [b * block_size * size, (b + 1) * block_size * size)
// and each rank keeps its share of them in its own physical block of that id.
std::vector<std::int64_t> dcp_slots_for_positions(std::span<const std::int32_t> blocks, int block_size,
                                                  int first, int count, const DcpConfig& dcp);

// One rank's share of a step. Every global query token with at least one
// visible key on this rank becomes a single-query request whose keys are the
// rank's visible keys: with a causal mask, query position p sees
// dcp_local_seq_len(p + 1) local keys; without it, dcp_local_seq_len(seq_len).
// Tokens with no visible local key are left out (their partial output is zero
// and their partial LSE -inf). A token the rank owns always has one (itself),
// so every token this rank must store is among the local rows. A rank can
// have no local row at all (short sequences, large interleave): its metadata
// is then left empty and must not be built, but the rank still joins the merge.
struct DcpLocalBatch {
  DcpConfig dcp;
  int num_tokens = 0;                    // global query tokens of the step
  std::vector<std::int32_t> token_rows;  // [T_local] global query row of each local row
  // Device copies for the index_select op, uploaded once with the metadata:
  Tensor token_rows_index;  // [T_local] i32: token_rows
  Tensor local_row_index;   // [T] i32: the local row of each global token, -1 where none
  CommonAttentionMetadata metadata;  // [T_local] rows; slot_mapping = this rank's slots or -1
  bool empty() const { return token_rows.empty(); }
};

// `requests` as for make_common_metadata, with blocks addressing
// block_size * dcp.size positions each (see dcp_slots_for_positions);
// `options.block_size` is the physical block size of every rank's cache;
// every tensor of the batch is on `options.device`.
// Throws InvalidArgument on a bad DcpConfig, on options.num_padded_slots != 0,
// and on whatever make_common_metadata rejects.
DcpLocalBatch make_dcp_local_batch(std::span<const RequestSpec> requests, const MetadataOptions& options,
                                   const DcpConfig& dcp);

// Buffers of dcp_merge, sized for one step.
struct DcpMergeWorkspace {
  Tensor gathered_output;  // [size, T, H, D] output dtype
  Tensor gathered_lse;     // [size, H, T] f32
  Tensor merged_lse;       // [H, T] f32 (the running LSE alternates with gathered_lse[0])

  static DcpMergeWorkspace allocate(int size, std::int64_t num_tokens, std::int64_t num_heads,
                                    std::int64_t head_size, DType dtype, Device device);
};

// Every buffer of one rank's DCP step, for steps of up to max_tokens query
// tokens: allocated once, so that a step allocates nothing. Each buffer is
// flat; a step uses its leading part, viewed with the step's token count.
struct DcpWorkspace {
  int dcp_size = 1;
  std::int64_t max_tokens = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_size = 0;
  DType dtype = DType::BF16;  // the layer's activation dtype (query, key, value, output)
  Device device{};
  Tensor local_query;      // [max_tokens * H * D]     the rank's query rows
  Tensor local_key;        // [max_tokens * Hkv * D]
  Tensor local_value;      // [max_tokens * Hkv * D]
  Tensor local_output;     // [max_tokens * H * D]     attention over the rank's keys
  Tensor local_lse;        // [H * max_tokens] f32
  Tensor partial_output;   // [max_tokens * H * D]     local rows scattered to every token
  Tensor partial_lse;      // [H * max_tokens] f32
  Tensor gathered_output;  // [dcp_size * max_tokens * H * D]
  Tensor gathered_lse;     // [dcp_size * H * max_tokens] f32
  Tensor merged_lse;       // [H * max_tokens] f32

  // Sized for `layer` (its heads, head size and activation dtype) on `device`.
  // Throws InvalidArgument on dcp_size < 1 or max_tokens < 1.
  static DcpWorkspace allocate(const Attention& layer, int dcp_size, std::int64_t max_tokens, Device device);
  // dcp_merge's buffers for a step of num_tokens tokens: views of this
  // workspace. Throws InvalidArgument when num_tokens exceeds max_tokens.
  DcpMergeWorkspace merge_workspace(std::int64_t num_tokens) const;
};

// All-gathers every rank's partial result over `comm` and merges them with
// merge_attn_states in rank order 0, 1, ..., so every rank ends with the same
// full result, bit for bit.
//   local_output  [T, H, D]   contiguous: attention over this rank's keys
//   local_lse     [H, T] f32  contiguous: -inf where this rank saw no key
//   output        [T, H, D]   local_output's dtype; may be local_output itself
//   output_lse    [H, T] f32  or undefined
// Throws InvalidArgument on mismatched shapes, dtypes, devices or workspace.
void dcp_merge(Communicator& comm, const TensorView& local_output, const TensorView& local_lse,
               const DcpMergeWorkspace& workspace, const TensorView& output,
               const TensorView& output_lse = {});

// One rank's partial result of a step: views into the workspace.
struct DcpPartial {
  TensorView output;  // [T, H, D] contiguous; zero where the rank saw no key
  TensorView lse;     // [H, T] f32 contiguous; -inf where the rank saw no key
};

// The first half of dcp_attention_forward: stores the key/value rows this
// rank owns into `layer`'s cache and computes attention over the rank's keys
// for batch.token_rows, gathering those rows of query/key/value and
// scattering the result back to every token with the index_select op (one
// launch each, no host read). Allocates nothing. Arguments as for
// dcp_attention_forward.
DcpPartial dcp_local_attention(Attention& layer, const DcpLocalBatch& batch, const DcpWorkspace& workspace,
                               const TensorView& query, const TensorView& key, const TensorView& value);

// One rank's DCP attention for one step: dcp_local_attention, then dcp_merge.
// The caller installs a forward context whose metadata for `layer` was built
// from batch.metadata (none is read when the batch is empty). Allocates
// nothing: every buffer is in `workspace`.
//   query   [T, H, D]     every query token of the step, as on one rank
//   key     [T, Hkv, D]   every key of the step (the rank keeps those it owns)
//   value   [T, Hkv, D]
//   output  [T, H, D]     query dtype
//   lse     [H, T] f32    or undefined
// Throws Unsupported for layers with sliding windows, ALiBi or sinks (their
// masks and sink term need global positions, which the local requests do not
// carry), and InvalidArgument when comm and batch.dcp disagree, or when the
// tensors do not match the layer, the batch or the workspace.
void dcp_attention_forward(Attention& layer, const DcpLocalBatch& batch, Communicator& comm,
                           const DcpWorkspace& workspace, const TensorView& query, const TensorView& key,
                           const TensorView& value, const TensorView& output, const TensorView& lse = {});

// The same with a workspace allocated for this step (convenient, but the
// allocation makes it unfit for CUDA graph capture).
void dcp_attention_forward(Attention& layer, const DcpLocalBatch& batch, Communicator& comm,
                           const TensorView& query, const TensorView& key, const TensorView& value,
                           const TensorView& output, const TensorView& lse = {});

}  // namespace pagedattn
