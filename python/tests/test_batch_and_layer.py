"""pagedattn.BatchAttention (plan once, run per layer) and the layer API
(ModelContext, Attention, Step, KVCacheManager) on NumPy arrays."""

import numpy as np
import pytest

import pagedattn
from reference import paged_attention

TOL = dict(atol=2e-5, rtol=2e-5)


def test_plan_once_run_two_layers_writes_each_layers_keys_and_attends():
    rng = np.random.default_rng(10)
    heads, kv_heads, d, bs, nb = 8, 2, 32, 16, 12
    query_lens, seq_lens = [4, 1], [20, 33]
    qsl = np.array([0, 4, 5], np.int32)
    table = np.array([[3, 7, 0], [1, 5, 9]], np.int32)
    attn = pagedattn.BatchAttention(heads, d, num_kv_heads=kv_heads, dtype="f32", block_size=bs, sliding_window=12)
    assert attn.backend == "CPU_ATTN"
    attn.plan(qsl, np.array(seq_lens, np.int32), table)
    assert attn.num_tokens == 5
    for layer in range(2):
        caches = [rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32) for _ in range(2)]
        q = rng.standard_normal((5, heads, d)).astype(np.float32)
        k = rng.standard_normal((5, kv_heads, d)).astype(np.float32)
        v = rng.standard_normal((5, kv_heads, d)).astype(np.float32)
        out = attn.run(q, k, v, tuple(caches))
        # Request 0's first query token is position 16: block 7 (entry 1), offset 0.
        np.testing.assert_array_equal(caches[0][7, 0], k[0], err_msg=f"layer {layer}")
        np.testing.assert_array_equal(caches[1][9, 0], v[4], err_msg=f"layer {layer}")
        want, _ = paged_attention(q, caches[0], caches[1], query_lens, seq_lens, table, d ** -0.5, window=12)
        np.testing.assert_allclose(out, want, **TOL)


