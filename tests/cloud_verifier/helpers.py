"""Shared pieces of the cloud-verifier model tests: random trees and the incremental-decoding oracle."""

from __future__ import annotations

import random

import torch

from bench.harness import DATA
from shared.model import LlamaModel, decode_step, prefill
from shared.model.kv_cache import PagedKVCache
from shared.tree import TokenTree

PROMPTS = DATA  # the prompt sets in bench/data


def random_tree(rng: random.Random, num_nodes: int, vocab: int, base: int, cond: list[int]) -> TokenTree:
    """A random deterministic tree (distinct sibling tokens), depth favoured by a parent bias."""
    tokens: list[int] = []
    parents: list[int] = []
    used: set[tuple[int, int]] = set()
    for i in range(num_nodes):
        parent = -1 if i == 0 or rng.random() < 0.2 else rng.randint(max(-1, i - 4), i - 1)
        tok = rng.randrange(vocab)
        while (parent, tok) in used:
            tok = rng.randrange(vocab)
        used.add((parent, tok))
        tokens.append(tok)
        parents.append(parent)
    return TokenTree.build(tokens, parents, base, cond)


def incremental_logits(
    model: LlamaModel, committed: list[int], tree: TokenTree, num_blocks: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: one-token-at-a-time decoding. Returns ([L, vocab] logits after each committed
    token, [N, vocab] logits after each node, decoded along its root-to-node path)."""
    kv = model.new_kv_cache(num_blocks, 16)
    kv.add(0)
    committed_logits = []
    for tok in committed:
        (row,) = model.forward_packed([decode_step(0, tok, kv.cached_len(0))], kv)
        kv.commit_rows(0, [0])
        committed_logits.append(row[0])
    base = len(committed)
    nodes: list[torch.Tensor | None] = [None] * tree.num_nodes
    depth = tree.depth.tolist()
    for i in tree.dfs_order():  # pre-order: the cache then holds exactly the node's ancestors
        kv.truncate(0, base + depth[i] - 1)
        (row,) = model.forward_packed([decode_step(0, int(tree.tokens[i]), kv.cached_len(0))], kv)
        kv.commit_rows(0, [0])
        nodes[i] = row[0]
    return torch.stack(committed_logits), torch.stack([n for n in nodes if n is not None])


def straight_cache(model: LlamaModel, tokens: list[int], num_blocks: int = 512) -> PagedKVCache:
    """A cache holding `tokens`, written by one causal prefill."""
    kv = model.new_kv_cache(num_blocks, 16)
    kv.add(0)
    prefill(model, kv, 0, tokens)
    return kv


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
