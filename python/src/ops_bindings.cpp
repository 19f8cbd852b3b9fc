// The kernel-level functions pagedattn.ops wraps with vLLM's signatures
// (python/pagedattn/ops.py): the cache write, the state merge and the varlen
// attention behind unified_attention / flash_attn_varlen_func.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <pagedattn/ops.h>

#include "bindings.h"
#include "tensor_arg.h"
#include "varlen_attention.h"

namespace pagedattn::python {
namespace {

void reshape_and_cache_flash(nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
                             nb::handle slot_mapping, const std::string& kv_cache_dtype, nb::handle k_scale,
                             nb::handle v_scale, std::optional<std::uintptr_t> stream) {
  constexpr std::string_view where = "reshape_and_cache_flash";
  const TensorView k = view_of(key, where, "key");
  const CacheDType cache_dtype = cache_dtype_arg(kv_cache_dtype, where, "kv_cache_dtype");
  const DType storage = kv_cache_storage_dtype(cache_dtype, k.dtype());
  StreamScope scope(k.device(), stream, key);
  reshape_and_cache(k, view_of(value, where, "value"),
                    reinterpret(view_of(key_cache, where, "key_cache"), storage, where, "key_cache"),
                    reinterpret(view_of(value_cache, where, "value_cache"), storage, where, "value_cache"),
                    view_of(slot_mapping, where, "slot_mapping"), cache_dtype, view_of(k_scale, where, "k_scale"),
                    view_of(v_scale, where, "v_scale"));
}

void merge_states(nb::handle output, nb::handle prefix_output, nb::handle prefix_lse,
                  nb::handle suffix_output, nb::handle suffix_lse, nb::handle output_lse,
                  std::optional<std::uintptr_t> stream) {
  constexpr std::string_view where = "merge_attn_states";
  const TensorView out = view_of(output, where, "output");
  StreamScope scope(out.device(), stream, output);
  merge_attn_states(out, view_of(prefix_output, where, "prefix_output"), view_of(prefix_lse, where, "prefix_lse"),
                    view_of(suffix_output, where, "suffix_output"), view_of(suffix_lse, where, "suffix_lse"),
                    view_of(output_lse, where, "output_lse"));
}

std::string varlen(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                   nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k,
                   nb::handle block_table, long max_seqlen_q, long max_seqlen_k,
                   std::optional<float> softmax_scale, bool causal, long window_left, long window_right,
                   float softcap, nb::handle alibi_slopes, nb::handle sinks, nb::handle k_descale,
                   nb::handle v_descale, const std::string& kv_cache_dtype, nb::handle k_scale_cache,
                   nb::handle v_scale_cache, nb::handle mm_prefix_range, const std::string& backend,
                   const std::string& where, std::optional<std::uintptr_t> stream) {
  VarlenArgs a;
  a.q = view_of(q, where, "q");
  a.k = view_of(k, where, "k");
  a.v = view_of(v, where, "v");
  a.out = view_of(out, where, "out");
  a.lse = view_of(lse, where, "softmax_lse");
  a.cu_seqlens_q = view_of(cu_seqlens_q, where, "cu_seqlens_q");
  a.cu_seqlens_k = view_of(cu_seqlens_k, where, "cu_seqlens_k");
  a.seqused_k = view_of(seqused_k, where, "seqused_k");
  a.block_table = view_of(block_table, where, "block_table");
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  a.softmax_scale = softmax_scale;
  a.causal = causal;
  a.window_left = window_left;
  a.window_right = window_right;
  a.softcap = softcap;
  a.alibi_slopes = view_of(alibi_slopes, where, "alibi_slopes");
  a.sinks = view_of(sinks, where, "sinks");
  a.k_descale = view_of(k_descale, where, "k_descale");
  a.v_descale = view_of(v_descale, where, "v_descale");
  a.kv_cache_dtype = cache_dtype_arg(kv_cache_dtype, where, "kv_cache_dtype");
  a.k_scale_cache = view_of(k_scale_cache, where, "k_scale_cache");
  a.v_scale_cache = view_of(v_scale_cache, where, "v_scale_cache");
  a.mm_prefix_range = view_of(mm_prefix_range, where, "mm_prefix_range");
  a.backend = backend;
  StreamScope scope(a.q.device(), stream, q);
  varlen_attention(std::move(a), where);
  return last_varlen_backend();
}

}  // namespace

void register_ops(nb::module_& m) {
  using nb::arg;
  m.def("reshape_and_cache_flash", &reshape_and_cache_flash, arg("key"), arg("value"), arg("key_cache"),
        arg("value_cache"), arg("slot_mapping"), arg("kv_cache_dtype"), arg("k_scale").none(),
        arg("v_scale").none(), arg("stream").none() = nb::none(),
        "Stores key/value [T, Hkv, D] into the paged caches [NB, BS, Hkv, D] at slot_mapping [N] i64 (-1 skips); "
        "per-token-head kv_cache_dtypes write k_scale / v_scale [NB, Hkv, BS] f32.");
  m.def("merge_attn_states", &merge_states, arg("output"), arg("prefix_output"), arg("prefix_lse"),
        arg("suffix_output"), arg("suffix_lse"), arg("output_lse").none() = nb::none(), arg("stream").none() = nb::none(),
        "Merges two partial attention results [T, H, D] by their LSE [H, T].");
  m.def("varlen_attention", &varlen, arg("q"), arg("k"), arg("v"), arg("out"), arg("lse").none(),
        arg("cu_seqlens_q"), arg("cu_seqlens_k").none(), arg("seqused_k").none(), arg("block_table").none(),
        arg("max_seqlen_q"), arg("max_seqlen_k"), arg("softmax_scale").none(), arg("causal"),
        arg("window_left"), arg("window_right"), arg("softcap"), arg("alibi_slopes").none(),
        arg("sinks").none(), arg("k_descale").none(), arg("v_descale").none(), arg("kv_cache_dtype"),
        arg("k_scale_cache").none(), arg("v_scale_cache").none(), arg("mm_prefix_range").none(),
        arg("backend"), arg("where"), arg("stream").none() = nb::none(),
        "FlashAttention varlen attention over a paged or dense KV; returns the backend that ran it.");
}

}  // namespace pagedattn::python
