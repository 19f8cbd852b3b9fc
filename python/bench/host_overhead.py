"""Host overhead of one decode call from Python over the same call from C++.

Plans one decode step (one request by default, bf16, CUDA_FLASH on CUDA or
CPU_ATTN on the CPU), then times BatchAttention.run called N times from a
Python loop against the same run() called N times from a C++ loop inside the
module (BatchAttention._time_runs): same objects, same arguments. Host time
only (the loops do not wait for the GPU; N is small enough that the launch
queue never fills); the median of R rounds of each, alternating.

  python python/bench/host_overhead.py [--device cuda] [--json FILE]
"""

import argparse
import sys
import time

import numpy as np
import torch

import pagedattn
from alternate import alternating_medians, report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json")
    a = p.parse_args()
    heads, kv_heads, d, bs = 32, 8, 128, 16
    dev = torch.device(a.device)
    blocks_per = (a.context + bs - 1) // bs
    kc = torch.randn(a.batch * blocks_per, bs, kv_heads, d, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    q = torch.randn(a.batch, heads, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    attn = pagedattn.BatchAttention(heads, d, num_kv_heads=kv_heads, dtype=torch.bfloat16, device=str(dev),
                                    block_size=bs)
    attn.plan(np.arange(a.batch + 1, dtype=np.int32), np.full(a.batch, a.context, np.int32),
              np.arange(a.batch * blocks_per, dtype=np.int32).reshape(a.batch, blocks_per))
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    caches = (kc, vc)

    def python_loop():
        sync()
        start = time.perf_counter()
        for _ in range(a.iterations):
            attn.run(q, None, None, caches, out=out)
        host = (time.perf_counter() - start) / a.iterations
        sync()
        return host

    def cpp_loop():
        sync()
        host = attn._impl._time_runs(q, kc, vc, out, a.iterations, stream)
        sync()
        return host

    python_s, cpp_s = alternating_medians(python_loop, cpp_loop, a.rounds)
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "backend": attn.backend,
        "shape": f"batch {a.batch}, context {a.context}, H {heads}, Hkv {kv_heads}, D {d}, bf16",
        "python_us": python_s * 1e6,
        "cpp_us": cpp_s * 1e6,
    }
    result["overhead_us"] = result["python_us"] - result["cpp_us"]
    report(result, f"{result['backend']} on {result['device']}, {result['shape']}: run() from Python "
                   f"{result['python_us']:.2f} us, from C++ {result['cpp_us']:.2f} us, overhead "
                   f"{result['overhead_us']:.2f} us (median of {a.rounds} rounds of {a.iterations} calls)", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
