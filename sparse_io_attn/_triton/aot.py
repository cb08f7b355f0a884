"""Ahead-of-time compilation of ``@triton.jit`` kernels for CUDA on a machine without a GPU (Triton's
bundled ``ptxas`` only). Used by the kernel families' ``aot_compile`` checks of the compiled path
(typing, loops, shared memory) where only the interpreter runs. Needs Triton imported with
``TRITON_INTERPRET`` unset: run it in a fresh process."""
from __future__ import annotations

import torch

from sparse_io_attn._triton.runtime import INTERPRET

_TL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compile_for_cuda(kernel, constexprs: dict, dtype: torch.dtype, *, int_ptrs=(), fp32_ptrs=(),
                     arch: int = 90, num_warps: int = 4, num_stages: int = 2):
    """Compile ``kernel`` for ``sm_<arch>``; returns Triton's compiled kernel (``.metadata``, ``.asm``).

    Argument types: names in ``constexprs`` are constexpr; ``io_ptr`` is ``*i64``; ``int_ptrs``
    ``*i32`` (index arrays); ``fp32_ptrs`` ``*fp32`` (statistics); other ``*_ptr`` arguments point to
    ``dtype``; ``sm_scale`` is fp32 and every other scalar i32."""
    if INTERPRET:
        raise RuntimeError("aot_compile needs Triton imported with TRITON_INTERPRET unset (run it in a "
                           "fresh process with TRITON_INTERPRET=0)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg == "io_ptr":
            signature[arg] = "*i64"
        elif arg in int_ptrs:
            signature[arg] = "*i32"
        elif arg in fp32_ptrs:
            signature[arg] = "*fp32"
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + _TL_DTYPES[dtype]
        else:
            signature[arg] = "fp32" if arg == "sm_scale" else "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
