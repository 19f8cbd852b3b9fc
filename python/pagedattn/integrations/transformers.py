"""Hugging Face transformers (5.x) attention implementation backed by pagedattn.

``register()`` adds an attention implementation (default name ``"pagedattn"``) to transformers'
``AttentionInterface`` and a matching mask function to ``AttentionMaskInterface``. Then

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="pagedattn")
    model.generate(...)            # dense KV cache: read in place through strided views
    model.generate_batch(...)      # continuous batching: transformers' paged cache read in place

Every attention call goes through ``pagedattn.ops.flash_attn_varlen_func``. See docs/transformers.md for how
each transformers call path maps onto it, and what is not supported.
"""

from __future__ import annotations

import functools
import inspect

import torch

DEFAULT_NAME = "pagedattn"

# Names registered by register(); the paged path and the continuous-batching hook only act on these.
_REGISTERED: set[str] = set()


def _ops():
    from pagedattn import ops  # imported late so that a missing build fails at the first call, with its own error

    return ops


# ---------------------------------------------------------------------------------------------------------------
# Argument checks shared by all paths
# ---------------------------------------------------------------------------------------------------------------


def _check_common(module, dropout, kwargs) -> None:
    if dropout:
        raise NotImplementedError(
            f"pagedattn attention: dropout={dropout} is not supported (inference only); "
            "call model.eval() or set attention_dropout=0"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "pagedattn attention: output_attentions=True is not supported (the kernels never materialise the "
            "attention probabilities); use attn_implementation='eager' for that"
        )
    if kwargs.get("head_mask") is not None:
        raise NotImplementedError("pagedattn attention: head_mask is not supported")


def _causal(module, is_causal) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def _window(sliding_window) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"pagedattn attention: sliding_window must be a positive int, got {sliding_window!r}")
    # transformers' window W lets a query see itself and the W - 1 keys before it
    return (sliding_window - 1, 0)


def _softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    if softcap <= 0:
        raise ValueError(f"pagedattn attention: softcap must be > 0 when given, got {softcap!r}")
    return float(softcap)


def _sinks(s_aux, num_heads: int):
    if s_aux is None:
        return None
    if s_aux.numel() != num_heads:
        raise ValueError(f"pagedattn attention: s_aux must hold one sink per query head ({num_heads}), "
                         f"got shape {tuple(s_aux.shape)}")
    # the kernels take the sink logits as f32, whatever the model dtype
    return s_aux.reshape(num_heads).float().contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Dense path: model.generate() with transformers' DynamicCache / StaticCache (key/value [B, Hkv, T, D])
# ---------------------------------------------------------------------------------------------------------------


def _token_rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """View x [B, Hkv, T, D] as a paged cache [NB, 1, Hkv, D] whose block n = b * m + t is token t of batch b.

    Returns the view and m. Blocks overlap in memory (each starts one token after the previous one in the
    same sequence); the kernels only read the blocks the block table names, so no copy is needed.
    """
    B, Hkv, T, D = x.shape
    sB, sH, sT, sD = x.stride()
    if sD != 1 or sT == 0 or sB % sT != 0 or sB // sT < T:
        x = x.contiguous()
        sB, sH, sT, sD = x.stride()
    m = sB // sT
    num_blocks = (B - 1) * m + T
    view = x.as_strided((num_blocks, 1, Hkv, D), (sT, sT, sH, 1), x.storage_offset())
    return view, m


