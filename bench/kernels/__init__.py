"""Kernel and forward benchmarks: the target's forward, the quantized projections, GPUs, offloading,
drafters."""
