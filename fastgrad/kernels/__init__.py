"""op_kernel layer: pure Numba kernels, each over one plan.

A kernel module imports only the dtype conversions (:mod:`fastgrad.dtypes`), the JIT helpers
(:mod:`fastgrad._jit`), the shared kernel helpers of this package (``_gemm``, ``_linear``,
``_vmath``, ``_strided``) and its plan's type (:mod:`fastgrad.tiling`) — never the backend
registry, torch, or another kernel's private names.  The ``"cpu"`` backend's table
(:mod:`fastgrad.backends.cpu`) names the entry points.
"""
