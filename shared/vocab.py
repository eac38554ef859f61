"""The vocabulary fingerprint (DESIGN section 3.2).

sha256 over: u32 LE vocab_size, then for each id in order: u32 LE byte length + the UTF-8 bytes of
the token's text as stored in the model (GGUF `tokenizer.ggml.tokens`, Hugging Face `tokenizer.json`
vocab, llama.cpp `llama_vocab_get_text`). Edge and cloud compare it at `hello`: a draft model
whose ids mean other strings than the target's can never be verified.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def vocab_fingerprint(tokens: Sequence[str | bytes]) -> str:
    """Hex sha256 fingerprint of a vocabulary given as token texts in id order."""
    h = hashlib.sha256()
    h.update(struct.pack("<I", len(tokens)))
    for tok in tokens:
        data = tok if isinstance(tok, bytes) else tok.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.hexdigest()
