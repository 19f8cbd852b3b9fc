"""vLLM's kernel-level attention functions, with vLLM's signatures, on
pagedattn's backends. Each picks the backend from the tensors' device (the
selector's first choice: CUDA_FLASH on CUDA, CPU_ATTN on the CPU); the
``backend=`` keyword names one instead. An argument a backend cannot honour
raises ``NotImplementedError`` naming it; a malformed one ``ValueError``.

``unified_attention`` and ``flash_attn_varlen_func`` read the lengths and the
block table on the host (one device-to-host copy per call on CUDA), so they
cannot be captured in a CUDA graph; ``pagedattn.BatchAttention`` plans on the
host once per step and its ``run`` is capturable.
"""

from pagedattn import _pagedattn
from pagedattn._arrays import dtype_name, empty_like, kv_cache_dtype_of, stream_of, view

__all__ = ["flash_attn_varlen_func", "merge_attn_states", "reshape_and_cache_flash", "unified_attention"]


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Stores key/value ``[T, Hkv, D]`` into ``key_cache``/``value_cache``
    ``[num_blocks, block_size, Hkv, D]`` (any strides, last dim contiguous) at
    ``slot_mapping`` ``[N]`` int64 (``block * block_size + offset``; -1 skips).
    With an fp8 ``kv_cache_dtype`` the caches are uint8 or float8 tensors and
    rows are stored as ``x / scale`` (``k_scale``/``v_scale``: ``[1]`` or
    ``[Hkv]`` float32). With ``"int8_per_token_head"`` / ``"fp8_per_token_head"``
    the caches are int8 / float8 (or uint8) tensors and ``k_scale``/``v_scale``
    are the caches' scales, vLLM's ``[num_blocks, block_size, Hkv]`` float32,
    written with each row (one scale per token and KV head: ``amax / 127`` or
    ``/ 448``)."""
    where = "reshape_and_cache_flash"
    if kv_cache_dtype in _PER_TOKEN_HEAD_DTYPES:
        k_scale = _library_scale_layout(where, "k_scale", k_scale, key_cache)
        v_scale = _library_scale_layout(where, "v_scale", v_scale, key_cache)
    _pagedattn.reshape_and_cache_flash(view(key), view(value), view(key_cache), view(value_cache),
                                       slot_mapping, kv_cache_dtype, view(k_scale), view(v_scale),
                                       stream_of(key))


_PER_TOKEN_HEAD_DTYPES = {"int8_per_token_head", "fp8_per_token_head"}


def _library_scale_layout(where, name, scale, cache):
    """vLLM's per-token-head scales ``[num_blocks, block_size, Hkv]`` as the
    library's ``[num_blocks, Hkv, block_size]`` view (dimensions 1 and 2
    swapped; the kernels read it by its strides)."""
    if scale is None:
        return None
    expected = tuple(cache.shape[:3])
    if tuple(scale.shape) != expected:
        raise ValueError(f"{where}: {name} shape must be {list(expected)} ([num_blocks, block_size, Hkv], "
                         f"vLLM's layout), got {list(scale.shape)}")
    return scale.swapaxes(1, 2)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None):
    """Merges two partial results ``[T, H, D]`` with natural-log LSEs
    ``[H, T]`` float32 into ``output`` (and ``output_lse``)."""
    _pagedattn.merge_attn_states(view(output), view(prefix_output), prefix_lse, view(suffix_output), suffix_lse,
                                 output_lse, stream_of(output))


def _window(window_size):
    if window_size is None:
        return -1, -1
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _require_none(where, **kwargs):
    for name, value in kwargs.items():
        if value is not None:
            raise NotImplementedError(f"{where}: {name} is not supported by pagedattn (pass None)")


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, alibi_slopes=None,
                      output_scale=None, qq_bias=None, sinks=None, *, backend=None, **triton_launch_args):
    """vLLM's Triton unified attention: paged ``k``/``v`` caches
    ``[num_blocks, block_size, Hkv, D]`` (bf16/f16, or fp8 as float8 or uint8
    tensors with ``k_descale``/``v_descale``), queries ``q`` ``[T, H, D]``
    split by ``cu_seqlens_q`` ``[B+1]``, key lengths ``seqused_k`` ``[B]``,
    ``block_table`` ``[B, M]`` int32. Writes ``out`` ``[T, H, D]``.

    ``triton_launch_args`` takes the launch tuning and scratch buffers newer
    vLLM versions pass (``seq_threshold_3D``, ``num_par_softmax_segments``,
    ``softmax_segm_output``/``_max``/``_expsum``), which do not change the
    result, and ``kv_quant_mode`` ``INT8_PER_TOKEN_HEAD`` / ``FP8_PER_TOKEN_HEAD``
    with ``k_scale_cache``/``v_scale_cache`` ``[num_blocks, block_size, Hkv]``
    float32 (int8 or float8/uint8 ``k``/``v``; the descales are then unused),
    and ``mm_prefix_range`` (PrefixLM, causal only): ``[B, max_ranges, 2]``
    int32/int64 inclusive ``(first, last)`` positions per request, padded with
    ``(0, 0)`` (pairs with ``first >= last`` are skipped), as a tensor on the
    CPU or the device (read on the host) or a NumPy array; a query inside a
    range also sees the range's later keys. Anything else there is rejected."""
    where = "unified_attention"
    _require_none(where, q_descale=q_descale, output_scale=output_scale, qq_bias=qq_bias)
    kv_cache_dtype = _check_launch_args(where, triton_launch_args) or kv_cache_dtype_of(k)
    left, right = _window(window_size)
    k_scales, v_scales = (_library_scale_layout(where, name, triton_launch_args.get(name), k)
                          for name in ("k_scale_cache", "v_scale_cache"))
    _pagedattn.varlen_attention(
        view(q), view(k), view(v), view(out), None, cu_seqlens_q, None, seqused_k, block_table,
        int(max_seqlen_q), int(max_seqlen_k), softmax_scale, bool(causal), left, right, float(softcap),
        alibi_slopes, sinks, k_descale, v_descale, kv_cache_dtype, k_scales, v_scales,
        triton_launch_args.get("mm_prefix_range"), backend or "", where, stream_of(q))
    return out


