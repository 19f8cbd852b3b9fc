// pagedattn.BatchAttention's C++ half: construction from keyword options,
// plan() from host int32 arrays, run() on the caller's stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>
#include <pagedattn/batch_attention.h>

#include <chrono>

#include "bindings.h"
#include "tensor_arg.h"

namespace pagedattn::python {
namespace {

constexpr std::string_view kPlanWhere = "BatchAttention.plan";
constexpr std::string_view kRunWhere = "BatchAttention.run";

std::span<const std::int32_t> host_span(nb::handle a, std::string_view name, int rank) {
  const TensorView t = view_of(a, kPlanWhere, name);
  check_rank(t, kPlanWhere, name, rank);
  check_dtype(t, kPlanWhere, name, DType::I32);
  check_device(t, kPlanWhere, name, Device::cpu());
  check_arg(t.is_contiguous(), kPlanWhere, fmt::format("{} layout", name), "contiguous (row-major)", t.describe());
  return {static_cast<const std::int32_t*>(t.data()), static_cast<std::size_t>(t.numel())};
}

BatchAttentionOptions make_options(int num_heads, int head_size, std::optional<int> num_kv_heads,
                                   std::optional<float> scale, const std::string& dtype,
                                   const std::string& kv_cache_dtype, int block_size,
                                   const std::string& device, bool causal, std::optional<int> sliding_window,
                                   std::optional<float> logits_soft_cap, std::vector<float> alibi_slopes,
                                   std::vector<float> sinks, std::optional<int> attention_chunk_size,
                                   bool use_mm_prefix, bool batch_invariant, bool cascade,
                                   const std::string& backend, int max_num_reqs, int max_num_tokens,
                                   int max_blocks_per_req) {
  constexpr std::string_view where = "BatchAttention";
  BatchAttentionOptions o;
  o.num_heads = num_heads;
  o.head_size = head_size;
  o.num_kv_heads = num_kv_heads.value_or(0);
  o.scale = scale;
  o.dtype = dtype_arg(dtype, where);
  o.kv_cache_dtype = cache_dtype_arg(kv_cache_dtype, where, "kv_cache_dtype");
  o.block_size = block_size;
  o.device = device_arg(device, where);
  o.causal = causal;
  o.sliding_window = sliding_window;
  o.logits_soft_cap = logits_soft_cap;
  o.alibi_slopes = std::move(alibi_slopes);
  o.sinks = std::move(sinks);
  o.attention_chunk_size = attention_chunk_size;
  o.use_mm_prefix = use_mm_prefix;
  o.batch_invariant = batch_invariant;
  o.cascade = cascade;
  o.backend = backend;
  o.max_num_reqs = max_num_reqs;
  o.max_num_tokens = max_num_tokens;
  o.max_blocks_per_req = max_blocks_per_req;
  return o;
}

void plan(BatchAttention& self, nb::handle query_start_loc, nb::handle seq_lens, nb::handle block_table,
          nb::handle mm_prefix_range_start_loc, nb::handle mm_prefix_ranges,
          std::optional<std::uintptr_t> stream) {
  const std::span<const std::int32_t> table = host_span(block_table, "block_table", 2);
  const std::int64_t stride = view_of(block_table, kPlanWhere, "block_table").size(1);
  const auto qsl = host_span(query_start_loc, "query_start_loc", 1);
  const auto lens = host_span(seq_lens, "seq_lens", 1);
  std::span<const std::int32_t> range_start_loc;
  std::span<const std::int32_t> ranges;
  if (!mm_prefix_range_start_loc.is_none()) {
    range_start_loc = host_span(mm_prefix_range_start_loc, "mm_prefix_range_start_loc", 1);
    ranges = host_span(mm_prefix_ranges, "mm_prefix_ranges", 1);
  }
  StreamScope scope(self.impl_params().device, stream, nb::handle());
  self.plan(qsl, lens, table, stride, range_start_loc, ranges);
}

void run(BatchAttention& self, nb::handle q, nb::handle k, nb::handle v, nb::handle key_cache,
         nb::handle value_cache, nb::handle out, nb::handle lse, nb::handle k_scale,
         nb::handle v_scale, std::optional<std::uintptr_t> stream) {
  const DType storage = kv_cache_storage_dtype(self.impl_params().kv_cache_dtype, self.impl_params().dtype);
  const KVCacheView cache{reinterpret(view_of(key_cache, kRunWhere, "key_cache"), storage, kRunWhere, "key_cache"),
                          reinterpret(view_of(value_cache, kRunWhere, "value_cache"), storage, kRunWhere,
                                      "value_cache")};
  StreamScope scope(self.impl_params().device, stream, q);
  self.run(view_of(q, kRunWhere, "q"), view_of(k, kRunWhere, "k"), view_of(v, kRunWhere, "v"), cache,
           view_of(out, kRunWhere, "out"), view_of(lse, kRunWhere, "lse"), view_of(k_scale, kRunWhere, "k_scale"),
           view_of(v_scale, kRunWhere, "v_scale"));
}

// Host seconds per run() call over `iterations` calls made from C++: the
// baseline the Python call's overhead is measured against (python/bench/).
double time_runs(BatchAttention& self, nb::handle q, nb::handle key_cache, nb::handle value_cache,
                 nb::handle out, int iterations, std::optional<std::uintptr_t> stream) {
  check_arg(iterations > 0, "BatchAttention._time_runs", "iterations", "> 0", iterations);
  const TensorView query = view_of(q, kRunWhere, "q");
  const KVCacheView cache{view_of(key_cache, kRunWhere, "key_cache"), view_of(value_cache, kRunWhere, "value_cache")};
  const TensorView output = view_of(out, kRunWhere, "out");
  StreamScope scope(self.impl_params().device, stream, q);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) self.run(query, {}, {}, cache, output);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / iterations;
}

}  // namespace

