"""Triton kernels (tree attention) and the plain-torch references that CPU CI tests them against.

The fused tree-attention kernel is not built yet; the verifier's torch path
(`cloud_verifier.model.llama`, scaled_dot_product_attention with the tree mask) is its reference.
"""
