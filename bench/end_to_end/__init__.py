"""End-to-end and network benchmarks: the edge and the verifier together, ms/token, tau, round trips."""
