"""Triton kernels and the plain-torch references that CPU CI tests them against.

`kernels.tree_attention`: one fused launch of tree attention over the paged KV cache for every
session's packed rows (prefill chunks, tree rounds, single steps), its checking launcher and its
torch reference; `bench.tree_attention` times it against the model's per-session SDPA path.
Unlike the batch-invariant CPU kernel (`cloud_verifier/model/csrc/cpu_kernels.cpp`), its sums
are blocked by key tile (a tree node's keys fall into other tiles than when its path is decoded
alone), so it is not bit-identical to one-token decoding.
"""
