"""What a packed forward takes for each sequence (`SeqInput`), its checks (`check_input`), and the
masks built from it: which new rows a row may see (`allowed_rows`), the additive attention mask
(`attention_mask`), and each sequence's rows in the packed batch (`row_bounds`).

The SeqInputs of the three kinds of work an engine step packs (docs/architecture.md §3.1) are built here
too:

- a tree round (`tree_round`): the committed-but-uncached tail of the sequence (at least its last
  token, row 0) followed by the tree's nodes; the tail is causal, each node sees the whole tail,
  its ancestors and itself. After the verdict, `round_keep(len(tail), accepted_nodes)` are the
  rows to commit.
- a prefill chunk (`prefill_chunk`): causal rows continuing the cache, logits for the last row only.
- a decode step (`decode_step`): one row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.tree import TokenTree


@dataclass
class SeqInput:
    """One sequence's rows in a packed forward.

    Every row attends to all the sequence's cached positions [0, kv.cached_len(seq_id)) and to
    the new rows that `tree_mask` allows (None: causal among the new rows).
    """

    seq_id: int  # KV-cache sequence id
    tokens: torch.Tensor  # [n] int64, the new rows
    positions: torch.Tensor  # [n] int64 absolute positions (RoPE)
    tree_mask: torch.Tensor | None  # [n, n] bool, True = row i may attend to row j; None = causal
    logit_rows: torch.Tensor  # [k] int64 indices into the n rows whose logits are wanted

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel())


def row_bounds(inputs: list[SeqInput]) -> list[tuple[int, int]]:
    out, a = [], 0
    for x in inputs:
        out.append((a, a + x.num_rows))
        a += x.num_rows
    return out


def allowed_rows(x: SeqInput) -> torch.Tensor:
    """[n, n] bool on the CPU: new row i may attend to new row j (the tree mask, or causal)."""
    if x.tree_mask is not None:
        return x.tree_mask.to("cpu").contiguous()
    return torch.ones(x.num_rows, x.num_rows, dtype=torch.bool).tril_()


def attention_mask(
    x: SeqInput, cached: int, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """[group * n, cached + n] additive mask (0 = attend, -inf = not), or None when every row may
    see every key (a single row).

    Rows are ordered group-major to match the stacked GQA queries; the mask broadcasts over KV
    heads. It is built once per forward in the model's dtype so no layer re-converts it.
    """
    n = x.num_rows
    if n == 1:
        return None
    if x.tree_mask is not None:
        allowed = x.tree_mask.to(device)
    else:
        allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    if cached:
        allowed = torch.cat((torch.ones(n, cached, dtype=torch.bool, device=device), allowed), dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return mask.repeat(group, 1) if group > 1 else mask


def check_input(x: SeqInput, vocab_size: int) -> None:
    """Refuse a malformed SeqInput before the forward reserves or writes anything.

    Shapes are always checked; value ranges only for CPU tensors (on a GPU they would cost a
    device sync per input; the engine validates ids where they arrive, docs/architecture.md §7).
    """
    n = x.num_rows
    if x.tokens.dim() != 1 or x.positions.shape != x.tokens.shape:
        raise ValueError("tokens and positions must be 1-D of one length")
    if n == 0:
        raise ValueError("a SeqInput needs at least one row")
    if x.tree_mask is not None and (x.tree_mask.shape != (n, n) or x.tree_mask.dtype != torch.bool):
        raise ValueError(f"tree_mask must be [{n}, {n}] bool")
    if x.logit_rows.dim() != 1:
        raise ValueError("logit_rows must be 1-D")
    if x.tokens.device.type != "cpu":
        return
    if int(x.tokens.min()) < 0 or int(x.tokens.max()) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if x.tree_mask is not None and not bool(x.tree_mask.diagonal().all()):
        raise ValueError("tree_mask must let every row attend to itself")
    if x.logit_rows.numel() and (int(x.logit_rows.min()) < 0 or int(x.logit_rows.max()) >= n):
        raise ValueError(f"logit_rows must be in [0, {n})")


# ---------------------------------------------------------------------------------------------------
# The rows of one round, one prefill chunk, one decode step


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
