"""Numba CUDA kernels and the layer streamer (SPEC part C).

Runs on a real GPU, or on Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) for correctness:
the simulator executes kernels on the CPU, has no timing events and no real overlap.
"""
