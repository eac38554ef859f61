"""When a conditional tree matches the committed sequence S: `base + len(cond) == len(S)` and
`S[base:] == cond` (`tree_matches`), and whether it still may as S grows (`can_still_match`).
Both sides of the session protocol decide with these."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.tree import TokenTree


def tree_matches(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> bool:
    """PROTOCOL.md section 5: base + len(cond) == len(S) and S[base:] == cond."""
    n = len(committed)
    if tree.committed_len != n or tree.base > n:
        return False
    return bool(
        np.array_equal(np.asarray(committed[tree.base :], dtype=np.int64), tree.cond.astype(np.int64))
    )


def can_still_match(tree: TokenTree, committed: Sequence[int] | np.ndarray, growing: bool) -> bool:
    """Whether `tree` matches S now or may match once S grows (growing: a round is in flight).

    A round in flight always adds at least one token, so while one is in flight a tree for the
    current length is already dead.
    """
    n = len(committed)
    if tree.base > n:
        return False
    known = np.asarray(committed[tree.base :], dtype=np.int64)
    cond = tree.cond.astype(np.int64)
    if known.size > cond.size or not np.array_equal(cond[: known.size], known):
        return False
    if known.size == cond.size:
        return not growing
    return True
