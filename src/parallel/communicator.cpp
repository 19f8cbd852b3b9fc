// The Communicator front-end checks and the in-process loopback group.
#include <fmt/format.h>
#include <pagedattn/parallel.h>

#include <barrier>
#include <memory>
#include <optional>

namespace pagedattn {

void Communicator::all_gather(const TensorView& send, const TensorView& recv) {
  constexpr std::string_view where = "Communicator::all_gather";
  if (!send.defined()) throw_invalid(where, "send", "a defined tensor", "undefined");
  if (!recv.defined()) throw_invalid(where, "recv", "a defined tensor", "undefined");
  check_arg(send.is_contiguous(), where, "send", "contiguous", send.describe());
  check_arg(recv.is_contiguous(), where, "recv", "contiguous", recv.describe());
  check_dtype(recv, where, "recv", send.dtype());
  check_device(recv, where, "recv", send.device());
  check_rank(recv, where, "recv", send.dim() + 1);
  check_size(recv, 0, where, "recv", size());
  for (int d = 0; d < send.dim(); ++d) check_size(recv, d + 1, where, "recv", send.size(d));
  do_all_gather(send, recv);
}

// Ranks publish their send view, meet at a barrier, copy every published view
// into their own recv, and meet again so no send buffer is reused early.
struct LoopbackGroup::State {
  explicit State(int n) : size(n), barrier(n), published(static_cast<std::size_t>(n)) {}

  class Rank final : public Communicator {
   public:
    Rank(State& state, int rank) : state_(state), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return state_.size; }

   protected:
    void do_all_gather(const TensorView& send, const TensorView& recv) override {
      state_.published[static_cast<std::size_t>(rank_)] = send;
      state_.barrier.arrive_and_wait();
      // Every rank sees the same published views, so a mismatch makes all of
      // them skip the copies and throw after the second barrier (no rank may
      // publish again while another still reads).
      std::optional<Error> mismatch;
      for (int r = 0; r < state_.size && !mismatch; ++r) {
        const TensorView& other = state_.published[static_cast<std::size_t>(r)];
        if (other.shape() != send.shape() || other.dtype() != send.dtype()) {
          mismatch.emplace(
              ErrorKind::InvalidArgument,
              fmt::format("LoopbackGroup all_gather: rank {} send must be {} {} (as on rank {}), got {} {}",
                          r, dtype_name(send.dtype()), send.shape().str(), rank_, dtype_name(other.dtype()),
                          other.shape().str()));
        }
      }
      if (!mismatch) {
        for (int r = 0; r < state_.size; ++r) {
          copy_tensor(recv.select(0, r), state_.published[static_cast<std::size_t>(r)]);
        }
      }
      state_.barrier.arrive_and_wait();
      if (mismatch) throw *mismatch;
    }

   private:
    State& state_;
    int rank_;
  };

  int size;
  std::barrier<> barrier;
  std::vector<TensorView> published;
  std::vector<std::unique_ptr<Rank>> ranks;
};

LoopbackGroup::LoopbackGroup(int size) {
  check_arg(size >= 1, "LoopbackGroup", "size", ">= 1", size);
  state_ = std::make_unique<State>(size);
  for (int r = 0; r < size; ++r) state_->ranks.push_back(std::make_unique<State::Rank>(*state_, r));
}

LoopbackGroup::~LoopbackGroup() = default;

int LoopbackGroup::size() const { return state_->size; }

Communicator& LoopbackGroup::communicator(int rank) {
  check_arg(rank >= 0 && rank < state_->size, "LoopbackGroup::communicator", "rank",
            fmt::format("in [0, {}) (size)", state_->size), rank);
  return *state_->ranks[static_cast<std::size_t>(rank)];
}

}  // namespace pagedattn
