"""pagedattn.ops on NumPy arrays (the CPU backends) against the float64
oracle, and the errors the functions raise for what they cannot honour."""

import enum

import ml_dtypes
import numpy as np
import pytest

import pagedattn
from pagedattn import ops
from reference import paged_attention

BF16 = ml_dtypes.bfloat16
F32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=1.5e-2, rtol=1e-2)


def make_paged(rng, seqs, heads, kv_heads, head_size, block_size, num_blocks, dtype=np.float32):
    query_lens = [q for q, _ in seqs]
    kv_lens = [k for _, k in seqs]
    q = rng.standard_normal((sum(query_lens), heads, head_size)).astype(dtype)
    kc = rng.standard_normal((num_blocks, block_size, kv_heads, head_size)).astype(dtype)
    vc = rng.standard_normal((num_blocks, block_size, kv_heads, head_size)).astype(dtype)
    max_blocks = max((k + block_size - 1) // block_size for k in kv_lens)
    table = rng.permutation(num_blocks)[: len(seqs) * max_blocks].reshape(len(seqs), max_blocks).astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return q, kc, vc, cu_q, np.array(kv_lens, dtype=np.int32), table


SEQS = [[(1, 40), (5, 18), (17, 63)], [(1, 23), (1, 7), (1, 61)]]


@pytest.mark.parametrize("seqs", SEQS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (16, None), (None, 30.0)])
@pytest.mark.parametrize("backend", [None, "REFERENCE"])
def test_unified_attention_matches_the_oracle(seqs, heads, window, soft_cap, backend):
    rng = np.random.default_rng(0)
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, heads[0], heads[1], 32, 16, 64)
    out = np.full_like(q, np.nan)
    scale = 32 ** -0.5
    ops.unified_attention(q, kc, vc, out, cu_q, max(s for s, _ in seqs), kv_lens, int(kv_lens.max()), scale, True,
                          (window - 1, 0) if window else (-1, -1), table, soft_cap or 0, None, None, None,
                          backend=backend)
    want, _ = paged_attention(q, kc, vc, [s for s, _ in seqs], kv_lens, table, scale, window=window,
                              soft_cap=soft_cap)
    np.testing.assert_allclose(out, want, **F32_TOL)


def test_unified_attention_with_sinks_and_alibi():
    rng = np.random.default_rng(1)
    seqs = [(3, 20), (1, 33)]
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, 4, 2, 32, 16, 16)
    sinks = rng.standard_normal(4).astype(np.float32)
    alibi = (rng.random(4) * 0.1).astype(np.float32)
    out = np.empty_like(q)
    ops.unified_attention(q, kc, vc, out, cu_q, 3, kv_lens, 33, 0.2, True, (-1, -1), table, 0, None, None, None,
                          alibi_slopes=alibi, sinks=sinks)
    want, _ = paged_attention(q, kc, vc, [3, 1], kv_lens, table, 0.2, alibi=alibi, sinks=sinks)
    np.testing.assert_allclose(out, want, **F32_TOL)


# vLLM's mm_prefix_range: [B, max_ranges, 2] inclusive (first, last) pairs,
# padded with (0, 0). Request 0's prefill (positions 46..62) holds two ranges;
# request 1's (13..17) one range starting in its context, after a one-token
# pair (5, 5) that adds nothing; request 2's decode (39) is past its range.
MM_PREFIX_SEQS = [(17, 63), (5, 18), (1, 40)]
MM_PREFIX_RANGE = [[(50, 55), (58, 61), (0, 0)], [(5, 5), (10, 16), (0, 0)], [(20, 30), (0, 0), (0, 0)]]
MM_PREFIX_HALF_OPEN = [[(50, 56), (58, 62)], [(10, 17)], [(20, 31)]]


def mm_prefix_attention(seqs, mm_prefix_range, window=None, backend=None, causal=True):
    rng = np.random.default_rng(3)
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, 4, 2, 32, 16, 16)
    out = np.full_like(q, np.nan)
    ops.unified_attention(q, kc, vc, out, cu_q, max(s for s, _ in seqs), kv_lens, int(kv_lens.max()), 0.2, causal,
                          (window - 1, 0) if window else (-1, -1), table, 0, None, None, None, backend=backend,
                          mm_prefix_range=mm_prefix_range)
    return out, (q, kc, vc, kv_lens, table)


