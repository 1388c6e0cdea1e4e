"""cpuflash: exact FlashAttention-style softmax attention on the CPU, with Numba kernels."""
from . import reference
from .api import (attention, attention_backward, attention_vjp, get_num_threads, merge,
                  set_num_threads)
from .kvcache import KVCache, quantize_int8
from .varlen import attention_varlen, attention_varlen_backward

__version__ = "0.1.0"

__all__ = ["KVCache", "attention", "attention_backward", "attention_varlen",
           "attention_varlen_backward", "attention_vjp", "get_num_threads", "merge",
           "quantize_int8", "reference", "set_num_threads", "__version__"]
