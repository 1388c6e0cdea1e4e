"""numba.cuda kernels (NVIDIA's ``numba-cuda`` package), imported only when a call asks for CUDA.

``dispatch`` is the entry point (``api.py`` imports it lazily); ``forward`` and ``backward``
hold the kernels; ``tiles`` the tile shapes and the device helpers both passes share.
"""
