"""Triton kernels (tree attention) and the plain-torch references that CPU CI tests them against.

The fused Triton tree-attention kernel is not built yet. Its references are the verifier's two
attention paths (`cloud_verifier.model.llama`): scaled_dot_product_attention with the tree mask,
and on CPUs the batch-invariant C++ kernel (`cloud_verifier/model/csrc/cpu_kernels.cpp`),
whose fixed reduction order is the scheme a GPU kernel would follow to stay bit-identical to
one-token decoding.
"""