def test_chunked_local_attention_sees_only_the_querys_chunk():
    rng = np.random.default_rng(12)
    heads, kv_heads, d, bs, nb, chunk = 4, 2, 32, 16, 16, 32
    query_lens, seq_lens = [40, 1, 3], [70, 65, 33]
    qsl = np.cumsum([0] + query_lens).astype(np.int32)
    table = rng.permutation(nb)[:15].reshape(3, 5).astype(np.int32)
    caches = [rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((44, heads, d)).astype(np.float32)
    attn = pagedattn.BatchAttention(heads, d, num_kv_heads=kv_heads, dtype="f32", block_size=bs,
                                    attention_chunk_size=chunk)
    attn.plan(qsl, np.array(seq_lens, np.int32), table)
    out = attn.run(q, None, None, tuple(caches))
    want, _ = paged_attention(q, caches[0], caches[1], query_lens, seq_lens, table, d ** -0.5, chunk=chunk)
    np.testing.assert_allclose(out, want, **TOL)
    full, _ = paged_attention(q, caches[0], caches[1], query_lens, seq_lens, table, d ** -0.5)
    assert not np.allclose(out, full, **TOL)  # the chunk hides keys from most queries
    with pytest.raises(ValueError, match="attention_chunk_size"):
        pagedattn.BatchAttention(heads, d, dtype="f32", block_size=bs, attention_chunk_size=24)


def test_prefix_lm_ranges_widen_the_causal_mask_of_the_queries_inside_them():
    rng = np.random.default_rng(13)
    heads, kv_heads, d, bs, nb = 4, 2, 32, 16, 12
    query_lens, seq_lens = [12, 1], [30, 20]
    ranges = [[(16, 24), (26, 30)], [(3, 9)]]  # half-open; request 1's decode (19) is past its range
    qsl = np.cumsum([0] + query_lens).astype(np.int32)
    table = rng.permutation(nb)[:4].reshape(2, 2).astype(np.int32)
    caches = [rng.standard_normal((nb, bs, kv_heads, d)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((13, heads, d)).astype(np.float32)
    attn = pagedattn.BatchAttention(heads, d, num_kv_heads=kv_heads, dtype="f32", block_size=bs, use_mm_prefix=True)
    attn.plan(qsl, np.array(seq_lens, np.int32), table, mm_prefix_ranges=ranges)
    out = attn.run(q, None, None, tuple(caches))
    want, _ = paged_attention(q, caches[0], caches[1], query_lens, seq_lens, table, d ** -0.5, prefix_ranges=ranges)
    np.testing.assert_allclose(out, want, **TOL)
    attn.plan(qsl, np.array(seq_lens, np.int32), table)  # a step without ranges is plain causal
    causal, _ = paged_attention(q, caches[0], caches[1], query_lens, seq_lens, table, d ** -0.5)
    np.testing.assert_allclose(attn.run(q, None, None, tuple(caches)), causal, **TOL)
    assert not np.allclose(want, causal, **TOL)


def test_bad_prefix_lm_ranges_are_rejected():
    qsl, seq_lens, table = [0, 4], [8], [[0]]
    attn = pagedattn.BatchAttention(4, 32, dtype="f32", block_size=16, use_mm_prefix=True)
    with pytest.raises(ValueError, match="one list of \\(start, end\\) pairs per request \\(1\\), got 2"):
        attn.plan(qsl, seq_lens, table, mm_prefix_ranges=[[(0, 2)], []])
    with pytest.raises(ValueError, match="mm_prefix_ranges\\[0\\] must be \\(start, end\\) pairs"):
        attn.plan(qsl, seq_lens, table, mm_prefix_ranges=[[(0, 2, 3)]])
    with pytest.raises(ValueError, match="mm_prefix_ranges\\[0\\] \\(request 0\\)"):
        attn.plan(qsl, seq_lens, table, mm_prefix_ranges=[[(4, 4)]])  # empty
    plain = pagedattn.BatchAttention(4, 32, dtype="f32", block_size=16)
    with pytest.raises(ValueError, match="mm_prefix_ranges must be none for a BatchAttention without use_mm_prefix"):
        plain.plan(qsl, seq_lens, table, mm_prefix_ranges=[[(0, 2)]])
    with pytest.raises(ValueError, match="causal must be true with use_mm_prefix"):
        pagedattn.BatchAttention(4, 32, dtype="f32", causal=False, use_mm_prefix=True)


def test_run_before_plan_and_bad_plans_raise_value_error():
    attn = pagedattn.BatchAttention(4, 32, dtype="f32", block_size=16)
    cache = np.zeros((4, 16, 4, 32), np.float32)
    q = np.zeros((1, 4, 32), np.float32)
    with pytest.raises(ValueError, match="plan"):
        attn.run(q, None, None, (cache, cache))
    with pytest.raises(ValueError, match="seq_lens\\[0\\]"):
        attn.plan([0, 3], [2], [[0]])
    with pytest.raises(ValueError, match="block_table row 0 length"):
        attn.plan([0, 1], [40], [[0, 1]])


def test_batch_invariant_mode_picks_a_batch_invariant_backend():
    assert pagedattn.BatchAttention(4, 32, dtype="f32", batch_invariant=True).backend == "CPU_ATTN"
    with pytest.raises(NotImplementedError, match="batch"):
        pagedattn.BatchAttention(4, 32, dtype="f32", batch_invariant=True, backend="CUDA_FLASH")


def test_unknown_options_and_unsupported_backends_are_reported():
    with pytest.raises(ValueError, match="num_kv_heads"):
        pagedattn.BatchAttention(6, 32, num_kv_heads=4, dtype="f32")
    with pytest.raises(NotImplementedError):
        pagedattn.BatchAttention(4, 32, dtype="f32", device="cpu", backend="CUDA_FLASH")


def test_layer_api_forward_over_a_step_matches_the_oracle():
    rng = np.random.default_rng(11)
    with pagedattn.ModelContext(dtype="f32", device="cpu") as model:  # vLLM's current config
        layers = [pagedattn.Attention(4, 32, 0.2, num_kv_heads=2, block_size=16,
                                      prefix=f"model.layers.{i}.self_attn.attn") for i in range(2)]
    assert model.layer_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    num_blocks, _, _ = pagedattn.allocate_kv_caches(model, 8)
    assert num_blocks == 8
    manager = pagedattn.KVCacheManager(8, 16)
    manager.add_request(1, list(range(20)))
    assert manager.allocate_slots(1, 20)
    blocks = manager.block_table(1)
    step = pagedattn.Step(model, [(20, 20, blocks)], 16)
    assert step.num_tokens == 20
    q = rng.standard_normal((20, 4 * 32)).astype(np.float32)
    k = rng.standard_normal((20, 2 * 32)).astype(np.float32)
    v = rng.standard_normal((20, 2 * 32)).astype(np.float32)
    out = np.asarray(layers[0].forward(step, q, k, v))
    assert out.shape == (20, 128)
    cache = np.asarray(layers[0].kv_cache)  # [2, NB, BS, Hkv, D]
    want, _ = paged_attention(q.reshape(20, 4, 32), cache[0], cache[1], [20], [20], [blocks], 0.2)
    np.testing.assert_allclose(out.reshape(20, 4, 32), want, **TOL)
    np.testing.assert_array_equal(cache[0][blocks[1], 3], k[19].reshape(2, 32))
    assert "num_kv_heads=2" in layers[0].extra_repr()


def test_attention_needs_a_model_and_rejects_a_duplicate_name():
    with pytest.raises(ValueError, match="model"):
        pagedattn.Attention(4, 32, 0.2)
    model = pagedattn.ModelContext(dtype="f32")
    first = pagedattn.Attention(4, 32, 0.2, prefix="a", model=model)  # registered while it lives
    with pytest.raises(ValueError, match="Duplicate layer name"):
        pagedattn.Attention(4, 32, 0.2, prefix="a", model=model)
    with pytest.raises(ValueError, match="num_kv_heads"):
        pagedattn.Attention(4, 32, 0.2, num_kv_heads=3, prefix="b", model=model)
    assert model.layer_names == [first.layer_name]
