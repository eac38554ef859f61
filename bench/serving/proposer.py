"""Prompt-lookup drafting: token trees from the context alone, with no draft model.

The load bench needs trees shaped like an edge client's (a deep likely chain plus a sibling
branch, with a real mix of accepted and rejected nodes) at almost no cost, so that the time it
measures is the verifier's and not a drafter's. N-gram lookup in the context gives that: text
often repeats spans of itself or of its prompt (summaries, extraction, code, a small model's
loops), so the tokens that followed an earlier occurrence of the current suffix are a good guess.
This is "prompt lookup decoding" (A. Saxena, 2023), the training-free relative of LLMA
(arXiv 2304.04487). The trees are deterministic (greedy / match modes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shared.tree import TokenTree


@dataclass(frozen=True)
class LookupConfig:
    nodes: int = 12  # tree size; what the chain leaves goes to the second branch
    depth: int = 8  # longest branch
    max_ngram: int = 3  # longest suffix looked up; longer matches are tried first
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.depth < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"bad lookup config {self}")


def continuations(context: Sequence[int] | np.ndarray, config: LookupConfig) -> Iterator[list[int]]:
    """Candidate continuations of `context`, best first, without repeats.

    Best = the longest suffix n-gram that occurred earlier, then the most recent occurrence
    (recent text predicts the next tokens better than text far back). A continuation that runs
    into the end of the context repeats the span it copied, so a loop keeps predicting itself for
    the whole depth.
    """
    ctx = np.asarray(context, dtype=np.int64)  # [L]
    L = int(ctx.size)
    seen: set[tuple[int, ...]] = set()
    for n in range(min(config.max_ngram, L - 1), config.min_ngram - 1, -1):
        # windows start at i = 0 .. L-n-1: the match ends before the last token, so the
        # continuation ctx[i+n:] is never empty and the suffix does not match itself
        windows = sliding_window_view(ctx[:-1], n)  # [L - n, n]
        starts = np.flatnonzero((windows == ctx[L - n :]).all(axis=1))[::-1]
        for i in starts.tolist():
            cont = ctx[i + n : i + n + config.depth].tolist()
            period = L - (i + n)
            while len(cont) < config.depth:  # ran into the end: copy on, as LZ77 copies overlap
                cont.append(cont[len(cont) - period])
            key = tuple(cont)
            if key not in seen:
                seen.add(key)
                yield cont


def fallback(context: Sequence[int] | np.ndarray, depth: int) -> list[int]:
    """No earlier match: guess that the most recent tokens repeat (the cheapest loop prior)."""
    return [int(t) for t in context[-depth:]]


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def propose(context: Sequence[int] | np.ndarray, config: LookupConfig = LookupConfig()) -> TokenTree:
    """A tree for the round after `context` (the committed tokens, prompt included).

    The best continuation becomes a chain of up to `depth` nodes; the next-best one that adds a
    node (or the repeat-the-tail fallback) becomes a second branch with the nodes left over. The
    tree has at least one node whenever the context is not empty.
    """
    if len(context) == 0:
        raise ValueError("prompt lookup needs a non-empty context")
    found = continuations(context, config)
    chain = next(found, None) or fallback(context, config.depth)
    chain = chain[: config.nodes]
    seqs = [chain]
    room = config.nodes - len(chain)
    if room > 0:
        for cand in itertools.chain(found, [fallback(context, config.depth)]):
            common = _shared_prefix(chain, cand)
            if common < len(cand):  # not a prefix of the chain: it adds nodes
                seqs.append(cand[: common + room])
                break
    return TokenTree.from_sequences(seqs, base=len(context))
