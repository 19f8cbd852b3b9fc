"""pagedattn.ops and BatchAttention on PyTorch CUDA tensors (CUDA_FLASH),
against a PyTorch fp32 reference over vLLM's kernel-test grid, and a decode
step captured with torch.cuda.graph and replayed with new metadata. Skipped
without PyTorch or a CUDA device (scripts/gpu runs it on the GPU machine)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import pagedattn  # noqa: E402
from pagedattn import ops  # noqa: E402

SEQS = [[(1, 1328), (5, 18), (129, 463)], [(1, 523), (1, 37), (1, 2011)]]
HEADS = [(4, 4), (8, 2), (16, 2)]
BF16_TOL = dict(atol=1.5e-2, rtol=1e-2)
FP8_TOL = dict(atol=2e-2, rtol=2e-2)
K_SCALE, V_SCALE = 0.5, 0.25


def ref_paged(q, kc, vc, query_lens, kv_lens, table, scale, window=None, soft_cap=None, sinks=None):
    """vLLM's reference: one request at a time, fp32 scores."""
    bs, hkv, d = kc.shape[1:]
    outs = []
    start = 0
    for r, (q_len, kv_len) in enumerate(zip(query_lens, kv_lens)):
        blocks = table[r, : (kv_len + bs - 1) // bs].long()
        k = kc[blocks].reshape(-1, hkv, d)[:kv_len].float()
        v = vc[blocks].reshape(-1, hkv, d)[:kv_len].float()
        qr = q[start : start + q_len].float()
        group = qr.shape[1] // hkv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        j = torch.arange(kv_len, device=q.device)[None, :]
        masked = j > pos
        if window:
            masked |= j <= pos - window
        s = s.masked_fill(masked, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None, None].expand(-1, q_len, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :kv_len]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        start += q_len
    return torch.cat(outs)


_caches = {}


def caches(num_blocks, block_size, hkv, d):
    """bf16 caches and their fp8 copies (x / scale), kept across cases."""
    key = (num_blocks, block_size, hkv, d)
    if key not in _caches:
        _caches.clear()
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k8 = (kc.float() / K_SCALE).to(torch.float8_e4m3fn)
        v8 = (vc.float() / V_SCALE).to(torch.float8_e4m3fn)
        _caches[key] = (kc, vc, k8, v8)
    return _caches[key]


def case(seqs, heads, d, block_size, num_blocks, kv_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    query_lens = [s[0] for s in seqs]
    kv_lens = [s[1] for s in seqs]
    q = torch.randn(sum(query_lens), heads[0], d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc, k8, v8 = caches(num_blocks, block_size, heads[1], d)
    max_blocks = (max(kv_lens) + block_size - 1) // block_size
    table = torch.randint(0, num_blocks, (len(seqs), max_blocks), dtype=torch.int32, device="cuda", generator=g)
    cu_q = torch.tensor([0] + query_lens, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    kv = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    if kv_dtype == "fp8":
        ref_k, ref_v = k8.float() * K_SCALE, v8.float() * V_SCALE
        return q, k8, v8, ref_k, ref_v, cu_q, kv, table, query_lens, kv_lens
    return q, kc, vc, kc, vc, cu_q, kv, table, query_lens, kv_lens


# Ordered so that cases sharing caches (num_blocks, block_size, Hkv, D) run together.
GRID = sorted([
    (seqs, heads, d, bs, cap, window, kv_dtype, nb)
    for seqs in SEQS
    for heads in HEADS
    for d in (128, 256)
    for bs in (16, 32)
    for cap in (0.0, 30.0)
    for window in (None, 256)
    for kv_dtype in ("bf16", "fp8")
    for nb in (2048, 32768)
], key=lambda p: (p[7], p[3], p[1][1], p[2]))


def grid_id(p):
    seqs, heads, d, bs, cap, window, kv_dtype, nb = p
    return f"s{SEQS.index(seqs)}-h{heads[0]}x{heads[1]}-d{d}-bs{bs}-cap{int(cap)}-w{window or 0}-{kv_dtype}-nb{nb}"


def descales(kv_dtype, num_seqs, hkv):
    if kv_dtype != "fp8":
        return None, None
    k = torch.full((num_seqs, hkv), K_SCALE, dtype=torch.float32, device="cuda")
    v = torch.full((num_seqs, hkv), V_SCALE, dtype=torch.float32, device="cuda")
    return k, v


@pytest.mark.parametrize("fn", ["unified_attention", "flash_attn_varlen_func"])
@pytest.mark.parametrize("params", GRID, ids=[grid_id(p) for p in GRID])
@torch.inference_mode()
def test_vllm_grid_against_torch_fp32(fn, params):
    seqs, heads, d, bs, cap, window, kv_dtype, nb = params
    q, k, v, ref_k, ref_v, cu_q, kv, table, query_lens, kv_lens = case(seqs, heads, d, bs, nb, kv_dtype)
    scale = d ** -0.5
    k_descale, v_descale = descales(kv_dtype, len(seqs), heads[1])
    window_size = (window - 1, 0) if window else (-1, -1)
    if fn == "unified_attention":
        out = torch.empty_like(q)
        ops.unified_attention(q, k, v, out, cu_q, max(query_lens), kv, max(kv_lens), scale, True, window_size,
                              table, cap, None, k_descale, v_descale)
    else:
        out = ops.flash_attn_varlen_func(q, k, v, max(query_lens), cu_q, max(kv_lens), seqused_k=kv,
                                         softmax_scale=scale, causal=True, window_size=window_size, softcap=cap,
                                         block_table=table, k_descale=k_descale, v_descale=v_descale)
    want = ref_paged(q, ref_k, ref_v, query_lens, kv_lens, table, scale, window, cap)
    torch.testing.assert_close(out.float(), want, **(FP8_TOL if kv_dtype == "fp8" else BF16_TOL))


@torch.inference_mode()
def test_flash_attn_varlen_func_dense_kv_with_sinks_and_lse():
    g = torch.Generator(device="cuda").manual_seed(3)
    q_lens, k_lens = [7, 1, 130], [7, 300, 130]
    q = torch.randn(sum(q_lens), 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(k_lens), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(k_lens), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    sinks = torch.randn(8, device="cuda", dtype=torch.float32, generator=g)
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).to(torch.int32)
    out, lse = ops.flash_attn_varlen_func(q, k, v, 130, cu_q, 300, cu_seqlens_k=cu_k, causal=True, s_aux=sinks,
                                          return_softmax_lse=True)
    table = torch.arange(sum(k_lens), device="cuda", dtype=torch.int32)
    rows = [table[cu_k[r] : cu_k[r + 1]] for r in range(3)]
    padded = torch.stack([torch.nn.functional.pad(r, (0, 300 - len(r))) for r in rows])
    want = ref_paged(q, k[:, None], v[:, None], q_lens, k_lens, padded, 64 ** -0.5, sinks=sinks)
    torch.testing.assert_close(out.float(), want, **BF16_TOL)
    assert lse.shape == (8, sum(q_lens)) and torch.isfinite(lse).all()


@torch.inference_mode()
def test_cascade_matches_the_plain_plan():
    """12 requests (decodes and 9-token steps) sharing a 512-token prefix, private suffixes."""
    g = torch.Generator(device="cuda").manual_seed(7)
    heads, hkv, d, bs, prefix_blocks, own_blocks, reqs = 16, 2, 128, 16, 32, 12, 12
    nb = prefix_blocks + reqs * own_blocks
    kc = torch.randn(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q_lens = [9 if r % 3 == 0 else 1 for r in range(reqs)]
    seq = [prefix_blocks * bs + 13 * r + 20 for r in range(reqs)]
    table = [list(range(prefix_blocks)) + list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks))
             for r in range(reqs)]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = {}
    for cascade in (True, False):
        attn = pagedattn.BatchAttention(heads, d, num_kv_heads=hkv, dtype=torch.bfloat16, device="cuda",
                                        block_size=bs, cascade=cascade)
        attn.plan(qsl, seq, table)
        assert attn.used_cascade == cascade
        outs[cascade] = attn.run(q, None, None, (kc, vc))
    torch.testing.assert_close(outs[True].float(), outs[False].float(), **BF16_TOL)
    want = ref_paged(q, kc, vc, q_lens, seq, torch.tensor(table, device="cuda"), d ** -0.5)
    torch.testing.assert_close(outs[True].float(), want, **BF16_TOL)


@torch.inference_mode()
def test_runs_on_torchs_current_stream():
    q, k, v, _, _, cu_q, kv, table, query_lens, kv_lens = case(SEQS[1], (8, 2), 128, 16, 2048, "bf16")
    side = torch.cuda.Stream()
    want = torch.empty_like(q)
    ops.unified_attention(q, k, v, want, cu_q, 1, kv, 2011, 0.1, True, (-1, -1), table, 0, None, None, None)
    out = torch.empty_like(q)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.unified_attention(q, k, v, out, cu_q, 1, kv, 2011, 0.1, True, (-1, -1), table, 0, None, None, None)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@torch.inference_mode()
def test_decode_step_captured_in_a_cuda_graph_replays_with_new_metadata():
    g = torch.Generator(device="cuda").manual_seed(5)
    heads, hkv, d, bs, nb, batch = 16, 2, 128, 16, 4096, 8
    kc = torch.randn(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    attn = pagedattn.BatchAttention(heads, d, num_kv_heads=hkv, dtype=torch.bfloat16, device="cuda", block_size=bs,
                                    max_num_reqs=batch, max_num_tokens=batch, max_blocks_per_req=256)
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    qsl = list(range(batch + 1))

    def step(seed):
        r = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, 256 * bs, (batch,), generator=r, dtype=torch.int32)
        table = torch.randint(0, nb, (batch, 256), generator=r, dtype=torch.int32)
        return lens, table

    lens_a, table_a = step(1)
    attn.plan(qsl, lens_a, table_a)
    attn.run(q, None, None, (kc, vc), out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, None, None, (kc, vc), out=out)
    for seed in (2, 3):
        lens, table = step(seed)
        attn.plan(qsl, lens, table)
        out.fill_(float("nan"))
        graph.replay()
        eager = attn.run(q, None, None, (kc, vc), out=torch.empty_like(q))
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        want = ref_paged(q, kc, vc, [1] * batch, lens.tolist(), table.cuda(), d ** -0.5)
        torch.testing.assert_close(out.float(), want, **BF16_TOL)
