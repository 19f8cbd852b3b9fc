"""Cascade attention against the plain plan on one GPU, same run: a step of
decodes sharing a long prefix with private suffixes (issue 32: 64 decodes, a
4096-token prefix, 512-token suffixes). Times BatchAttention.run with CUDA
events, cascade and plain alternating, median of the rounds; checks that the
two outputs agree within bf16's tolerance before reporting.

  python python/bench/cascade.py [--requests 64] [--prefix 4096] [--suffix 512] [--json FILE]
"""

import argparse
import sys

import numpy as np
import torch

import pagedattn
from alternate import alternating_medians, report

BF16_TOL = dict(atol=1.5e-2, rtol=1e-2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--suffix", type=int, default=512)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    heads, kv_heads, d, bs = 32, 8, 128, 16
    prefix_blocks, suffix_blocks = a.prefix // bs, (a.suffix + bs - 1) // bs
    num_blocks = prefix_blocks + a.requests * suffix_blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(num_blocks, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda", generator=g)
    vc = torch.randn(num_blocks, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda", generator=g)
    q = torch.randn(a.requests, heads, d, dtype=torch.bfloat16, device="cuda", generator=g)
    table = np.concatenate([np.tile(np.arange(prefix_blocks), (a.requests, 1)),
                            prefix_blocks + np.arange(a.requests * suffix_blocks).reshape(a.requests, suffix_blocks)],
                           axis=1).astype(np.int32)
    qsl = np.arange(a.requests + 1, dtype=np.int32)
    seq = np.full(a.requests, a.prefix + a.suffix, np.int32)
    runs = {}
    for cascade in (True, False):
        attn = pagedattn.BatchAttention(heads, d, num_kv_heads=kv_heads, dtype=torch.bfloat16, device="cuda",
                                        block_size=bs, cascade=cascade)
        attn.plan(qsl, seq, table)
        assert attn.used_cascade == cascade, f"cascade={cascade} planned used_cascade={attn.used_cascade}"
        runs[cascade] = (attn, torch.empty_like(q))
    outs = {c: attn.run(q, None, None, (kc, vc), out=out) for c, (attn, out) in runs.items()}
    torch.testing.assert_close(outs[True].float(), outs[False].float(), **BF16_TOL)

    def time_ms(cascade):
        attn, out = runs[cascade]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iterations):
            attn.run(q, None, None, (kc, vc), out=out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / a.iterations

    cascade_ms, plain_ms = alternating_medians(lambda: time_ms(True), lambda: time_ms(False), a.rounds)
    result = {
        "device": torch.cuda.get_device_name(),
        "backend": runs[True][0].backend,
        "shape": f"{a.requests} decodes, {a.prefix}-token shared prefix, {a.suffix}-token suffixes, "
                 f"H {heads}, Hkv {kv_heads}, D {d}, bf16, block {bs}",
        "cascade_ms": cascade_ms,
        "plain_ms": plain_ms,
    }
    result["speedup"] = result["plain_ms"] / result["cascade_ms"]
    report(result, f"{result['backend']} on {result['device']}, {result['shape']}: cascade {cascade_ms:.4f} ms, "
                   f"plain {plain_ms:.4f} ms, speedup {result['speedup']:.2f}x (median of {a.rounds} alternating "
                   f"rounds of {a.iterations} runs; outputs agree)", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