def _dense_forward(module, query, key, value, attention_mask, scaling, window, softcap, sinks, causal):
    ops = _ops()
    B, H, Tq, D = query.shape
    Tk = key.shape[2]
    q = query.transpose(1, 2)  # [B, Tq, H, D]
    device = query.device

    if attention_mask is None:
        # Every key of every row is valid: each sequence is one block of Tk tokens, read in place.
        k_cache = _last_dim_contiguous(key).transpose(1, 2)  # [B, Tk, Hkv, D], strided
        v_cache = _last_dim_contiguous(value).transpose(1, 2)
        block_table = torch.arange(B, dtype=torch.int32, device=device).unsqueeze(1)
        seqused_k = torch.full((B,), Tk, dtype=torch.int32, device=device)
        cu_q = torch.arange(0, (B + 1) * Tq, Tq, dtype=torch.int32, device=device)
        out = ops.flash_attn_varlen_func(
            q.reshape(B * Tq, H, D), k_cache, v_cache, Tq, cu_q, Tk, seqused_k=seqused_k,
            softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap,
            block_table=block_table, s_aux=sinks,
        )
        return out.view(B, Tq, H, D)

    # A 2-D padding mask [B, L] (L <= Tk, position t of the mask is key t): the valid keys of each row become
    # that row's block table over one-token blocks, and only the valid query rows are computed.
    mask = attention_mask.to(device=device, dtype=torch.bool)
    L = mask.shape[1]
    if L > Tk or L < Tq:
        raise ValueError(f"pagedattn attention: 2-D attention_mask has {L} columns; expected between the query "
                         f"length {Tq} and the key length {Tk}")
    k_view, m = _token_rows_view(key)
    v_view, mv = _token_rows_view(value)
    if mv != m:  # one block table serves both, so give them the same layout
        k_view, m = _token_rows_view(key.contiguous())
        v_view, _ = _token_rows_view(value.contiguous())
    seqused_k = mask.sum(dim=1, dtype=torch.int32)
    max_k = int(seqused_k.max())
    # stable sort puts each row's valid positions first, in order
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :max_k]
    block_table = (order + torch.arange(B, device=device).unsqueeze(1) * m).to(torch.int32)

    q_valid = mask[:, L - Tq:].reshape(-1)
    rows = torch.nonzero(q_valid).squeeze(1)
    q_lens = mask[:, L - Tq:].sum(dim=1, dtype=torch.int32)
    cu_q = torch.zeros(B + 1, dtype=torch.int32, device=device)
    cu_q[1:] = torch.cumsum(q_lens, 0)
    max_q = int(q_lens.max())
    out_valid = ops.flash_attn_varlen_func(
        q.reshape(B * Tq, H, D).index_select(0, rows), k_view, v_view, max_q, cu_q, max_k,
        seqused_k=seqused_k, softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap,
        block_table=block_table, s_aux=sinks,
    )
    out = torch.zeros(B * Tq, H, D, dtype=out_valid.dtype, device=device)
    out.index_copy_(0, rows, out_valid)
    return out.view(B, Tq, H, D)