_LAUNCH_ONLY_ARGS = {"seq_threshold_3D", "num_par_softmax_segments", "softmax_segm_output", "softmax_segm_max",
                     "softmax_segm_expsum"}
_MODE_ARGS_NONE = {"raw_k", "raw_v"}
# Checked in C++: the scale caches against kv_quant_mode, mm_prefix_range's shape and values.
_CHECKED_IN_CPP_ARGS = {"k_scale_cache", "v_scale_cache", "mm_prefix_range"}
# vLLM's KVQuantMode members pagedattn runs, and the kv_cache_dtype each names (None: the cache tensor's).
_KV_QUANT_MODES = {"NONE": None, "FP8_PER_TENSOR": None, "INT8_PER_TOKEN_HEAD": "int8_per_token_head",
                   "FP8_PER_TOKEN_HEAD": "fp8_per_token_head"}


def _check_launch_args(where, args):
    """Rejects what pagedattn cannot honour; returns the kv_cache_dtype a
    per-token-head kv_quant_mode names, else None."""
    kv_cache_dtype = None
    for name, value in args.items():
        if name in _LAUNCH_ONLY_ARGS or name in _CHECKED_IN_CPP_ARGS:
            continue
        if name in _MODE_ARGS_NONE and value is None:
            continue
        mode = getattr(value, "name", str(value))
        if name == "kv_quant_mode" and mode in _KV_QUANT_MODES:
            kv_cache_dtype = _KV_QUANT_MODES[mode]
            continue
        raise NotImplementedError(f"{where}: argument {name}={value!r} is not supported by pagedattn")
    return kv_cache_dtype


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, num_splits=0, fa_version=None, s_aux=None,
                           cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, *, backend=None):
    """FlashAttention's varlen forward as vLLM's fork extends it.

    ``q`` ``[total_q, H, D]``; either dense ``k``/``v`` ``[total_k, Hkv, D]``
    with ``cu_seqlens_k`` ``[B+1]``, or paged caches ``[num_blocks,
    block_size, Hkv, D]`` with ``block_table`` ``[B, M]`` and ``seqused_k``
    ``[B]``. Causal masks are bottom-right aligned; ``window_size=(left,
    right)`` (-1 = unbounded) applies to causal attention; ``softcap`` > 0
    caps logits; ``alibi_slopes`` ``[H]``; ``s_aux`` ``[H]`` are sink logits.
    Returns ``out`` ``[total_q, H, D]``, or ``(out, lse)`` with ``lse``
    ``[H, total_q]`` float32 (natural log) when ``return_softmax_lse``.
    ``deterministic``, ``num_splits`` and ``fa_version`` are accepted: the
    forward is deterministic and its split is pagedattn's own plan."""
    where = "flash_attn_varlen_func"
    if dropout_p != 0.0:
        raise NotImplementedError(f"{where}: dropout_p={dropout_p} (pagedattn has no dropout; pass 0.0)")
    if return_attn_probs:
        raise NotImplementedError(f"{where}: return_attn_probs=True (pagedattn never forms the probabilities)")
    if cp_world_size != 1 or cp_rank != 0:
        raise NotImplementedError(f"{where}: context parallelism (cp_world_size={cp_world_size}, cp_rank={cp_rank}); "
                                  "pagedattn's DCP runs through its C++ parallel API")
    _require_none(where, q_v=q_v, scheduler_metadata=scheduler_metadata, q_descale=q_descale,
                  cp_tot_seqused_k=cp_tot_seqused_k)
    if (cu_seqlens_k is None) == (seqused_k is None):
        raise ValueError(f"{where}: exactly one of cu_seqlens_k (dense k/v) and seqused_k (paged k/v) must be given")
    left, right = _window(window_size)
    if out is None:
        out = empty_like(q, tuple(q.shape), dtype_name(q))
    lse = None
    if return_softmax_lse:
        lse = empty_like(q, (q.shape[1], q.shape[0]), "f32")
    _pagedattn.varlen_attention(
        view(q), view(k), view(v), view(out), lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
        int(max_seqlen_q), int(max_seqlen_k), softmax_scale, bool(causal), left, right, float(softcap or 0.0),
        alibi_slopes, s_aux, k_descale, v_descale, kv_cache_dtype_of(k), None, None, None, backend or "", where,
        stream_of(q))
    return (out, lse) if return_softmax_lse else out

