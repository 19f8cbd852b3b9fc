"""FlashInfer-style plan/run over pagedattn's backends."""

from pagedattn import _pagedattn
from pagedattn._arrays import direct, dtype_arg, dtype_name, empty_like, stream_of, view


def _host_i32(x, name):
    """x as a contiguous int32 host array (lists, NumPy arrays, CPU tensors)."""
    import numpy as np

    if hasattr(x, "is_cuda") and x.is_cuda:
        raise ValueError(f"BatchAttention.plan: {name} must be on the host (plan runs on the CPU), got {x.device}")
    if hasattr(x, "numpy"):
        x = x.numpy()
    return np.ascontiguousarray(x, dtype=np.int32)


def _ranges_csr(mm_prefix_ranges, num_reqs):
    """Per-request lists of half-open (start, end) pairs as CSR int32 arrays:
    offsets ``[B+1]`` and the pairs flattened ``[R*2]``."""
    import numpy as np

    where = "BatchAttention.plan"
    if len(mm_prefix_ranges) != num_reqs:
        raise ValueError(f"{where}: mm_prefix_ranges must hold one list of (start, end) pairs per request "
                         f"({num_reqs}), got {len(mm_prefix_ranges)}")
    pairs = []
    for r, ranges in enumerate(mm_prefix_ranges):
        a = np.asarray(ranges, dtype=np.int32)
        if a.size and (a.ndim != 2 or a.shape[1] != 2):
            raise ValueError(f"{where}: mm_prefix_ranges[{r}] must be (start, end) pairs, shape [n, 2], "
                             f"got shape {list(a.shape)}")
        pairs.append(a.reshape(-1, 2))
    start_loc = np.cumsum([0] + [len(p) for p in pairs]).astype(np.int32)
    return start_loc, np.ascontiguousarray(np.concatenate(pairs).reshape(-1), dtype=np.int32)


class BatchAttention:
    """Attention over paged KV caches, planned once per step and run per layer.

    ``plan(query_start_loc, seq_lens, block_table)`` takes host arrays (vLLM's
    metadata: ``[B+1]``, ``[B]``, ``[B, M]`` int32) and uploads the step's
    plan; every ``run`` of the step reuses it. ``run(q, k, v, kv_cache)``
    writes ``k``/``v`` (the step's rows, or None when already cached) at the
    step's slots and attends. With ``max_num_reqs``, ``max_num_tokens`` and
    ``max_blocks_per_req`` set, every device array the plan writes stays at
    one address: a ``run`` captured in a CUDA graph replays any later plan
    with the same number of tokens.

    With ``use_mm_prefix`` (PrefixLM, vLLM's ``use_mm_prefix``; causal only),
    ``plan(..., mm_prefix_ranges=...)`` takes per request a list of half-open
    ``(start, end)`` position pairs, sorted and disjoint within the sequence:
    a query inside a range also sees the range's later keys.
    """

    def __init__(self, num_heads, head_size, *, num_kv_heads=None, scale=None, dtype="bf16", kv_cache_dtype="auto",
                 block_size=16, device="cpu", causal=True, sliding_window=None, logits_soft_cap=None,
                 alibi_slopes=None, sinks=None, attention_chunk_size=None, use_mm_prefix=False, batch_invariant=False,
                 cascade=True, backend=None, max_num_reqs=0, max_num_tokens=0, max_blocks_per_req=0):
        dtype = dtype_arg(dtype)
        self._device = str(device)
        self._impl = _pagedattn.BatchAttention(
            num_heads, head_size, num_kv_heads=num_kv_heads, scale=scale, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, device=self._device, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            alibi_slopes=[float(a) for a in alibi_slopes] if alibi_slopes is not None else [],
            sinks=[float(s) for s in sinks] if sinks is not None else [], attention_chunk_size=attention_chunk_size,
            use_mm_prefix=use_mm_prefix, batch_invariant=batch_invariant, cascade=cascade, backend=backend or "",
            max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, max_blocks_per_req=max_blocks_per_req)

    @property
    def backend(self) -> str:
        """The backend the selector chose (or the one named)."""
        return self._impl.backend

    @property
    def used_cascade(self) -> bool:
        """Whether the last plan is a cascade (its requests share a long prefix; pagedattn.cascade docs)."""
        return self._impl.used_cascade

    @property
    def num_tokens(self) -> int:
        """Query tokens of the last plan."""
        return self._impl.num_tokens

    def plan(self, query_start_loc, seq_lens, block_table, mm_prefix_ranges=None):
        """Plans a step; not capturable (it runs on the host and uploads).
        ``mm_prefix_ranges``: None, or per request a list of half-open
        ``(start, end)`` pairs (``use_mm_prefix`` wrappers only)."""
        query_start_loc = _host_i32(query_start_loc, "query_start_loc")
        range_start_loc, ranges = None, None
        if mm_prefix_ranges is not None:
            range_start_loc, ranges = _ranges_csr(mm_prefix_ranges, query_start_loc.size - 1)
        stream = None
        if self._device.startswith("cuda"):
            import torch

            stream = torch.cuda.current_stream(self._device).cuda_stream
        self._impl.plan(query_start_loc, _host_i32(seq_lens, "seq_lens"), _host_i32(block_table, "block_table"),
                        range_start_loc, ranges, stream)

    def run(self, q, k, v, kv_cache, *, out=None, lse=None, k_scale=None, v_scale=None):
        """q ``[T, H, D]``; k/v ``[T, Hkv, D]`` or None; ``kv_cache`` a
        ``(key_cache, value_cache)`` pair of ``[NB, BS, Hkv, D]`` or one
        ``[2, NB, BS, Hkv, D]`` tensor (vLLM's FlashAttention layout); ``out`` defaults to a
        new tensor like q. Returns ``out``."""
        if type(kv_cache) is tuple or type(kv_cache) is list:
            key_cache, value_cache = kv_cache
        else:
            key_cache, value_cache = kv_cache[0], kv_cache[1]
        if out is None:
            out = empty_like(q, tuple(q.shape), dtype_name(q))
        if direct(q):
            # The decode fast path: tensors the module reads through the C exchange API, stream included.
            self._impl.run(q, k, v, key_cache, value_cache, out, lse, k_scale, v_scale)
        else:
            self._impl.run(view(q), view(k), view(v), view(key_cache), view(value_cache), view(out), lse,
                           view(k_scale), view(v_scale), stream_of(q))
        return out
