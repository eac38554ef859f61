"""The vocabulary fingerprint (PROTOCOL.md section 8).

sha256 over: u32 LE vocab_size, then for each id in order: u32 LE byte length + the UTF-8 bytes of
the token's text as stored in the model (GGUF `tokenizer.ggml.tokens`, Hugging Face `tokenizer.json`
vocab, llama.cpp `llama_vocab_get_text`). Edge and cloud compare it at `hello`: a draft model
whose ids mean other strings than the target's can never be verified.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence


def vocab_fingerprint(tokens: Sequence[str | bytes]) -> str:
    """Hex sha256 fingerprint of a vocabulary given as token texts in id order."""
    h = hashlib.sha256()
    h.update(struct.pack("<I", len(tokens)))
    for tok in tokens:
        data = tok if isinstance(tok, bytes) else tok.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.hexdigest()


# Texts of special tokens that end a turn or a document in the chat models this project runs
# (ChatML, Llama 3, Phi, Gemma, DeepSeek). A model's declared eos/eot/eom ids are always included;
# a token with one of these texts counts only when the model marks it special (control), so an
# ordinary token that happens to read "</s>" never ends generation. Deliberately left out: fill-in-
# the-middle and repository markers (Qwen's <|fim_pad|>, <|repo_name|>, <|file_sep|>), which
# llama.cpp's heuristics add to its end-of-generation set but which a chat generation may emit
# and which Hugging Face's generation config of those models does not stop on.
END_MARKERS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<｜end▁of▁sentence｜>",
    }
)


def end_of_generation_ids(
    declared: Iterable[int | None], texts: Sequence[str | bytes], special: Iterable[int]
) -> tuple[int, ...]:
    """The ids that end generation, the same rule on the edge and in the cloud.

    declared: the model's own eos / eot / eom ids (None entries are skipped); texts: every token's
    stored text in id order; special: ids of control (special) tokens.
    """
    out = {int(i) for i in declared if i is not None and 0 <= int(i) < len(texts)}
    for i in special:
        t = texts[i]
        if (t.decode("utf-8", "replace") if isinstance(t, bytes) else t) in END_MARKERS:
            out.add(int(i))
    return tuple(sorted(out))