def _check_not_packed(query, key, attention_mask, kwargs) -> None:
    """transformers' flash path infers packed sequences from position_ids; this one does not, so refuse them."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[2] <= 1 or query.shape[2] != key.shape[2]:
        return
    if position_ids.dim() == 2 and bool((position_ids[:, 1:] - position_ids[:, :-1] != 1).any()):
        raise NotImplementedError(
            "pagedattn attention: packed sequences (position_ids restarting inside a row, no attention_mask) are "
            "not supported; pass an attention_mask or unpack the batch"
        )


# ---------------------------------------------------------------------------------------------------------------
# Paged path: continuous batching (generate_batch) over transformers' PagedAttentionCache
# ---------------------------------------------------------------------------------------------------------------


class _PagedLayer:
    """One layer's share of transformers' paged cache, as this module reads it.

    k_rows / v_rows: [N, Hkv, D] views whose row i is physical cache slot i; read_index [total_k] / write_index
    [total_q]: slots per key / new token; sentinel: the read_index value that stands for "a new token" in a
    sliding-window ring buffer and ring: the ring's size in tokens (both None for full attention).
    """

    __slots__ = ("k_rows", "v_rows", "read_index", "write_index", "sentinel", "ring")

    def __init__(self, k_rows, v_rows, read_index, write_index, sentinel, ring):
        # Some versions hand out K and V as views into one interleaved buffer, V starting a page later; both are
        # addressed by the same slot indices, all below V's length, so both are cut to it.
        rows = min(k_rows.shape[0], v_rows.shape[0])
        self.k_rows, self.v_rows = k_rows[:rows], v_rows[:rows]
        self.read_index, self.write_index = read_index, write_index
        self.sentinel, self.ring = sentinel, ring


def _scales(device):
    return torch.ones((), dtype=torch.float32, device=device)


def _write(layer: _PagedLayer, k_new, v_new) -> None:
    s = _scales(k_new.device)
    _ops().reshape_and_cache_flash(
        k_new, v_new, layer.k_rows.unsqueeze(1), layer.v_rows.unsqueeze(1), layer.write_index.to(torch.int64),
        "auto", s, s,
    )


def _ring_writes_are_safe(layer: _PagedLayer, cu_q, cu_k, max_q: int) -> bool:
    """Whether writing a sliding layer's new tokens before reading leaves every key the batch reads intact.

    A token at position p overwrites the ring slot of position p - ring. That key is still needed only by an
    earlier query of the same chunk, so writing first is safe for decode steps (one query per request) and for
    first prefills that fit the ring (no old keys); a continued chunked prefill, or a prompt longer than the
    ring (whose first tokens go to the trash slot), is not.
    """
    if max_q <= 1:
        return True
    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    return all(q <= 1 or (k == q and q <= layer.ring) for q, k in zip(q_lens, k_lens))


def _paged_forward(module, query, key, value, layer: _PagedLayer, cu_q, cu_k, max_q, max_k, scaling, window,
                   softcap, sinks, causal):
    ops = _ops()
    H, D = query.shape[1], query.shape[3]
    q = query[0].transpose(0, 1).contiguous()  # [total_q, H, D]
    k_new = key[0].transpose(0, 1).contiguous()  # [total_q, Hkv, D]
    v_new = value[0].transpose(0, 1).contiguous()
    cu_q = cu_q.to(torch.int32)
    cu_k = cu_k.to(torch.int32)
    common = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap, s_aux=sinks)

    if layer.read_index.numel() == 0:
        # Only first prefills in the batch: their keys are exactly the new tokens; store them, attend densely.
        _write(layer, k_new, v_new)
        out = ops.flash_attn_varlen_func(q, k_new, v_new, max_q, cu_q, max_k, cu_seqlens_k=cu_k, **common)
        return out.unsqueeze(0), None

    read_index = layer.read_index
    if layer.sentinel is not None:
        if not _ring_writes_are_safe(layer, cu_q, cu_k, max_q):
            # Reading in place would see keys this batch overwrites: gather the old keys first (a copy).
            is_new = (read_index == layer.sentinel).unsqueeze(-1).unsqueeze(-1)
            k_all = layer.k_rows.index_select(0, read_index).masked_scatter_(is_new, k_new)
            v_all = layer.v_rows.index_select(0, read_index).masked_scatter_(is_new, v_new)
            _write(layer, k_new, v_new)
            out = ops.flash_attn_varlen_func(q, k_all, v_all, max_q, cu_q, max_k, cu_seqlens_k=cu_k, **common)
            return out.unsqueeze(0), None
        # The sentinels stand for the new tokens, in query order: point them at the slots the tokens go to.
        read_index = read_index.clone()
        read_index[read_index == layer.sentinel] = layer.write_index.to(read_index.dtype)

    _write(layer, k_new, v_new)
    # Token-granular block table over one-token blocks: row b lists the slots of sequence b's keys, in order.
    k_lens = cu_k[1:] - cu_k[:-1]
    cols = torch.arange(max_k, dtype=torch.int32, device=cu_k.device)
    pos = (cu_k[:-1].unsqueeze(1) + cols.unsqueeze(0)).clamp_(max=max(read_index.numel() - 1, 0))
    block_table = read_index.to(torch.int32)[pos.to(torch.int64)]
    block_table.masked_fill_(cols.unsqueeze(0) >= k_lens.unsqueeze(1), 0)
    out = ops.flash_attn_varlen_func(
        q, layer.k_rows.unsqueeze(1), layer.v_rows.unsqueeze(1), max_q, cu_q, max_k, seqused_k=k_lens,
        block_table=block_table, **common,
    )
    return out.unsqueeze(0), None


def _layer_from_cache_kwargs(module, cache, kwargs):
    """transformers versions whose paged attention functions receive the cache (``paged|<name>``, e.g. 5.17):
    the layer's physical K/V tensors are cache.key_cache / value_cache [num_slots, Hkv, D]."""
    layer_idx = module.layer_idx
    group, index_in_group = cache.layer_index_to_group_indices[layer_idx]
    ring = cache.sliding_windows[layer_idx]
    layer_type = "sliding_attention" if ring > 1 else "full_attention"
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    layer = _PagedLayer(
        cache.key_cache[index_in_group], cache.value_cache[index_in_group], kwargs["read_index"][group],
        kwargs["write_index"][group], cache.sentinel_index if ring > 1 else None, ring if ring > 1 else None,
    )
    return layer, cu_k, max_k


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, Tq, D], key/value [B, Hkv, Tk, D] -> ([B, Tq, H, D], None)."""
    _check_common(module, dropout, kwargs)
    window = _window(sliding_window)
    softcap = _softcap(softcap)
    sinks = _sinks(s_aux, query.shape[1])
    causal = _causal(module, is_causal)
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            "pagedattn attention: transformers' decode fast path (block_table + k_cache/v_cache kwargs) is not "
            "wired up; the paged cache is read through read_index instead"
        )

    layer = kwargs.get("pagedattn_layer")  # set by the PagedAttentionCache.update hook (transformers >= 5.2x)
    cache = kwargs.get("cache")
    if layer is not None:
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
    elif cache is not None and hasattr(cache, "layer_index_to_group_indices") and "read_index" in kwargs:
        layer, cu_k, max_k = _layer_from_cache_kwargs(module, cache, kwargs)
    if layer is not None:
        cu_q = kwargs["cu_seq_lens_q"]
        max_q = kwargs["max_seqlen_q"] if "max_seqlen_q" in kwargs else kwargs["max_length_q"]
        return _paged_forward(module, query, key, value, layer, cu_q, cu_k, int(max_q), int(max_k), scaling,
                              window, softcap, sinks, causal)

    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        # Varlen batch whose keys transformers already gathered into [1, Hkv, total_k, D] (continuous batching
        # without the cache hook, or padding-free inputs): attend over them where they are.
        cu_q, cu_k = kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)
        max_q = kwargs.get("max_length_q", kwargs.get("max_seqlen_q"))
        max_k = kwargs.get("max_length_k", kwargs.get("max_seqlen_k"))
        if query.shape[0] != 1 or isinstance(cu_k, dict) or max_q is None or max_k is None:
            raise ValueError("pagedattn attention: varlen kwargs need batch size 1 and per-layer cu_seq_lens_k, "
                             "max_length_q and max_length_k")
        out = _ops().flash_attn_varlen_func(
            query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1), value[0].transpose(0, 1), int(max_q),
            cu_q, int(max_k), cu_seqlens_k=cu_k, softmax_scale=scaling, causal=causal, window_size=window,
            softcap=softcap, s_aux=sinks,
        )
        return out.unsqueeze(0), None

    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"pagedattn attention: a {attention_mask.dim()}-D attention_mask (an arbitrary additive/boolean mask) "
            "is not supported; only 2-D padding masks [batch, keys] are"
        )
    _check_not_packed(query, key, attention_mask, kwargs)
    out = _dense_forward(module, query, key, value, attention_mask, scaling, window, softcap, sinks, causal)
    return out, None


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, use_vmap=False, **kwargs):
    """transformers mask function: the 2-D padding mask the attention function reads, or None when nothing is
    padded. Causality and sliding windows are not materialised: the kernels apply them from causal/window_size."""
    if use_vmap:
        # transformers sets use_vmap only when an or_mask_function / and_mask_function customises the pattern
        raise NotImplementedError("pagedattn attention: custom mask functions (or_mask_function / "
                                  "and_mask_function) are not supported")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise NotImplementedError(f"pagedattn attention: expected a 2-D padding mask, got {attention_mask.dim()}-D")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


# ---------------------------------------------------------------------------------------------------------------
# Registration and the continuous-batching hooks
# ---------------------------------------------------------------------------------------------------------------


def _base_name(implementation) -> str:
    return (implementation or "").removeprefix("paged|")


def _cache_calls_attention_with_cache() -> bool:
    """True where the attention function gets the PagedAttentionCache and updates it itself (``paged|`` names,
    e.g. 5.17); False where the model calls cache.update(..., kwargs=...) before attention (e.g. 5.25)."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    return "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters


