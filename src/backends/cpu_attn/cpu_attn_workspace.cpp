#include "backends/cpu_attn/cpu_attn_workspace.h"

#include <pagedattn/error.h>

#include <new>

namespace pagedattn::cpu_attn {

namespace {

std::size_t align_up(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

}  // namespace

Workspace::Workspace(const WorkspaceSize& size)
    : size_(size),
      slot_stride_(align_up(size.scratch_bytes)),
      partials_offset_(slot_stride_ * static_cast<std::size_t>(size.thread_slots)) {
  const std::size_t bytes = partials_offset_ + size.partial_floats * sizeof(float);
  if (bytes == 0) return;
  data_.reset(static_cast<unsigned char*>(
      ::operator new[](bytes, std::align_val_t{kScratchAlignment}, std::nothrow)));
  if (!data_)
    throw Error(ErrorKind::OutOfMemory, fmt::format("CPU_ATTN builder: {} bytes of workspace", bytes));
}

void Workspace::Free::operator()(unsigned char* p) const {
  ::operator delete[](p, std::align_val_t{kScratchAlignment});
}

Workspace::Use::Use(const Workspace& workspace) : workspace_(workspace) {
  check_arg(!workspace_.in_use_.exchange(true, std::memory_order_acquire), "CPU_ATTN forward", "metadata",
            "metadata no other forward call is using", "metadata in use by another forward call");
}

Workspace::Use::~Use() { workspace_.in_use_.store(false, std::memory_order_release); }

}  // namespace pagedattn::cpu_attn
