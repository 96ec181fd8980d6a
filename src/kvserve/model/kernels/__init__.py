"""Kernels for the model's hot paths, chosen once at load by a KernelBackend (backend.py).

  backend.py      KernelBackend: CPU features -> ISA level, the C library, per-call path thresholds
  build.py        compiles cpu/*.cpp (package data) into the user's cache at first use, loads it
  gguf_linear.py  GGUFQuantLinear: GGUF block quants kept packed, int8 / bf16 / fp32 paths
  fused_linear.py SegmentedQuantLinear: a fused projection whose members keep their own types
  cpu_ops.py      the layer ops in C (one-call forward of small steps, glue between projections)
  reference.py    pure-PyTorch dequantization of the packed formats
"""
