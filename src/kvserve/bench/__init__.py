"""Benchmarks: `kvserve bench latency | kernels | ...`, with peers run side by side."""