void register_batch(nb::module_& m) {
  using nb::arg;
  nb::class_<BatchAttention>(m, "BatchAttention",
                             "Plan once per step (host lengths and block table), run per layer.")
      .def(
          "__init__",
          [](BatchAttention* self, int num_heads, int head_size, std::optional<int> num_kv_heads,
             std::optional<float> scale, const std::string& dtype, const std::string& kv_cache_dtype,
             int block_size, const std::string& device, bool causal, std::optional<int> sliding_window,
             std::optional<float> logits_soft_cap, std::vector<float> alibi_slopes, std::vector<float> sinks,
             std::optional<int> attention_chunk_size, bool use_mm_prefix, bool batch_invariant, bool cascade,
             const std::string& backend, int max_num_reqs, int max_num_tokens, int max_blocks_per_req) {
            new (self) BatchAttention(
                make_options(num_heads, head_size, num_kv_heads, scale, dtype, kv_cache_dtype, block_size,
                             device, causal, sliding_window, logits_soft_cap, std::move(alibi_slopes),
                             std::move(sinks), attention_chunk_size, use_mm_prefix, batch_invariant, cascade,
                             backend, max_num_reqs, max_num_tokens, max_blocks_per_req));
          },
          arg("num_heads"), arg("head_size"), nb::kw_only(), arg("num_kv_heads").none() = nb::none(),
          arg("scale").none() = nb::none(), arg("dtype") = "bf16", arg("kv_cache_dtype") = "auto",
          arg("block_size") = 16, arg("device") = "cpu", arg("causal") = true,
          arg("sliding_window").none() = nb::none(), arg("logits_soft_cap").none() = nb::none(),
          arg("alibi_slopes") = std::vector<float>{}, arg("sinks") = std::vector<float>{},
          arg("attention_chunk_size").none() = nb::none(), arg("use_mm_prefix") = false,
          arg("batch_invariant") = false, arg("cascade") = true, arg("backend") = "", arg("max_num_reqs") = 0,
          arg("max_num_tokens") = 0, arg("max_blocks_per_req") = 0)
      .def("plan", &plan, arg("query_start_loc"), arg("seq_lens"), arg("block_table"),
           arg("mm_prefix_range_start_loc").none() = nb::none(), arg("mm_prefix_ranges").none() = nb::none(),
           arg("stream").none() = nb::none(),
           "query_start_loc [B+1], seq_lens [B], block_table [B, M]: int32 host arrays; PrefixLM ranges as "
           "CSR "
           "(mm_prefix_range_start_loc [B+1], mm_prefix_ranges [R*2] half-open pairs) or None.")
      .def("run", &run, arg("q"), arg("k").none(), arg("v").none(), arg("key_cache"), arg("value_cache"),
           arg("out"), arg("lse").none() = nb::none(), arg("k_scale").none() = nb::none(),
           arg("v_scale").none() = nb::none(), arg("stream").none() = nb::none(),
           "Writes k/v (when given) at the plan's slots, then attends into out.")
      .def("_time_runs", &time_runs, arg("q"), arg("key_cache"), arg("value_cache"), arg("out"),
           arg("iterations"), arg("stream").none() = nb::none())
      .def_prop_ro("backend", [](const BatchAttention& self) { return std::string(self.backend().name()); })
      .def_prop_ro("num_tokens", &BatchAttention::num_tokens)
      .def_prop_ro("used_cascade", &BatchAttention::used_cascade)
      .def_prop_ro("block_size", &BatchAttention::block_size);
}

}  // namespace pagedattn::python