@pytest.mark.parametrize("range_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("backend", [None, "REFERENCE"])
def test_unified_attention_mm_prefix_range_matches_the_oracle(range_dtype, window, backend):
    out, (q, kc, vc, kv_lens, table) = mm_prefix_attention(
        MM_PREFIX_SEQS, np.array(MM_PREFIX_RANGE, range_dtype), window, backend)
    query_lens = [s for s, _ in MM_PREFIX_SEQS]
    want, _ = paged_attention(q, kc, vc, query_lens, kv_lens, table, 0.2, window=window,
                              prefix_ranges=MM_PREFIX_HALF_OPEN)
    np.testing.assert_allclose(out, want, **F32_TOL)
    causal, _ = paged_attention(q, kc, vc, query_lens, kv_lens, table, 0.2, window=window)
    assert not np.allclose(out, causal, **F32_TOL)  # queries inside a range see its later keys


def test_unified_attention_rejects_a_bad_mm_prefix_range():
    overlapping = [[(50, 55), (55, 61), (0, 0)], [(0, 0)] * 3, [(0, 0)] * 3]
    for bad, match in [
            (overlapping, r"mm_prefix_ranges\[1\] \(request 0\) must be \[start, end\) with 56 <= start"),
            ([[(50, 70)], [(0, 0)], [(0, 0)]], r"<= seq_lens\[0\] \(63\)"),
            ([[(-3, 7)], [(0, 0)], [(0, 0)]], r"mm_prefix_range\[0, 0\] must be \(first, last\) with 0 <= first"),
            (np.zeros((2, 1, 2), np.int32), r"mm_prefix_range size\(0\) must be the number of requests \(3\), got 2"),
            (np.zeros((3, 1, 3), np.int32), r"mm_prefix_range size\(2\) must be 2, got 3"),
            (np.zeros((3, 1, 2), np.float32), r"mm_prefix_range dtype must be int32 or int64, got f32")]:
        with pytest.raises(ValueError, match=match):
            mm_prefix_attention(MM_PREFIX_SEQS, np.asarray(bad, np.int32) if isinstance(bad, list) else bad)
    with pytest.raises(ValueError, match="mm_prefix_range must be None with causal=False"):
        mm_prefix_attention(MM_PREFIX_SEQS, np.array(MM_PREFIX_RANGE, np.int32), causal=False)


def test_flash_attn_varlen_func_dense_kv_returns_output_and_lse():
    rng = np.random.default_rng(2)
    q_lens, k_lens = [3, 1, 6], [5, 9, 6]
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(np.float32)
    k = rng.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    v = rng.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    cu_q = np.cumsum([0] + q_lens).astype(np.int32)
    cu_k = np.cumsum([0] + k_lens).astype(np.int32)
    out, lse = ops.flash_attn_varlen_func(q, k, v, 6, cu_q, 9, cu_seqlens_k=cu_k, causal=True,
                                          return_softmax_lse=True)
    # The oracle reads the dense rows as one block per key.
    table = np.zeros((3, 9), dtype=np.int32)
    for r in range(3):
        table[r, : k_lens[r]] = np.arange(cu_k[r], cu_k[r + 1])
    want, want_lse = paged_attention(q, k[:, None], v[:, None], q_lens, k_lens, table, 32 ** -0.5)
    np.testing.assert_allclose(out, want, **F32_TOL)
    np.testing.assert_allclose(lse, want_lse, **F32_TOL)


def test_flash_attn_varlen_func_paged_bf16_with_window_and_sinks():
    rng = np.random.default_rng(3)
    seqs = [(4, 50), (1, 17)]
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, 4, 1, 64, 32, 8, dtype=BF16)
    sinks = rng.standard_normal(4).astype(np.float32)
    out = ops.flash_attn_varlen_func(q, kc, vc, 4, cu_q, 50, seqused_k=kv_lens, block_table=table, causal=True,
                                     window_size=(9, 0), s_aux=sinks, softmax_scale=0.125)
    assert out.dtype == BF16
    want, _ = paged_attention(q, kc, vc, [4, 1], kv_lens, table, 0.125, window=10, sinks=sinks)
    np.testing.assert_allclose(out.astype(np.float32), want, **BF16_TOL)


