#!/usr/bin/env python3
"""Peers for `scripts/gpu`, measured in the same run on the same shapes.

`measure --peer sdpa`: PyTorch SDPA with its cuDNN and flash
(FlashAttention-2) backends on contiguous K/V, uniform batches with bf16 KV
only (SDPA has no varlen, paged or fp8 input), plus the bf16 matrix rate.
`measure --peer flashinfer`: FlashInfer on a paged KV cache laid out as
pagedattn_gpu_bench lays out ours (NHD blocks of 16 tokens, shuffled block
tables, block 0 unused, uniform [-1, 1) values): decodes through
BatchDecodeWithPagedKVCacheWrapper on its tensor-core path, prefills through
BatchPrefillWithPagedKVCacheWrapper on FA3 (causal), a mixed batch as both
calls timed together. Sampled rows are first checked against an fp32
reference; a row that fails gives no figure.
Both time the median of CUDA-graph replays (events, launch gaps out), as
pagedattn_gpu_bench times CUDA_FLASH, and rewrite their JSON after each row,
so a peer that crashes keeps the rows before it.
`jit`: compiles the FlashInfer modules those workloads need ahead, without
the GPU (FLASHINFER_CUDA_ARCH_LIST names the target), in one parallel build.
`report`: joins ours (gpu_bench JSON files) and the peers into report.json
and a markdown table.

A workload is spec:heads:kv_heads:head_size[:kv_cache_dtype] (auto or fp8).
"""
import argparse
import functools
import itertools
import json
import os
import re
import statistics
import sys
import time

GRAPH_CALLS = 20  # calls per captured graph, as gpu_bench's forwards per graph
REPLAYS = 10
WARMUP_CALLS = 3
BLOCK_SIZE = 16
SEED = 1
DEVICE = "cuda"  # where the peers run and their inputs live
KV_DTYPES = {"auto": "bfloat16", "fp8": "float8_e4m3fn"}  # torch dtype names; fp8 is e4m3, as ours
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
# FlashInfer's module per part: "auto" tensor-core decode resolves to FA2 for
# bf16 queries on SM90 (FA3 would need fp8 queries for an fp8 cache); prefill
# is pinned to FA3.
FLASHINFER_DECODE_BACKEND = "fa2"
FLASHINFER_PREFILL_BACKEND = "fa3"
CHECK_ROWS = 8  # as gpu_bench's check
# Relative error (Frobenius, per row) allowed against the fp32 reference: bf16
# rounding of P and of the output stays near 0.005; a wrong mask, block table
# or head mapping gives O(1).
CHECK_REL_TOL = 2e-2


def parse_spec(spec):
    """vLLM batch spec -> list of (q_len, seq_len)."""
    def num(s):
        return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)
    reqs = []
    for group in spec.split("_"):
        m = re.fullmatch(r"(\d*)q(\d+k?)(?:s(\d+k?))?", group)
        if not m:
            raise ValueError(f"bad batch spec group {group!r}")
        count = int(m.group(1) or 1)
        q = num(m.group(2))
        s = num(m.group(3)) if m.group(3) else q
        reqs += [(q, s)] * count
    return reqs


def parse_workload(text):
    spec, heads, kv_heads, head_size, *kv = text.split(":")
    kv = kv[0] if kv else "auto"
    if kv not in KV_DTYPES:
        raise ValueError(f"workload {text!r}: KV cache dtype {kv!r} is not one of {sorted(KV_DTYPES)}")
    return {"spec": spec, "heads": int(heads), "kv_heads": int(kv_heads), "head_size": int(head_size),
            "kv_cache_dtype": kv}


