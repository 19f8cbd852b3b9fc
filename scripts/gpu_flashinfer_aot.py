#!/usr/bin/env python3
"""Compiles, here, the FlashInfer attention modules that scripts/gpu's perf
mode measures (head size 128: the tensor-core decode with bf16 and fp8 KV, the
FA3 prefill), for sm_90a, into .gpu-deps/flashinfer-aot/<module>/<module>.so.
scripts/gpu installs them as FlashInfer's AOT modules (its package's
data/aot), which FlashInfer loads without compiling, so the GPU machine skips
the JIT (about 260 s of a 600 s device call); a module that is missing there
or fails to load is compiled there as before.

The modules are built by the same code path as on the GPU machine
(`scripts/gpu_peers.py jit`), in a virtual environment that holds what
`import flashinfer` needs: PyTorch from PyPI, the wheels of .gpu-deps/wheels
(run scripts/gpu_wheels.py first) and apache-tvm-ffi for this Python. nvcc
(CUDA 13) compiles; no GPU is needed. About 15 minutes on 2 cores, 8 MiB of
modules. Run in the repository root:
    python3 scripts/gpu_flashinfer_aot.py
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import venv

WHEEL_DIR = pathlib.Path(".gpu-deps/wheels")
AOT_DIR = pathlib.Path(".gpu-deps/flashinfer-aot")
VENV = pathlib.Path.home() / ".cache" / "pagedattn-flashinfer-aot-venv"
# What `import flashinfer` imports at the top level, besides torch.
IMPORT_DEPS = ["packaging", "tqdm", "numpy", "einops", "nvidia-ml-py", "click", "requests", "tabulate", "ninja"]
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"  # as scripts/gpu_wheels.py carries for the GPU machine's Python
# One workload per module (scripts/gpu_peers.py jit picks the modules).
WORKLOADS = ["64q1s4k:32:8:128", "64q1s4k:32:8:128:fp8", "8q4k:32:8:128"]
CUDA_ARCH = "9.0"  # as scripts/gpu names the H100 and H200 (sm_90a)


def run(*args, **kwargs):
    subprocess.run([str(a) for a in args], check=True, **kwargs)


def main():
    wheels = sorted(WHEEL_DIR.glob("flashinfer_python-*.whl"))
    if not wheels:
        sys.exit(f"no flashinfer wheel in {WHEEL_DIR}: run python3 scripts/gpu_wheels.py first")
    python = VENV / "bin" / "python"
    if not python.exists():
        venv.create(VENV, with_pip=True)
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(*pip, "torch", *IMPORT_DEPS, TVM_FFI)
    run(*pip, "--no-deps", wheels[-1])
    with tempfile.TemporaryDirectory() as workspace:
        env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=workspace, FLASHINFER_CUDA_ARCH_LIST=CUDA_ARCH,
                   CUDA_VISIBLE_DEVICES="")
        run(python, "scripts/gpu_peers.py", "jit", *WORKLOADS, env=env)
        shutil.rmtree(AOT_DIR, ignore_errors=True)
        total = 0
        for so in sorted(pathlib.Path(workspace).glob(".cache/flashinfer/*/*/cached_ops/*/*.so")):
            dst = AOT_DIR / so.parent.name / so.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(so, dst)
            total += dst.stat().st_size
            print(f"{dst.stat().st_size / 2**20:6.1f} MiB  {dst.parent.name}")
    if total == 0:
        sys.exit("no module was built")
    print(f"{total / 2**20:6.1f} MiB in {AOT_DIR}")


if __name__ == "__main__":
    main()
