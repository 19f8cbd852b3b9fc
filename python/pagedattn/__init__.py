"""pagedattn: the attention layer of an LLM serving engine (paged KV cache,
MHA/MQA/GQA, mixed prefill and decode batches) with REFERENCE, CPU_ATTN and
CUDA_FLASH backends, from Python.

- ``pagedattn.ops``: vLLM's kernel-level functions (``unified_attention``,
  ``flash_attn_varlen_func``, ``reshape_and_cache_flash``,
  ``merge_attn_states``) with vLLM's signatures.
- ``pagedattn.BatchAttention``: plan once per step, run per layer (CUDA-graph
  capturable).
- ``pagedattn.ModelContext`` / ``Attention`` / ``Step`` /
  ``KVCacheManager``: the layer API of the C++ library.
- ``pagedattn.integrations.transformers``: Hugging Face transformers models.

Tensors cross zero-copy: PyTorch tensors (CPU and CUDA; kernels run on
torch's current stream) and NumPy arrays (bfloat16 through ml_dtypes).
"""

from pagedattn._pagedattn import (
    Attention,
    KVCacheManager,
    ModelContext,
    Step,
    __version__,
    allocate_kv_caches,
    backends,
    built_with_cuda,
    cuda_device_count,
)
from pagedattn.batch import BatchAttention
from pagedattn import ops

__all__ = [
    "Attention",
    "BatchAttention",
    "KVCacheManager",
    "ModelContext",
    "Step",
    "__version__",
    "allocate_kv_caches",
    "backends",
    "built_with_cuda",
    "cuda_device_count",
    "ops",
]
