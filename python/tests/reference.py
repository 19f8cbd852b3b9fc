"""The pytest suite's oracle: paged attention in float64 NumPy, written the
obvious way (one request, one head at a time) with FlashAttention's
semantics: causal masks bottom-right aligned, a left window of W keys
(p - W < j <= p), chunked local attention (j // C == p // C), soft cap,
ALiBi (slope * (j - p)) and sink logits in the softmax denominator, and
PrefixLM ranges (per request half-open (s, e) pairs: a query at s <= p < e
also sees every key s <= j < e, whatever the causal mask and window say).
Returns the output [T, H, D] and the LSE [H, T]."""

import numpy as np


def gather(cache, blocks, length):
    """The first `length` rows [length, Hkv, D] of a request's blocks."""
    rows = np.concatenate([cache[b] for b in blocks], axis=0) if len(blocks) else cache[:0].reshape(
        (0,) + cache.shape[2:])
    return rows[:length]


def paged_attention(q, key_cache, value_cache, query_lens, kv_lens, block_table, scale, *, causal=True,
                    window=None, soft_cap=None, alibi=None, sinks=None, chunk=None, prefix_ranges=None):
    q = np.asarray(q, dtype=np.float64)
    kc = np.asarray(key_cache, dtype=np.float64)
    vc = np.asarray(value_cache, dtype=np.float64)
    total, heads, dim = q.shape
    kv_heads = kc.shape[2]
    block_size = kc.shape[1]
    group = heads // kv_heads
    out = np.zeros((total, heads, dim))
    lse = np.full((heads, total), -np.inf)
    start = 0
    for r, (q_len, kv_len) in enumerate(zip(query_lens, kv_lens)):
        blocks = list(block_table[r][: (kv_len + block_size - 1) // block_size])
        k = gather(kc, blocks, kv_len)
        v = gather(vc, blocks, kv_len)
        for i in range(q_len):
            p = kv_len - q_len + i  # the query's position among the keys
            t = start + i
            j = np.arange(kv_len)
            visible = np.ones(kv_len, dtype=bool)
            if causal:
                visible &= j <= p
            if window is not None:
                visible &= j > p - window
            if chunk is not None:
                visible &= j // chunk == p // chunk
            for s_start, s_end in (prefix_ranges[r] if prefix_ranges is not None else []):
                if s_start <= p < s_end:
                    visible |= (j >= s_start) & (j < s_end)
            for h in range(heads):
                s = scale * (k[:, h // group, :] @ q[t, h])
                if soft_cap:
                    s = soft_cap * np.tanh(s / soft_cap)
                if alibi is not None:
                    s = s + alibi[h] * (j - p)
                s = np.where(visible, s, -np.inf)
                terms = [s]
                if sinks is not None:
                    terms.append(np.array([sinks[h]], dtype=np.float64))
                m = max(np.max(x) if x.size else -np.inf for x in terms)
                if not np.isfinite(m):
                    continue
                e = np.exp(s - m)
                denom = e.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
                out[t, h] = (e @ v[:, h // group, :]) / denom
                lse[h, t] = m + np.log(denom)
        start += q_len
    return out, lse