def cost(reqs, w, kv_bytes):
    """(FLOPs, bytes) as gpu_bench counts them: causal (q, k) pairs; every KV byte once + q + out in bf16."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in reqs)
    hd = w["heads"] * w["head_size"]
    kv_tokens = sum(s for _, s in reqs)
    tokens = sum(q for q, _ in reqs)
    return 4 * pairs * hd, kv_tokens * w["kv_heads"] * w["head_size"] * 2 * kv_bytes + 2 * tokens * hd * 2


def time_ms(torch, fn, graph=True):
    """Median milliseconds of one `fn`: replays of a CUDA graph of GRAPH_CALLS
    calls, or with graph=False the same calls launched one by one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(GRAPH_CALLS):
                fn()
        run = captured.replay
    else:
        def run():
            for _ in range(GRAPH_CALLS):
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / GRAPH_CALLS)
    return statistics.median(times)


def error_text(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def save(path, out):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, path)


def rates(row, ms):
    row.update({"median_ms": ms, "tflop_per_s": row["flops"] / (ms * 1e-3) / 1e12,
                "tb_per_s": row["bytes"] / (ms * 1e-3) / 1e12})


# ---- PyTorch SDPA: cuDNN and FlashAttention-2 ----

def measure_sdpa(torch, workloads, out, path):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    out["matmul_bf16_tflop_per_s"] = 2 * n**3 / (time_ms(torch, lambda: a @ b) * 1e-3) / 1e12
    del a, b
    for w in workloads:
        reqs = parse_spec(w["spec"])
        if len(set(reqs)) != 1 or w["kv_cache_dtype"] != "auto":
            continue  # mixed batches and fp8 KV: no SDPA input for them
        (q_len, seq_len), batch = reqs[0], len(reqs)
        heads, kv_heads, head_size = w["heads"], w["kv_heads"], w["head_size"]
        flops, bytes_ = cost(reqs, w, 2)
        q = torch.randn(batch, heads, q_len, head_size, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, seq_len, head_size, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
            row = dict(w, peer=name, flops=flops, bytes=bytes_)
            # GQA-native first; a backend without GQA gets K/V expanded to H heads
            # (it then reads H/Hkv times the KV bytes: marked "expanded").
            for expanded in (False, True):
                kk = k.repeat_interleave(heads // kv_heads, dim=1) if expanded else k
                vv = v.repeat_interleave(heads // kv_heads, dim=1) if expanded else v
                try:
                    with sdpa_kernel([backend]):
                        ms = time_ms(torch, lambda: F.scaled_dot_product_attention(
                            q, kk, vv, is_causal=q_len > 1, enable_gqa=not expanded))
                    rates(row, ms)
                    row["expanded"] = expanded
                    row.pop("error", None)
                    break
                except Exception as e:  # a backend that rejects the shape is reported, not fatal
                    row["error"] = error_text(e)
            out["runs"].append(row)
            save(path, out)
            print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


# ---- FlashInfer: paged decode (tensor cores) and paged prefill (FA3) ----

class PagedBatch:
    """A workload's queries and paged KV cache, laid out as gpu_bench lays out ours."""

    def __init__(self, torch, w):
        self.torch, self.w = torch, w
        self.reqs = parse_spec(w["spec"])
        self.kv_dtype = getattr(torch, KV_DTYPES[w["kv_cache_dtype"]])
        pages = [-(-s // BLOCK_SIZE) for _, s in self.reqs]
        order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(SEED))
        self.tables = list(torch.split((order + 1).to(torch.int32), pages))  # block 0 is the null block
        values = torch.Generator(device=DEVICE).manual_seed(SEED)
        shape = (2, sum(pages) + 1, BLOCK_SIZE, w["kv_heads"], w["head_size"])
        self.cache = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16).uniform_(
            -1, 1, generator=values).to(self.kv_dtype)
        self.starts = [0, *itertools.accumulate(q for q, _ in self.reqs)]
        self.q = torch.empty(self.starts[-1], w["heads"], w["head_size"], device=DEVICE,
                             dtype=torch.bfloat16).uniform_(-1, 1, generator=values)

    def part(self, requests):
        """Query rows and FlashInfer's paged-KV metadata (CSR page lists) of some requests."""
        torch = self.torch
        i32 = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
        reqs = [self.reqs[r] for r in requests]
        tables = [self.tables[r] for r in requests]
        rows = torch.cat([torch.arange(self.starts[r], self.starts[r + 1]) for r in requests])
        return {"rows": rows, "q": self.q[rows.to(DEVICE)].contiguous(),
                "qo_indptr": i32([0, *itertools.accumulate(q for q, _ in reqs)]),
                "indptr": i32([0, *itertools.accumulate(len(t) for t in tables)]),
                "indices": torch.cat(tables).to(DEVICE),
                "last_page_len": i32([s - (len(t) - 1) * BLOCK_SIZE for (_, s), t in zip(reqs, tables)])}

    def reference_row(self, row):
        """fp32 attention of query row `row` over the keys it sees (causal, GQA)."""
        torch = self.torch
        r = next(i for i in range(len(self.reqs)) if self.starts[i + 1] > row)
        q_len, seq_len = self.reqs[r]
        visible = seq_len - q_len + (row - self.starts[r]) + 1
        blocks = self.tables[r].to(DEVICE, torch.long)
        kv_heads, head_size = self.w["kv_heads"], self.w["head_size"]
        # Gathered through a byte view: fp8 tensors need not support indexing.
        k, v = (self.cache[i].view(torch.uint8)[blocks].view(self.kv_dtype).reshape(-1, kv_heads, head_size)
                [:visible].float() for i in (0, 1))
        q = self.q[row].float().view(kv_heads, -1, head_size)  # query head h reads KV head h // group
        p = (torch.einsum("hgd,nhd->hgn", q, k) / head_size**0.5).softmax(-1)
        return torch.einsum("hgn,nhd->hgd", p, v).reshape(-1, head_size)


def plan_flashinfer(flashinfer, torch, batch):
    """Plans FlashInfer's calls for the batch: (the calls, [(rows, out)], backends)."""
    w = batch.w
    kv = (batch.cache[0], batch.cache[1])
    shape = (w["heads"], w["kv_heads"], w["head_size"], BLOCK_SIZE)
    decodes = [i for i, (q, _) in enumerate(batch.reqs) if q == 1]
    prefills = [i for i, (q, _) in enumerate(batch.reqs) if q > 1]
    if prefills and w["kv_cache_dtype"] != "auto":
        raise ValueError("FlashInfer's FA3 prefill takes an fp8 cache only with fp8 queries")
    calls, outputs, backends = [], [], {}
    if decodes:
        p = batch.part(decodes)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE), "NHD", use_tensor_cores=True)
        wrapper.plan(p["indptr"], p["indices"], p["last_page_len"], *shape,
                     q_data_type=torch.bfloat16, kv_data_type=batch.kv_dtype)
        out = torch.zeros_like(p["q"])
        calls.append(functools.partial(wrapper.run, p["q"], kv, out=out))
        outputs.append((p["rows"], out))
        backends["decode"] = f"BatchDecodeWithPagedKVCacheWrapper tensor cores ({wrapper.resolved_backend})"
    if prefills:
        p = batch.part(prefills)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE), "NHD",
            backend=FLASHINFER_PREFILL_BACKEND)
        wrapper.plan(p["qo_indptr"], p["indptr"], p["indices"], p["last_page_len"], *shape,
                     causal=True, q_data_type=torch.bfloat16, kv_data_type=batch.kv_dtype)
        out = torch.zeros_like(p["q"])
        calls.append(functools.partial(wrapper.run, p["q"], kv, out=out))
        outputs.append((p["rows"], out))
        backends["prefill"] = f"BatchPrefillWithPagedKVCacheWrapper ({FLASHINFER_PREFILL_BACKEND})"
    return calls, outputs, backends


