"""Serving and load benchmarks: many sessions and requests against one verifier, the cloud's cost."""
