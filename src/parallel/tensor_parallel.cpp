// Tensor-parallel head sharding (vLLM's per-rank num_heads / num_kv_heads).
#include <fmt/format.h>
#include <pagedattn/parallel.h>

#include <type_traits>

namespace pagedattn {

TensorParallelShard shard_heads(int num_heads, int num_kv_heads, int tp_size, int tp_rank) {
  constexpr std::string_view where = "shard_heads";
  check_arg(num_heads >= 1, where, "num_heads", ">= 1", num_heads);
  check_arg(num_kv_heads >= 1, where, "num_kv_heads", ">= 1", num_kv_heads);
  check_arg(num_heads % num_kv_heads == 0, where, "num_heads",
            fmt::format("a multiple of num_kv_heads ({})", num_kv_heads), num_heads);
  check_arg(tp_size >= 1, where, "tp_size", ">= 1", tp_size);
  check_arg(tp_rank >= 0 && tp_rank < tp_size, where, "tp_rank", fmt::format("in [0, {}) (tp_size)", tp_size),
            tp_rank);
  check_arg(num_heads % tp_size == 0, where, "tp_size", fmt::format("a divisor of num_heads ({})", num_heads),
            tp_size);
  check_arg(num_kv_heads % tp_size == 0 || tp_size % num_kv_heads == 0, where, "tp_size",
            fmt::format("a divisor or a multiple of num_kv_heads ({})", num_kv_heads), tp_size);

  TensorParallelShard s;
  s.tp_size = tp_size;
  s.tp_rank = tp_rank;
  s.total_num_heads = num_heads;
  s.total_num_kv_heads = num_kv_heads;
  s.num_heads = num_heads / tp_size;
  s.first_head = tp_rank * s.num_heads;
  if (tp_size <= num_kv_heads) {
    s.num_kv_heads = num_kv_heads / tp_size;
    s.first_kv_head = tp_rank * s.num_kv_heads;
    s.kv_head_replicas = 1;
  } else {
    // Each KV head serves tp_size / num_kv_heads consecutive ranks; their
    // query heads all fall in that KV head's group.
    s.num_kv_heads = 1;
    s.kv_head_replicas = tp_size / num_kv_heads;
    s.first_kv_head = tp_rank / s.kv_head_replicas;
  }
  return s;
}

KVCacheSpec shard_kv_cache_spec(const KVCacheSpec& spec, const TensorParallelShard& shard) {
  return std::visit(
      [&](const auto& s) -> KVCacheSpec {
        check_arg(s.num_kv_heads == shard.total_num_kv_heads, "shard_kv_cache_spec", "spec.num_kv_heads",
                  fmt::format("{} (the shard's total_num_kv_heads)", shard.total_num_kv_heads),
                  s.num_kv_heads);
        std::remove_cvref_t<decltype(s)> local = s;
        local.num_kv_heads = shard.num_kv_heads;
        return local;
      },
      spec);
}

}  // namespace pagedattn
