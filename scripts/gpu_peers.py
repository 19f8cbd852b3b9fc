#!/usr/bin/env python3
"""Peers for `scripts/gpu`, measured in the same run on the same shapes.

`measure`: times PyTorch SDPA with the cuDNN and flash (FlashAttention-2)
backends on contiguous K/V (uniform batches only: SDPA has no varlen or paged
input), plus the bf16 matrix rate, each as the median of CUDA-graph replays
(events, launch gaps out), the way pagedattn_gpu_bench times CUDA_FLASH.
`report`: joins ours (gpu_bench JSON files) and the peers into report.json
and a markdown table.
"""
import argparse
import json
import re
import statistics
import sys

GRAPH_CALLS = 20
REPLAYS = 10


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


def graph_time_ms(torch, fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / GRAPH_CALLS)
    return statistics.median(times)


def measure(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "runs": []}
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = graph_time_ms(torch, lambda: a @ b)
    out["matmul_bf16_tflop_per_s"] = 2 * n**3 / (ms * 1e-3) / 1e12
    del a, b
    for w in args.workload:
        spec, heads, kv_heads, head_size = w.split(":")
        heads, kv_heads, head_size = int(heads), int(kv_heads), int(head_size)
        reqs = parse_spec(spec)
        if len(set(reqs)) != 1:
            continue  # mixed batches: no contiguous-K/V peer
        (q_len, seq_len), batch = reqs[0], len(reqs)
        causal = q_len > 1
        q = torch.randn(batch, heads, q_len, head_size, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, seq_len, head_size, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pairs = batch * (q_len * (seq_len - q_len) + q_len * (q_len + 1) / 2)
        flops = 4 * pairs * heads * head_size
        bytes_ = 2 * (batch * seq_len * kv_heads * head_size * 2 + 2 * batch * q_len * heads * head_size)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
            row = {"spec": spec, "heads": heads, "kv_heads": kv_heads, "head_size": head_size, "peer": name,
                   "flops": flops, "bytes": bytes_}
            # GQA-native first; a backend without GQA gets K/V expanded to H heads
            # (it then reads H/Hkv times the KV bytes: marked "expanded").
            for expanded in (False, True):
                kk = k.repeat_interleave(heads // kv_heads, dim=1) if expanded else k
                vv = v.repeat_interleave(heads // kv_heads, dim=1) if expanded else v
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal,
                                                                    enable_gqa=not expanded)
                        ms = graph_time_ms(torch, fn)
                    row.update({"median_ms": ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12,
                                "tb_per_s": bytes_ / (ms * 1e-3) / 1e12, "expanded": expanded})
                    row.pop("error", None)
                    break
                except Exception as e:  # a backend that rejects the shape is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


def report(args):
    ours = []
    copy_gb_s = None
    for path in args.ours:
        with open(path) as f:
            d = json.load(f)
        copy_gb_s = d.get("copy_gb_per_s", copy_gb_s)
        ours += d["runs"]
    with open(args.peers) as f:
        peers = json.load(f)
    lines = [f"device-to-device copy {copy_gb_s:.0f} GB/s (read + write); "
             f"bf16 matmul {peers['matmul_bf16_tflop_per_s']:.0f} TFLOP/s (torch {peers['torch']})", "",
             "| workload | H/Hkv/D | KV | FLOPs | bytes | CUDA_FLASH ms | TB/s | TFLOP/s | cuDNN ms | FA2 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ours:
        def peer(name):
            for p in peers["runs"]:
                if (p["spec"] == r["label"] and p["peer"] == name and p["heads"] == r["heads"]
                        and p["head_size"] == r["head_size"] and r["kv_cache_dtype"] == "auto"):
                    if "median_ms" not in p:
                        return "n/a"
                    return f"{p['median_ms']:.4f}" + (" (expanded K/V)" if p.get("expanded") else "")
            return "—"
        if not r.get("check_passed"):
            lines.append(f"| {r['label']} | {r['heads']}/{r['kv_heads']}/{r['head_size']} | {r['kv_cache_dtype']} "
                         f"| | | CHECK FAILED | | | | |")
            continue
        lines.append(f"| {r['label']} | {r['heads']}/{r['kv_heads']}/{r['head_size']} | {r['kv_cache_dtype']} | "
                     f"{r['flops']:.3g} | {r['bytes']:.3g} | {r['median_ms']:.4f} | {r['tb_per_s']:.2f} | "
                     f"{r['tflop_per_s']:.0f} | {peer('cudnn')} | {peer('flash2')} |")
    table = "\n".join(lines) + "\n"
    with open(args.table, "w") as f:
        f.write(table)
    with open(args.json, "w") as f:
        json.dump({"copy_gb_per_s": copy_gb_s, "ours": ours, "peers": peers}, f, indent=2)
    print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("workload", nargs="+", help="spec:heads:kv_heads:head_size")
    r = sub.add_parser("report")
    r.add_argument("--peers", required=True)
    r.add_argument("--json", required=True)
    r.add_argument("--table", required=True)
    r.add_argument("ours", nargs="+")
    args = ap.parse_args()
    return measure(args) if args.cmd == "measure" else report(args)


if __name__ == "__main__":
    sys.exit(main())