def _hook_switch(manager_cls) -> None:
    original = manager_cls.switch_to_cb_friendly_attn
    if getattr(original, "_pagedattn_hook", False):
        return

    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        current = model.config._attn_implementation
        base = _base_name(current)
        if base not in _REGISTERED:
            return original(self, model, *args, **kwargs)
        # Keep pagedattn: never auto-switch it to a flash kernel, and give it the name this version expects.
        target = f"paged|{base}" if _cache_calls_attention_with_cache() else base
        if current != target:
            model.set_attn_implementation(target)
            self._original_attn_impl = current
        return None

    switch_to_cb_friendly_attn._pagedattn_hook = True
    manager_cls.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


def _hook_cache_update(cache_cls) -> None:
    original = cache_cls.update
    if getattr(original, "_pagedattn_hook", False):
        return

    @functools.wraps(original)
    def update(self, key_states, value_states, layer_idx, kwargs, *args, **extra):
        if (_base_name(self.config._attn_implementation) not in _REGISTERED or kwargs.get("block_table") is not None
                or not hasattr(self, "layer_to_allocator")):
            return original(self, key_states, value_states, layer_idx, kwargs, *args, **extra)
        # Write nothing and gather nothing here: hand the layer's cache rows and indices to the attention function,
        # which stores the new tokens and reads the paged cache in place.
        allocator = self.layer_to_allocator[layer_idx]
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        k_rows, v_rows = allocator._kv_token_views[layer_idx]
        ring = getattr(allocator, "sliding_window", None)
        kwargs["pagedattn_layer"] = _PagedLayer(
            k_rows, v_rows, kwargs["read_index"][allocator.index], kwargs["write_index"][allocator.index],
            allocator.sentinel_index if ring else None, ring,
        )
        return key_states, value_states

    update._pagedattn_hook = True
    cache_cls.update = update


def register(name: str = DEFAULT_NAME) -> str:
    """Register pagedattn with transformers under ``name`` (and ``paged|name``); returns ``name``.

    Also hooks transformers' continuous batching (where it exists) so that generate_batch keeps this
    implementation instead of rejecting it or switching to a flash kernel, and, on versions where the model
    updates the paged cache itself, so that the update leaves reading and writing the cache to pagedattn.
    Idempotent.
    """
    from transformers import AttentionInterface

    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - every 5.x has it
        AttentionMaskInterface = None

    for key in (name, f"paged|{name}"):
        AttentionInterface.register(key, attention_forward)
        if AttentionMaskInterface is not None:
            AttentionMaskInterface.register(key, padding_mask)
    _REGISTERED.add(name)

    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return name
    if hasattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn"):
        _hook_switch(ContinuousBatchingManager)
    if not _cache_calls_attention_with_cache():
        _hook_cache_update(PagedAttentionCache)
    return name
