#!/usr/bin/env python3
"""Picks a reduced conformance grid for compute-sanitizer (scripts/gpu sanitize).

Reads case ids (`pagedattn conformance --list`) on stdin and prints a subset,
one id a line, in which every feature value of the ids appears at least once,
and every pair a kernel is chosen by (head size with KV dtype, head size with
batch spec), so each CUDA_FLASH kernel and each feature runs under every tool.
Greedy set cover: the case adding the most uncovered values first, ties
broken by grid order, so the choice is the same on every run.
"""
import argparse
import sys

SEED_PREFIX = "seed="


def fields(case_id):
    """The comma-separated fields of "[decoder,d128,...,seed=N]", seed dropped."""
    return [f for f in case_id.strip("[]").split(",") if not f.startswith(SEED_PREFIX)]


def values(case_id):
    f = fields(case_id)
    attn_type, head, _heads, _block, batch, _dtype, kv = f[:7]
    wanted = {f"{i}:{v}" for i, v in enumerate(f[:7])}  # position-tagged: "d64" as a head size only
    wanted |= {f"feature:{v.split('=')[0]}" for v in f[7:]}
    wanted.add(f"kernel:{head},{kv}")
    wanted.add(f"tiles:{head},{batch}")
    wanted.add(f"type:{attn_type},{kv}")
    return wanted


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exclude", action="append", default=[],
                        help="drop ids containing this text (the backend's unsupported dtypes, say)")
    args = parser.parse_args()
    ids = [line.strip() for line in sys.stdin if line.strip().startswith("[")]
    ids = [i for i in ids if not any(x in i for x in args.exclude)]
    if not ids:
        sys.exit("gpu_sanitize_cases: no case ids on stdin")
    sets = [values(i) for i in ids]
    uncovered = set().union(*sets)
    chosen = []
    while uncovered:
        best = max(range(len(ids)), key=lambda k: (len(sets[k] & uncovered), -k))
        chosen.append(best)
        uncovered -= sets[best]
    for k in sorted(chosen):
        print(ids[k])
    print(f"gpu_sanitize_cases: {len(chosen)} of {len(ids)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