def test_reshape_and_cache_flash_writes_rows_at_their_slots_and_skips_padding():
    rng = np.random.default_rng(4)
    key = rng.standard_normal((3, 2, 16)).astype(np.float32)
    value = rng.standard_normal((3, 2, 16)).astype(np.float32)
    kc = np.zeros((4, 8, 2, 16), dtype=np.float32)
    vc = np.zeros_like(kc)
    slots = np.array([9, -1, 31], dtype=np.int64)
    ops.reshape_and_cache_flash(key, value, kc, vc, slots, "auto", np.ones(1, np.float32), np.ones(1, np.float32))
    np.testing.assert_array_equal(kc[1, 1], key[0])
    np.testing.assert_array_equal(vc[3, 7], value[2])
    assert np.count_nonzero(kc) == 2 * key[0].size


def test_fp8_cache_written_and_read_through_uint8_bytes():
    rng = np.random.default_rng(5)
    seqs = [(2, 24)]
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, 4, 2, 32, 16, 4)
    k8 = np.zeros(kc.shape, dtype=np.uint8)
    v8 = np.zeros(vc.shape, dtype=np.uint8)
    slots = np.arange(4 * 16, dtype=np.int64)
    k_scale = np.array([0.5], dtype=np.float32)
    v_scale = np.array([0.25], dtype=np.float32)
    ops.reshape_and_cache_flash(kc.reshape(-1, 2, 32), vc.reshape(-1, 2, 32), k8, v8, slots, "fp8", k_scale, v_scale)
    # The stored bytes are e4m3 values of x / scale.
    np.testing.assert_allclose(k8.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 0.5, kc, atol=0.07, rtol=0.07)
    out = np.empty_like(q)
    ops.unified_attention(q, k8, v8, out, cu_q, 2, kv_lens, 24, 0.2, True, (-1, -1), table, 0, None,
                          np.full((1, 2), 0.5, np.float32), np.full((1, 2), 0.25, np.float32))
    want, _ = paged_attention(q, kc, vc, [2], kv_lens, table, 0.2)
    np.testing.assert_allclose(out, want, atol=0.1, rtol=0.1)


