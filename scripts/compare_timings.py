#!/usr/bin/env python3
"""Compares the timing reports of two builds (scripts/bench_compare on the CPU,
scripts/gpu compare on the GPU).

Usage: compare_timings.py <dir> [prefix]. Reads <dir>/<prefix>base_*.json and
<dir>/<prefix>new_*.json (`pagedattn bench --json` or `pagedattn_gpu_bench
--json` reports, one per round), takes per workload the median over rounds of
each build's median, and prints a Markdown table with the ratio new / base. A
run whose check failed has no figures and fails the comparison.
"""
import glob
import json
import os
import statistics
import sys


def load(work, prefix, which):
    times = {}
    for path in sorted(glob.glob(os.path.join(work, f"{prefix}{which}_*.json"))):
        with open(path) as f:
            report = json.load(f)
        for run in report["runs"]:
            if not run.get("check_passed"):
                sys.exit(f"{path}: {run['spec']} failed its check: {run.get('check_message')}")
            key = (run["spec"], run.get("head_size", report.get("head_size")), run["kv_cache_dtype"])
            times.setdefault(key, []).append(run["median_ms"])
    return times


def main():
    work = sys.argv[1]
    prefix = sys.argv[2] if len(sys.argv) > 2 else ""
    base, new = load(work, prefix, "base"), load(work, prefix, "new")
    if not base or set(base) != set(new):
        sys.exit("compare: the two builds ran different workloads (or none)")
    print("| workload | head size | KV | baseline ms | this build ms | ratio | spread (this) |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for key in sorted(base):
        b, n = statistics.median(base[key]), statistics.median(new[key])
        spread = (max(new[key]) - min(new[key])) / n
        worst = max(worst, abs(n / b - 1))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {b:.4f} | {n:.4f} | {n / b:.3f} | {spread:.1%} |")
    print(f"\nlargest change: {worst:.1%} ({len(base)} workloads, {len(base[next(iter(base))])} rounds)")


if __name__ == "__main__":
    main()
