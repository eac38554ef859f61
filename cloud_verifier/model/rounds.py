"""Building the SeqInputs of the three kinds of work an engine step packs (DESIGN section 3.1).

- a tree round: the committed-but-uncached tail of the sequence (at least its last token, row 0)
  followed by the tree's nodes; the tail is causal, each node sees the whole tail, its ancestors
  and itself. After the verdict, `round_keep(len(tail), accepted_nodes)` are the rows to commit.
- a prefill chunk: causal rows continuing the cache, logits for the last row only.
- a decode step: one row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cloud_verifier.model.inputs import SeqInput
from shared.tree import TokenTree


def tree_round(seq_id: int, tree: TokenTree, tail: Sequence[int], all_logits: bool = True) -> SeqInput:
    """Rows = tail + nodes. `tail` ends with the last committed token (row 0) and holds the
    committed tokens not yet in the cache, so it sits at positions L - len(tail) .. L - 1 with
    L = tree.committed_len. Logits: every row from row 0 on (all_logits) or row 0 and the nodes."""
    pre, n = len(tail), tree.num_nodes
    if pre < 1:
        raise ValueError("a tree round needs at least row 0 (the last committed token)")
    length = tree.committed_len
    rows = pre + n
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    mask[:pre, :pre] = torch.ones(pre, pre, dtype=torch.bool).tril_()
    mask[pre:, :pre] = True
    mask[pre:, pre:] = torch.from_numpy(tree.ancestor_mask())
    tokens = torch.tensor([*map(int, tail), *tree.tokens.tolist()], dtype=torch.int64)
    positions = torch.cat(
        (
            torch.arange(length - pre, length, dtype=torch.int64),
            torch.from_numpy(tree.positions).to(torch.int64),
        )
    )
    first = 0 if all_logits else pre - 1
    return SeqInput(seq_id, tokens, positions, mask, torch.arange(first, rows, dtype=torch.int64))


def round_keep(tail_len: int, accepted_nodes: Sequence[int]) -> list[int]:
    """Rows of a tree round to commit: the whole tail, then the accepted nodes' rows."""
    return [*range(tail_len), *(tail_len + int(i) for i in accepted_nodes)]


def prefill_chunk(seq_id: int, tokens: Sequence[int], start: int, logits_last: bool = True) -> SeqInput:
    """Causal rows at positions start.. (start = the sequence's cached length)."""
    n = len(tokens)
    rows = torch.tensor([n - 1] if logits_last else [], dtype=torch.int64)
    return SeqInput(
        seq_id,
        torch.tensor(list(map(int, tokens)), dtype=torch.int64),
        torch.arange(start, start + n, dtype=torch.int64),
        None,
        rows,
    )


def decode_step(seq_id: int, token: int, position: int) -> SeqInput:
    """One row with its logits (target-only autoregressive decoding)."""
    return SeqInput(
        seq_id,
        torch.tensor([int(token)], dtype=torch.int64),
        torch.tensor([int(position)], dtype=torch.int64),
        None,
        torch.zeros(1, dtype=torch.int64),
    )
