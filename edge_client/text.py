"""Text on the edge: chat messages, incremental detokenization, stop strings.

Detokenization works on bytes: a token may end in the middle of a UTF-8 character (byte-level BPE),
so pieces are fed to an incremental decoder that holds an incomplete character back until the next
token completes it. Stop strings are matched on the decoded text.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

ChatMessage = dict[str, str]  # {"role": ..., "content": ...}; not shared.messages.Message (a wire frame)


def as_messages(prompt: str | Sequence[ChatMessage]) -> list[ChatMessage]:
    """A plain prompt becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class IncrementalDetokenizer:
    """Turns token ids into text chunks that never split a UTF-8 character.

    `piece(id) -> bytes` is the token's byte string (llama.cpp `token_to_piece`).
    """

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, tokens: Sequence[int]) -> str:
        data = b"".join(self._piece(int(t)) for t in tokens)
        chunk = self._decoder.decode(data, final=False)
        self.text += chunk
        return chunk

    def flush(self) -> str:
        chunk = self._decoder.decode(b"", final=True)
        self.text += chunk
        return chunk


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in text[start':] (searching a little before
    `start` so a stop string split across chunks is found), or None."""
    best: int | None = None
    longest = max((len(s) for s in stops), default=0)
    lo = max(0, start - longest + 1)
    for s in stops:
        if not s:
            continue
        i = text.find(s, lo)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
