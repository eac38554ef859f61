"""Triton kernels and the plain-torch references that CPU CI tests them against.

`treespec_kernels.cpu_attention`: the batch-invariant CPU kernels of the float32 target (tree attention,
RMSNorm, the pool's tiled-key writer; C++ in `csrc/`, built with torch's cpp_extension on first
use) and the torch reference of the attention.

`treespec_kernels.quant_matmul`: projections straight from a GGUF's quantized blocks (Q8_0, Q5_0,
Q4_K, Q6_K), batch-invariant by construction, with a torch reference equal bit for bit.

`treespec_kernels.tree_attention`: one fused launch of tree attention over the paged KV cache for every
session's packed rows (prefill chunks, tree rounds, single steps), its checking launcher and its
torch reference; `bench.tree_attention` times it against the model's per-session SDPA path.
Unlike the batch-invariant CPU kernel (`treespec_kernels/csrc/cpu_attention.cpp`), its sums
are blocked by key tile (a tree node's keys fall into other tiles than when its path is decoded
alone), so it is not bit-identical to one-token decoding.
"""