def check_flashinfer(torch, batch, outputs):
    """Largest relative error of CHECK_ROWS rows spread over the batch, against batch.reference_row."""
    got = torch.empty_like(batch.q)
    for rows, out in outputs:
        got[rows.to(DEVICE)] = out
    tokens = batch.q.shape[0]
    n = min(CHECK_ROWS, tokens)
    picked = sorted({k * (tokens - 1) // max(n - 1, 1) for k in range(n)})
    worst = 0.0
    for row in picked:
        want = batch.reference_row(row)
        worst = max(worst, float((got[row].float() - want).norm() / want.norm()))
    return worst, len(picked)


def measure_flashinfer(torch, workloads, out, path):
    try:
        import flashinfer
    except Exception as e:
        out["error"] = f"import flashinfer failed: {error_text(e)}"
        return
    out["flashinfer"] = flashinfer.__version__
    save(path, out)
    for w in workloads:
        row = dict(w, peer="flashinfer")
        try:
            batch = PagedBatch(torch, w)
            row["flops"], row["bytes"] = cost(batch.reqs, w, batch.cache.element_size())
            calls, outputs, row["backends"] = plan_flashinfer(flashinfer, torch, batch)

            def fn():
                for call in calls:
                    call()
            fn()
            row["check_max_rel_err"], row["checked_rows"] = check_flashinfer(torch, batch, outputs)
            if row["check_max_rel_err"] > CHECK_REL_TOL:
                raise ValueError(f"CHECK FAILED: relative error {row['check_max_rel_err']:.3g} > {CHECK_REL_TOL}")
            try:
                rates(row, time_ms(torch, fn))
                row["timing"] = "graph"
            except Exception as e:  # timed call by call instead; the row says so
                row["graph_error"] = error_text(e)
                rates(row, time_ms(torch, fn, graph=False))
                row["timing"] = "eager"
        except Exception as e:  # one workload's failure is reported, not fatal
            row["error"] = error_text(e)
        out["runs"].append(row)
        save(path, out)
        print(json.dumps(row), flush=True)
        batch = calls = outputs = fn = None
        torch.cuda.empty_cache()


def measure(args):
    import torch

    workloads = [parse_workload(w) for w in args.workload]
    out = {"peer": args.peer, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "runs": [], "complete": False}
    save(args.out, out)
    (measure_sdpa if args.peer == "sdpa" else measure_flashinfer)(torch, workloads, out, args.out)
    out["complete"] = "error" not in out
    save(args.out, out)
    if "error" in out:
        print(f"{args.peer} NOT MEASURED: {out['error']}", file=sys.stderr)
        return 1
    return 0


def jit(args):
    """Builds every FlashInfer module the workloads' plan() calls will load, in one ninja run."""
    import torch
    import flashinfer.jit
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module  # FA2's, as plan() builds it
    from flashinfer.utils import PosEncodingMode

    specs = {}
    for w in map(parse_workload, args.workload):
        reqs = parse_spec(w["spec"])
        module_args = (torch.bfloat16, getattr(torch, KV_DTYPES[w["kv_cache_dtype"]]), torch.bfloat16, torch.int32,
                       w["head_size"], w["head_size"], PosEncodingMode.NONE.value, False, False, False)
        if any(q == 1 for q, _ in reqs):
            spec = _gen_batch_prefill_primary_module(FLASHINFER_DECODE_BACKEND, *module_args)
            specs[spec.name] = spec
        if any(q > 1 for q, _ in reqs) and w["kv_cache_dtype"] == "auto":
            spec = flashinfer.jit.gen_batch_prefill_module(FLASHINFER_PREFILL_BACKEND, *module_args)
            specs[spec.name] = spec
    start = time.monotonic()
    flashinfer.jit.build_jit_specs(list(specs.values()))
    print(f"FlashInfer {flashinfer.__version__}: {len(specs)} modules built in {time.monotonic() - start:.0f} s")
    return 0


# ---- report ----

def load_peer(path):
    """(JSON, None) or (None, why it is missing)."""
    if not path:
        return None, "not run"
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f"no results ({error_text(e)}): the peer did not run or died before writing"


def flashinfer_status(fi, why):
    """One line for the report: what FlashInfer ran, or LOUDLY why it is missing."""
    if fi is None:
        return f"**FlashInfer NOT MEASURED: {why}** (logs.txt)"
    if "error" in fi:
        return f"**FlashInfer NOT MEASURED: {fi['error']}** (logs.txt)"
    backends = sorted({b for r in fi["runs"] for b in r.get("backends", {}).values()})
    line = f"FlashInfer {fi.get('flashinfer', '?')}: " + "; ".join(backends)
    if not fi.get("complete"):
        line += f" — **STOPPED EARLY after {len(fi['runs'])} workloads** (logs.txt)"
    return line


def report(args):
    ours = []
    copy_gb_s = None
    for path in args.ours:
        with open(path) as f:
            d = json.load(f)
        copy_gb_s = d.get("copy_gb_per_s", copy_gb_s)
        ours += d["runs"]
    peers, _ = load_peer(args.peers)
    peers = peers or {"runs": []}
    fi, why = load_peer(args.flashinfer)
    peer_rows = peers["runs"] + (fi or {}).get("runs", [])
    notes = []

    def peer(r, name):
        for p in peer_rows:
            if (p["spec"] == r["label"] and p["peer"] == name and p["heads"] == r["heads"]
                    and p["head_size"] == r["head_size"] and p.get("kv_cache_dtype", "auto") == r["kv_cache_dtype"]):
                if "median_ms" not in p:
                    notes.append(f"- {name} `{p['spec']}` D={p['head_size']} KV {p['kv_cache_dtype']}: {p.get('error')}")
                    return "n/a"
                marks = [m for m, on in (("expanded K/V", p.get("expanded")), ("eager", p.get("timing") == "eager"))
                         if on]
                return f"{p['median_ms']:.4f}" + (f" ({', '.join(marks)})" if marks else "")
        return "—"

    matmul = peers.get("matmul_bf16_tflop_per_s")
    lines = [f"device-to-device copy {copy_gb_s:.0f} GB/s (read + write); "
             + (f"bf16 matmul {matmul:.0f} TFLOP/s (torch {peers['torch']})" if matmul else "**SDPA peers NOT MEASURED**"),
             flashinfer_status(fi, why), "",
             "| workload | H/Hkv/D | KV | FLOPs | bytes | CUDA_FLASH ms | TB/s | TFLOP/s | cuDNN ms | FA2 ms "
             "| FlashInfer ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ours:
        head = f"| {r['label']} | {r['heads']}/{r['kv_heads']}/{r['head_size']} | {r['kv_cache_dtype']} "
        if not r.get("check_passed"):
            lines.append(head + "| | | CHECK FAILED | | | | | |")
            continue
        lines.append(head + f"| {r['flops']:.3g} | {r['bytes']:.3g} | {r['median_ms']:.4f} | {r['tb_per_s']:.2f} | "
                     f"{r['tflop_per_s']:.0f} | {peer(r, 'cudnn')} | {peer(r, 'flash2')} | {peer(r, 'flashinfer')} |")
    if notes:
        lines += ["", "Peers with no figure:", *notes]
    table = "\n".join(lines) + "\n"
    with open(args.table, "w") as f:
        f.write(table)
    with open(args.json, "w") as f:
        json.dump({"copy_gb_per_s": copy_gb_s, "ours": ours, "peers": peers, "flashinfer": fi,
                   "flashinfer_missing": why}, f, indent=2)
    print(table)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--peer", choices=("sdpa", "flashinfer"), required=True)
    m.add_argument("--out", required=True)
    m.add_argument("workload", nargs="+", help="spec:heads:kv_heads:head_size[:kv_cache_dtype]")
    j = sub.add_parser("jit")
    j.add_argument("workload", nargs="+")
    r = sub.add_parser("report")
    r.add_argument("--peers", help="the SDPA peers' JSON")
    r.add_argument("--flashinfer", help="FlashInfer's JSON")
    r.add_argument("--json", required=True)
    r.add_argument("--table", required=True)
    r.add_argument("ours", nargs="+")
    args = ap.parse_args()
    return {"measure": measure, "jit": jit, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
