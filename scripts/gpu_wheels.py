#!/usr/bin/env python3
"""Fills .gpu-deps/wheels/ with the Python packages that scripts/gpu's
FlashInfer peer needs and the GPU machine's image lacks: flashinfer-python and
apache-tvm-ffi. `import flashinfer` and its FA2/FA3 paged attention need
nothing else of its requirements there (cuda-tile, nccl4py, cudnn-frontend
and cutlass-dsl serve other kernels and are imported lazily).

The flashinfer-python wheel (62 MiB) alone nearly fills the 64 MiB that the
device tool carries, so it is repacked without the CUDA sources of kernels the
peer never compiles: every subfolder of data/csrc (MoE, GEMM, sampling, ...),
and the bundled CUTLASS and CCCL trees' examples, tests, docs and Python. The
attention JIT reads data/csrc's top-level files, data/include, the CUTLASS
and CCCL include trees and spdlog (`nvcc -M` over its prefill modules, which
also serve the tensor-core decode). RECORD is rewritten to list what is kept,
so pip installs the result like the original.

Run here, in the repository root (pip reaches PyPI here, not there):
    python3 scripts/gpu_wheels.py
"""
import csv
import io
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

FLASHINFER = "flashinfer-python==0.7.2"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"  # flashinfer 0.7.2 requires >=0.1.11,<0.2
WHEEL_DIR = pathlib.Path(".gpu-deps/wheels")
# The GPU machine's python3 (KINDS.md): CPython 3.12, manylinux x86-64.
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "manylinux2014_x86_64", "--platform", "any"]
CSRC = "flashinfer/data/csrc/"
DROPPED = tuple("flashinfer/data/" + p for p in (
    "cutlass/examples/", "cutlass/python/", "cutlass/test/", "cutlass/docs/", "cutlass/media/",
    "cccl/benchmarks/", "cccl/ci/", "cccl/cudax/", "cccl/docs/", "cccl/python/",
    "cccl/libcudacxx/test/", "cccl/libcudacxx/codegen/"))


def dropped(name):
    return name.startswith(DROPPED) or (name.startswith(CSRC) and "/" in name[len(CSRC):])


def slim(src, dst):
    """Copies wheel `src` to `dst` without the dropped entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not dropped(r[0])]
                text = io.StringIO()
                csv.writer(text, lineterminator="\n").writerows(rows)
                data = text.getvalue().encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def main():
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    for old in list(WHEEL_DIR.glob("flashinfer_python-*.whl")) + list(WHEEL_DIR.glob("apache_tvm_ffi-*.whl")):
        old.unlink()  # one version of each: two stop pip's install
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        *PIP_TARGET, "-d", tmp, FLASHINFER, TVM_FFI], check=True)
        for wheel in pathlib.Path(tmp).glob("*.whl"):
            if wheel.name.startswith("flashinfer_python-"):
                slim(wheel, WHEEL_DIR / wheel.name)
            else:
                shutil.copy(wheel, WHEEL_DIR / wheel.name)
    total = 0
    for wheel in sorted(WHEEL_DIR.glob("*.whl")):
        total += wheel.stat().st_size
        print(f"{wheel.stat().st_size / 2**20:6.1f} MiB  {wheel}")
    print(f"{total / 2**20:6.1f} MiB in {WHEEL_DIR}")


if __name__ == "__main__":
    main()