class KVQuantMode(enum.IntEnum):
    """vLLM's vllm.v1.kv_cache_interface.KVQuantMode (unified_attention reads its name)."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3


# fp8 caches travel as uint8 bytes (NumPy's DLPack has no float8), read as e4m3.
@pytest.mark.parametrize("mode,qmax,storage,read_as", [("INT8_PER_TOKEN_HEAD", 127.0, np.int8, np.int8),
                                                       ("FP8_PER_TOKEN_HEAD", 448.0, np.uint8, ml_dtypes.float8_e4m3fn)])
@pytest.mark.parametrize("backend", [None, "REFERENCE"])
def test_per_token_head_cache_written_and_read_with_its_scales(mode, qmax, storage, read_as, backend):
    rng = np.random.default_rng(7)
    seqs = [(1, 20), (3, 30)]
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, seqs, 8, 2, 32, 16, 4)
    kq = np.zeros(kc.shape, dtype=storage)
    vq = np.zeros(vc.shape, dtype=storage)
    k_scales = np.zeros(kc.shape[:3], dtype=np.float32)  # [num_blocks, block_size, Hkv], vLLM's layout
    v_scales = np.zeros_like(k_scales)
    slots = np.arange(4 * 16, dtype=np.int64)
    kv_dtype = mode.lower()
    head_major = np.zeros(k_scales.transpose(0, 2, 1).shape, dtype=np.float32)  # the library's own layout
    with pytest.raises(ValueError, match=r"k_scale shape must be \[4, 16, 2\] \(\[num_blocks, block_size, Hkv\], "
                                         r"vLLM's layout\), got \[4, 2, 16\]"):
        ops.reshape_and_cache_flash(kc.reshape(-1, 2, 32), vc.reshape(-1, 2, 32), kq, vq, slots, kv_dtype,
                                    head_major, v_scales)
    ops.reshape_and_cache_flash(kc.reshape(-1, 2, 32), vc.reshape(-1, 2, 32), kq, vq, slots, kv_dtype, k_scales,
                                v_scales)
    # One scale per (token, KV head): the row's amax maps to qmax.
    np.testing.assert_allclose(k_scales, np.abs(kc).max(axis=-1) / qmax, rtol=1e-6)
    k_read = kq.view(read_as).astype(np.float32) * k_scales[..., None]
    v_read = vq.view(read_as).astype(np.float32) * v_scales[..., None]
    np.testing.assert_allclose(k_read, kc, atol=0.5 * k_scales.max() if storage == np.int8 else 0.1, rtol=0.07)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match=r"v_scale_cache shape must be \[4, 16, 2\]"):
        ops.unified_attention(q, kq, vq, out, cu_q, 3, kv_lens, 30, 0.2, True, (-1, -1), table, 0, None, None,
                              None, backend=backend, kv_quant_mode=KVQuantMode[mode],
                              k_scale_cache=k_scales, v_scale_cache=head_major)
    ops.unified_attention(q, kq, vq, out, cu_q, 3, kv_lens, 30, 0.2, True, (-1, -1), table, 0, None, None, None,
                          backend=backend, kv_quant_mode=KVQuantMode[mode],
                          k_scale_cache=k_scales, v_scale_cache=v_scales)
    want, _ = paged_attention(q, k_read, v_read, [1, 3], kv_lens, table, 0.2)
    np.testing.assert_allclose(out, want, **F32_TOL)


def test_merge_attn_states_matches_attention_over_the_union():
    rng = np.random.default_rng(6)
    t, h, d = 5, 4, 16
    pre, suf = rng.standard_normal((2, t, h, d)).astype(np.float32)
    pre_lse, suf_lse = rng.standard_normal((2, h, t)).astype(np.float32)
    out = np.empty_like(pre)
    out_lse = np.empty_like(pre_lse)
    ops.merge_attn_states(out, pre, pre_lse, suf, suf_lse, out_lse)
    m = np.maximum(pre_lse, suf_lse)
    wp, ws = np.exp(pre_lse - m), np.exp(suf_lse - m)
    want = (pre * wp.T[:, :, None] + suf * ws.T[:, :, None]) / (wp + ws).T[:, :, None]
    np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(out_lse, m + np.log(wp + ws), atol=1e-6, rtol=1e-5)


def test_bad_arguments_raise_and_change_nothing():
    rng = np.random.default_rng(7)
    q, kc, vc, cu_q, kv_lens, table = make_paged(rng, [(2, 20)], 4, 2, 32, 16, 4)
    out = np.full_like(q, 7.0)
    with pytest.raises(ValueError, match="block_table row 0 length"):
        ops.unified_attention(q, kc, vc, out, cu_q, 2, kv_lens, 20, 0.2, True, (-1, -1), table[:, :1], 0, None,
                              None, None)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        ops.unified_attention(q, kc, vc, out, cu_q, 2, kv_lens, 10, 0.2, True, (-1, -1), table, 0, None, None, None)
    with pytest.raises(NotImplementedError, match="qq_bias"):
        ops.unified_attention(q, kc, vc, out, cu_q, 2, kv_lens, 20, 0.2, True, (-1, -1), table, 0, None, None, None,
                              qq_bias=np.zeros((2, 2), np.float32))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        ops.flash_attn_varlen_func(q, kc, vc, 2, cu_q, 20, seqused_k=kv_lens, block_table=table, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="window_size"):
        ops.flash_attn_varlen_func(q, kc, vc, 2, cu_q, 20, seqused_k=kv_lens, block_table=table, causal=False,
                                   window_size=(4, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.flash_attn_varlen_func(q, kc, vc, 2, cu_q, 20, seqused_k=kv_lens, block_table=table, backend="NOPE")
    np.testing.assert_array_equal(out, np.full_like(q, 7.0))
    kc_before = kc.copy()
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache_flash(q[:, :2], q[:, :2], kc, vc, np.array([0, 4096], np.int64), "auto", None, None)
    np.testing.assert_array_equal(kc, kc_before)


def test_package_reports_its_backends():
    assert "CPU_ATTN" in pagedattn.backends() and "REFERENCE" in pagedattn.backends()
    assert pagedattn.__version__
