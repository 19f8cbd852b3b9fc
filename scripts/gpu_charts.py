#!/usr/bin/env python3
"""Charts of one `scripts/gpu` run, drawn from its report.json: decode TB/s
against context length and causal prefill TFLOP/s against sequence length,
CUDA_FLASH and each peer, as one PNG of two panels (the device tool brings
back few files).

    gpu_charts.py specs                      the sweep's batch specs, one a line
    gpu_charts.py plot report.json out.png   draws them (matplotlib)

`scripts/gpu` benches the specs this prints, for ours and the peers, so the
sweep is named here only. Shapes: the benches' defaults (bf16, 32 query /
8 KV heads, head size 128).
"""
import json
import sys

KILO = 1024
DECODE_BATCH = 64  # decodes per point: the workload of the decode rows (64q1s4k)
CONTEXTS = tuple(n * KILO for n in (1, 2, 4, 8, 16))
# Every prefill point holds the same number of query tokens, so each fills the
# GPU with work (requests x heads x query tiles) and only the length changes.
PREFILL_TOKENS = 32 * KILO
SEQ_LENS = CONTEXTS
HEAD_SIZE = 128
SERIES = (("CUDA_FLASH (ours)", "ours"), ("cuDNN (SDPA)", "cudnn"), ("FA2 (SDPA)", "flash2"),
          ("FlashInfer", "flashinfer"))
STYLE = {"ours": {"linewidth": 2.5, "marker": "o", "zorder": 3}}


def decode_spec(context):
    return f"{DECODE_BATCH}q1s{context // KILO}k"


def prefill_spec(seq_len):
    return f"{PREFILL_TOKENS // seq_len}q{seq_len // KILO}k"


def sweep_specs():
    return [decode_spec(n) for n in CONTEXTS] + [prefill_spec(n) for n in SEQ_LENS]


def figures(report):
    """{series key: {spec: (TB/s, TFLOP/s)}} of the bf16, head-128 rows that have figures."""
    out = {key: {} for _, key in SERIES}
    for r in report.get("ours", []):
        if r.get("check_passed") and r["head_size"] == HEAD_SIZE and r["kv_cache_dtype"] == "auto":
            out["ours"][r["label"]] = (r["tb_per_s"], r["tflop_per_s"])
    peer_runs = (report.get("peers") or {}).get("runs", []) + (report.get("flashinfer") or {}).get("runs", [])
    for p in peer_runs:
        if ("median_ms" in p and p["head_size"] == HEAD_SIZE and p.get("kv_cache_dtype", "auto") == "auto"
                and p["peer"] in out):
            out[p["peer"]][p["spec"]] = (p["tb_per_s"], p["tflop_per_s"])
    return out


def plot(report_path, png_path):
    import matplotlib
    matplotlib.use("Agg")  # no display on the GPU machine
    import matplotlib.pyplot as plt

    with open(report_path) as f:
        report = json.load(f)
    data = figures(report)
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(13, 5))
    panels = ((dec, CONTEXTS, decode_spec, 0), (pre, SEQ_LENS, prefill_spec, 1))
    missing = []
    for label, key in SERIES:
        drawn = False
        for ax, lengths, spec, which in panels:
            points = [(n, data[key][spec(n)][which]) for n in lengths if spec(n) in data[key]]
            if points:
                ax.plot(*zip(*points), label=label, **{"marker": "s", **STYLE.get(key, {})})
                drawn = True
        if not drawn:
            missing.append(label)
    copy = report.get("copy_gb_per_s")
    if copy:
        dec.axhline(copy / 1e3, color="gray", linestyle="--", linewidth=1, label="device copy (read + write)")
    matmul = (report.get("peers") or {}).get("matmul_bf16_tflop_per_s")
    if matmul:
        pre.axhline(matmul, color="gray", linestyle="--", linewidth=1, label="bf16 matmul 8192³")
    dec.set(title=f"Decode: {DECODE_BATCH} requests, 1 query token each", xlabel="context length (tokens)",
            ylabel="TB/s (every KV byte once + q + out)")
    pre.set(title=f"Causal prefill: {PREFILL_TOKENS // KILO}k query tokens per batch",
            xlabel="sequence length per request (tokens)", ylabel="TFLOP/s (4 · causal pairs · H · D)")
    for ax, lengths in ((dec, CONTEXTS), (pre, SEQ_LENS)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // KILO}k" for n in lengths])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    device = (report.get("peers") or {}).get("device") or (report.get("flashinfer") or {}).get("device", "")
    title = f"{device}: bf16, 32 query / 8 KV heads, head size {HEAD_SIZE}, KV blocks of 16"
    if missing:
        title += "\nNO FIGURES: " + ", ".join(missing)
    fig.suptitle(title, color="red" if missing else "black")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"{png_path}: " + ("every series drawn" if not missing else "missing " + ", ".join(missing)))


def main():
    if sys.argv[1:2] == ["specs"] and len(sys.argv) == 2:
        print("\n".join(sweep_specs()))
    elif sys.argv[1:2] == ["plot"] and len(sys.argv) == 4:
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
