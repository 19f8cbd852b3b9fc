// The NCCL communicator: ncclAllGather of raw bytes on a CUDA stream. Without
// NCCL in the build (PAGEDATTN_HAVE_NCCL = 0) the factories throw Unsupported.
#include <fmt/format.h>
#include <pagedattn/parallel.h>

#if PAGEDATTN_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#endif

namespace pagedattn {

#if PAGEDATTN_HAVE_NCCL

namespace {

void check_nccl(ncclResult_t result, std::string_view call) {
  if (result != ncclSuccess) {
    throw Error(ErrorKind::Device,
                fmt::format("{}: {} ({})", call, ncclGetErrorString(result), static_cast<int>(result)));
  }
}

void check_cuda(cudaError_t result, std::string_view call) {
  if (result != cudaSuccess) {
    throw Error(ErrorKind::Device, fmt::format("{}: {}", call, cudaGetErrorString(result)));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclUniqueId& id, int size, int rank, int device, void* stream)
      : size_(size), rank_(rank), device_(device), stream_(static_cast<cudaStream_t>(stream)) {
    ncclUniqueId nccl_id;
    static_assert(sizeof(nccl_id.internal) == std::tuple_size_v<NcclUniqueId>);
    std::memcpy(nccl_id.internal, id.data(), id.size());
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_nccl(ncclCommInitRank(&comm_, size, nccl_id, rank), "ncclCommInitRank");
  }
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  void do_all_gather(const TensorView& send, const TensorView& recv) override {
    constexpr std::string_view where = "NcclCommunicator::all_gather";
    check_device(send, where, "send", Device::cuda(device_));
    // Data movement only: bytes keep every dtype (fp8 and bf16 included) exact.
    const std::size_t bytes = static_cast<std::size_t>(send.numel()) * send.element_size();
    check_nccl(ncclAllGather(send.data(), recv.data(), bytes, ncclUint8, comm_, stream_), "ncclAllGather");
  }

 private:
  int size_;
  int rank_;
  int device_;
  cudaStream_t stream_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }

NcclUniqueId make_nccl_unique_id() {
  ncclUniqueId nccl_id;
  check_nccl(ncclGetUniqueId(&nccl_id), "ncclGetUniqueId");
  NcclUniqueId id;
  std::memcpy(id.data(), nccl_id.internal, id.size());
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int size, int rank, int device,
                                                     void* stream) {
  constexpr std::string_view where = "make_nccl_communicator";
  check_arg(size >= 1, where, "size", ">= 1", size);
  check_arg(rank >= 0 && rank < size, where, "rank", fmt::format("in [0, {}) (size)", size), rank);
  check_arg(device >= 0, where, "device", ">= 0", device);
  return std::make_unique<NcclCommunicator>(id, size, rank, device, stream);
}

#else

bool nccl_available() { return false; }

NcclUniqueId make_nccl_unique_id() {
  throw_unsupported("make_nccl_unique_id", "this build has no NCCL (configure with CUDA and NCCL found)");
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& /*id*/, int /*size*/, int /*rank*/,
                                                     int /*device*/, void* /*stream*/) {
  throw_unsupported("make_nccl_communicator", "this build has no NCCL (configure with CUDA and NCCL found)");
}

#endif

}  // namespace pagedattn
