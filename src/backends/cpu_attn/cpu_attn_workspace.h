// The memory a CPU_ATTN forward call works in: per pool thread one work item's
// scratch, and the step's split-KV partial states. The metadata builder sizes
// and allocates it for its step (CpuAttnMetadata owns it), so forward
// allocates nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

namespace pagedattn::cpu_attn {

struct WorkspaceSize {
  std::size_t scratch_bytes = 0;   // per thread slot: one work item's scratch (scratch_bytes())
  int thread_slots = 1;            // threads that may run items at once
  std::size_t partial_floats = 0;  // the split partials (PartialState)

  // Whether a workspace of this size holds one of `need` (its slots aside:
  // a forward call runs on at most as many threads as there are slots).
  bool holds(const WorkspaceSize& need) const {
    return scratch_bytes >= need.scratch_bytes && partial_floats >= need.partial_floats;
  }
};

class Workspace {
 public:
  // Throws OutOfMemory when the allocation fails.
  explicit Workspace(const WorkspaceSize& size);
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const WorkspaceSize& size() const { return size_; }
  // kScratchAlignment-aligned scratch of thread slot `slot` (< thread_slots).
  void* scratch(int slot) const { return data_.get() + static_cast<std::size_t>(slot) * slot_stride_; }
  float* partials() const { return reinterpret_cast<float*>(data_.get() + partials_offset_); }

  // Held by a forward call while it works in the workspace: two calls at once
  // on the same metadata would share it, so the second one throws
  // InvalidArgument (a step's layers run one after another).
  class Use {
   public:
    explicit Use(const Workspace& workspace);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    const Workspace& workspace_;
  };

 private:
  struct Free {
    void operator()(unsigned char* p) const;
  };

  WorkspaceSize size_;
  std::size_t slot_stride_ = 0;
  std::size_t partials_offset_ = 0;
  std::unique_ptr<unsigned char[], Free> data_;
  mutable std::atomic<bool> in_use_{false};
};

}  // namespace pagedattn::cpu_attn
