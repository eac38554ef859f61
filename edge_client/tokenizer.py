"""Text on the edge: the tokenizer (text <-> token ids for the draft model, from the draft's own
GGUF), chat messages, incremental detokenization and stop strings.

The edge and the cloud must agree on what every id means; that is checked once per session with
the vocabulary fingerprint (PROTOCOL.md section 8), computed here from the token texts exactly as the
GGUF stores them (`tokenizer.ggml.tokens`, which llama.cpp returns from `llama_vocab_get_text`).

Decoding returns BYTES, not str: a byte-level BPE token may hold part of a UTF-8 character, so the
streaming client feeds pieces to an incremental decoder (`IncrementalDetokenizer`) that holds an
incomplete character back until the next token completes it. Stop strings are matched on the
decoded text.
"""

from __future__ import annotations

import abc
import codecs
import ctypes
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from shared.vocab import end_of_generation_ids, vocab_fingerprint


class EdgeTokenizer(abc.ABC):
    """What the edge needs from a tokenizer. `vocab_size` is the number of ids (ids are [0, vocab_size))."""

    vocab_size: int
    eos_ids: tuple[int, ...]  # ids that end generation (end-of-generation tokens of the model)
    bos_id: int | None
    chat_template: str | None  # Jinja2 source from the model's metadata, None if it has none

    @abc.abstractmethod
    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special: add BOS etc. if the model asks for it; parse_special:
        text such as "<|im_start|>" becomes the special token (needed for chat-templated prompts)."""

    @abc.abstractmethod
    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes token `token` stands for; special/control tokens give b"" unless `special`."""

    @abc.abstractmethod
    def token_texts(self) -> list[bytes]:
        """Every token's stored text in id order (the input of the vocabulary fingerprint)."""

    def decode(self, tokens: Sequence[int], *, special: bool = False) -> bytes:
        """The bytes of a token sequence (concatenated pieces; may end inside a UTF-8 character)."""
        return b"".join(self.token_bytes(int(t), special=special) for t in tokens)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 vocabulary fingerprint of PROTOCOL.md section 8 (hex)."""
        return vocab_fingerprint(self.token_texts())

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation under the model's chat template (sandboxed Jinja2)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: pass the prompt raw")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        template = env.from_string(self.chat_template)
        bos = self.token_bytes(self.bos_id, special=True).decode("utf-8", "replace") if self.bos_id else ""
        eos = (
            self.token_bytes(self.eos_ids[0], special=True).decode("utf-8", "replace") if self.eos_ids else ""
        )
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            raise_exception=raise_exception,
        )


class LlamaCppTokenizer(EdgeTokenizer):
    """The tokenizer of a GGUF file, run by llama.cpp (loads the vocabulary only, ~70 ms)."""

    def __init__(self, path: str | Path) -> None:
        import llama_cpp as llama

        from edge_client.llama_native import NativeModel

        self._llama: Any = llama
        self._model = NativeModel(path, vocab_only=True)
        vocab = self._model.vocab
        self._vocab: Any = vocab
        self.path = Path(path)
        self.vocab_size = self._model.n_vocab
        control = llama.LLAMA_TOKEN_ATTR_CONTROL
        texts = self.token_texts()
        self.eos_ids = end_of_generation_ids(
            (self._meta_id(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")),
            texts,
            [i for i in range(self.vocab_size) if int(llama.llama_vocab_get_attr(vocab, i)) & control],
        )
        bos = int(llama.llama_vocab_bos(vocab))
        self.bos_id = bos if bos >= 0 else None
        self.chat_template = self._model.meta("tokenizer.chat_template")

    def _meta_id(self, key: str) -> int | None:
        value = self._model.meta(key)
        return int(value) if value is not None and value.lstrip("-").isdigit() else None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        while True:
            buf = (self._llama.llama_token * n_max)()
            n = int(
                self._llama.llama_tokenize(
                    self._vocab, data, len(data), buf, n_max, add_special, parse_special
                )
            )
            if n >= 0:
                return list(buf[:n])
            n_max = -n  # too small: llama.cpp says how many ids it needs

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is out of range [0, {self.vocab_size})")
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(self._llama.llama_token_to_piece(self._vocab, token, buf, size, 0, special))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def token_texts(self) -> list[bytes]:
        get = self._llama.llama_vocab_get_text
        return [bytes(get(self._vocab, i) or b"") for i in range(self.vocab_size)]

    def close(self) -> None:
        self._model.close()


# ---------------------------------------------------------------------------------------------------
# Text: chat messages, incremental detokenization, stop strings

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
