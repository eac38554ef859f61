"""A tokenizer read from files beside an exported model, with no torch and no llama.cpp.

An ONNX export (edge_client.onnx.export) stores the cloud runtime's tokenizer of its source GGUF
as `tokenizer.json` (the `tokenizers` serialization), `tokens.json` (the token texts in id order,
as the GGUF stores them: the input of the vocabulary fingerprint) and a few fields in the manifest
(BOS, end-of-generation ids, chat template), the same files the verifier's weight cache keeps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_client.tokenizer import EdgeTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENS_FILE = "tokens.json"


def byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable character table (GPT-2 style vocabularies).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    shifted to code points 256, 257, ... in byte order, so every byte has a visible stand-in.
    (Here, in a module without torch, so the torch drafter and the stored tokenizer share it.)
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def plain_text_copy(tok: Any) -> Any:
    """A copy of a `tokenizers.Tokenizer` that encodes special-token texts (e.g. "<|im_end|>") as
    ordinary text: what `encode(..., parse_special=False)` means for a raw prompt."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tok.to_str())
    copy.encode_special_tokens = True
    return copy


class StoredTokenizer(EdgeTokenizer):
    """The edge interface over a stored `tokenizers` tokenizer and its token texts."""

    def __init__(
        self,
        folder: Path,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None,
    ) -> None:
        from tokenizers import Tokenizer, decoders

        self._tok = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        texts = json.loads((folder / TOKENS_FILE).read_text(encoding="utf-8"))
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{folder / TOKENS_FILE}: expected a JSON list of token texts")
        self._texts: list[str] = texts
        self.vocab_size = len(texts)
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.chat_template = chat_template
        added = self._tok.get_added_tokens_decoder()
        self._special = {int(i) for i, t in added.items() if t.special}
        self._bytes = byte_decoder() if isinstance(self._tok.decoder, decoders.ByteLevel) else None
        self._plain_tok: Any = None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tok = self._tok if parse_special else self._plain()
        return list(tok.encode(text, add_special_tokens=add_special).ids)

    def _plain(self) -> Any:
        """A copy of the tokenizer that reads special-token texts as plain text (raw prompts)."""
        if self._plain_tok is None:
            self._plain_tok = plain_text_copy(self._tok)
        return self._plain_tok

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is out of range [0, {self.vocab_size})")
        text = self._texts[token]
        if token in self._special:
            return text.encode("utf-8") if special else b""
        if self._bytes is not None and all(ch in self._bytes for ch in text):
            return bytes(self._bytes[ch] for ch in text)
        return str(self._tok.decode([token])).encode("utf-8")

    def token_texts(self) -> list[bytes]:
        return [t.encode("utf-8") for t in self._texts]
