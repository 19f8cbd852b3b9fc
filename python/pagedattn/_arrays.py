"""What the C++ module needs from a framework tensor, found without importing
the framework: the dtype name, the device, the CUDA stream to run on, and a
zero-copy view the module can read (DLPack or the buffer protocol)."""

import sys

# torch dtype / NumPy dtype names -> the library's names.
_DTYPE_NAMES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
}


def _short(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_arg(dtype) -> str:
    """The library's name of a framework dtype (torch.bfloat16, np.float32),
    or `dtype` itself when it already is a name ("bf16")."""
    return _DTYPE_NAMES.get(_short(dtype), str(dtype))


def dtype_name(x) -> str:
    """The library's name of x's element type ("bf16", "fp8_e4m3", ...)."""
    name = _short(x.dtype)
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype {name} is not one pagedattn reads (float32, float16, bfloat16, float8_e4m3fn, "
                         f"float8_e5m2, int32, int64, uint8)")
    return _DTYPE_NAMES[name]


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


# Per type: whether it publishes DLPack's C exchange API (PyTorch >= 2.10).
# The module then reads such tensors, float8 included, and their framework's
# current stream through C calls, so they pass through untouched.
_EXCHANGE = {}


def direct(x) -> bool:
    """Whether the module reads x (and its stream) through the C exchange API."""
    t = type(x)
    fast = _EXCHANGE.get(t)
    if fast is None:
        fast = _EXCHANGE[t] = hasattr(t, "__dlpack_c_exchange_api__")
    return fast


def view(x):
    """x as the module reads it, zero-copy. NumPy's ml_dtypes bfloat16 and
    float8 arrays cross as their bits (uint16 / uint8), which the module reads
    as bfloat16 / by the KV-cache dtype; float8 tensors of a framework without
    the C exchange API cross as uint8 (DLPack exporters differ on float8)."""
    if x is None or direct(x):
        return x
    if _is_torch(x):
        if x.dtype.itemsize == 1 and x.dtype.is_floating_point:
            return x.view(sys.modules["torch"].uint8)
        return x
    name = str(getattr(x, "dtype", ""))
    if name == "bfloat16":
        import numpy as np

        return x.view(np.uint16)
    if name.startswith("float8"):
        import numpy as np

        return x.view(np.uint8)
    return x


def stream_of(x):
    """The CUDA stream to run on as an integer, or None when the module asks
    x's framework itself (C exchange API) or x is not a CUDA tensor."""
    if x is None or direct(x) or not _is_torch(x) or not x.is_cuda:
        return None
    torch = sys.modules["torch"]
    return torch.cuda.current_stream(x.device).cuda_stream


def empty_like(x, shape, dtype_name_: str):
    """A new uninitialized array on x's device: torch tensors give torch
    tensors, anything else NumPy arrays."""
    if _is_torch(x):
        torch = sys.modules["torch"]
        dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype_name_]
        return torch.empty(shape, dtype=dt, device=x.device)
    import numpy as np

    if dtype_name_ == "bf16":
        import ml_dtypes

        return np.empty(shape, dtype=ml_dtypes.bfloat16)
    return np.empty(shape, dtype={"f32": np.float32, "f16": np.float16}[dtype_name_])


def kv_cache_dtype_of(cache) -> str:
    """vLLM's kv_cache_dtype string for a cache tensor: fp8 caches are float8
    tensors or uint8 bytes (vLLM's "fp8" = e4m3), the rest "auto"."""
    name = _short(cache.dtype)
    if name == "float8_e4m3fn":
        return "fp8_e4m3"
    if name == "float8_e5m2":
        return "fp8_e5m2"
    if name == "uint8":
        return "fp8"
    return "auto"
