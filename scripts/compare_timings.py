#!/usr/bin/env python3
"""Compares the gpu_bench reports of two builds (scripts/gpu compare).

Reads <work>/cmp_<base|new>_<round>_<run>.json, takes per workload the
median over rounds of each build's graph-replay median, and prints a
Markdown table with the ratio new / base. A run whose check failed has no
figures and fails the comparison.
"""
import glob
import json
import os
import statistics
import sys


def load(work, which):
    times = {}
    for path in sorted(glob.glob(os.path.join(work, f"cmp_{which}_*.json"))):
        with open(path) as f:
            for run in json.load(f)["runs"]:
                if not run.get("check_passed"):
                    sys.exit(f"{path}: {run['spec']} failed its check: {run.get('check_message')}")
                key = (run["spec"], run["head_size"], run["kv_cache_dtype"])
                times.setdefault(key, []).append(run["median_ms"])
    return times


def main():
    work = sys.argv[1]
    base, new = load(work, "base"), load(work, "new")
    if not base or set(base) != set(new):
        sys.exit("compare: the two builds ran different workloads (or none)")
    print("| workload | head size | KV | baseline ms | this tree ms | ratio | spread (new) |")
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
