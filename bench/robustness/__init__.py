"""Robustness runs, not benchmarks: killing the verifier, soaking it, fuzzing it; every output checked."""
