"""A drafter whose logits are a pure function of the token sequence: fast, exact, model-free.

Used to test the Drafter base class bookkeeping and the tree builders (node counts, ranks, draws,
sampling statistics) without paying for a real model. Logits of a prefix come from a generator
seeded by a hash of the whole prefix, with a few strongly favoured tokens so that trees look like
a real draft's (a confident top-1 most of the time).
"""

from __future__ import annotations

import hashlib

import numpy as np

from edge_client.drafters.base import Drafter
from edge_client.tokenizer import EdgeTokenizer


class FakeTokenizer(EdgeTokenizer):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = (0,)
        self.bos_id = None
        self.chat_template = None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [1 + (b % (self.vocab_size - 1)) for b in text.encode()]

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return f"<{token}>".encode()

    def token_texts(self) -> list[bytes]:
        return [f"<{i}>".encode() for i in range(self.vocab_size)]


def fake_logits(prefix: list[int], vocab_size: int) -> np.ndarray:
    """[V] float32 logits after `prefix`, deterministic in the prefix."""
    digest = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    logits = rng.normal(0.0, 1.0, vocab_size)
    hot = rng.choice(vocab_size, size=3, replace=False)
    logits[hot] += rng.uniform(1.0, 5.0, size=3)
    return logits.astype(np.float32)


class FakeDrafter(Drafter):
    name = "fake"

    def __init__(
        self, vocab_size: int = 64, *, max_context: int = 1024, max_nodes: int = 256, max_leaves: int = 255
    ) -> None:
        super().__init__()
        self.model_id = "fake"
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.max_nodes = max_nodes
        self.max_leaves = max_leaves
        self.tokenizer = FakeTokenizer(vocab_size)
        self.evaluated_tokens = 0  # tokens the "model" computed (sync tails + extend nodes)
        self._state: list[int] = []

    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        self._state = self._state[:keep] + [self._tokens[n] for n in path] + tail
        self.evaluated_tokens += len(tail)
        return fake_logits(self._state, self.vocab_size) if tail else None

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        self.evaluated_tokens += count
        rows = []
        for i in range(first, first + count):
            path = [self._tokens[n] for n in self.path_to(i)]
            rows.append(fake_logits(self._state + path, self.vocab_size))
        return np.stack(rows)

    def _drop_workspace(self) -> None:
        pass
