"""Numba CUDA kernels and the layer streamer.

The code lives in the repository's top-level kernels/ folder, beside the ggml patches
(kernels/ggml/), where someone tweaking kernels looks first; it is imported as
swarmkv_ffi.kernels.* (never as a bare top-level `kernels`, a name other packages use).
A wheel carries the files inside this package (pyproject.toml's force-include); in a
checkout or an editable install this package finds them in kernels/ (below).

Runs on a real GPU, or on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) for correctness:
the simulator executes kernels on the CPU, has no timing events and no real overlap.
"""
from pathlib import Path

_checkout = Path(__file__).resolve().parents[2]
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "streamer.py").is_file():
    __path__.append(str(_checkout / "kernels"))
