from __future__ import annotations

from pathlib import Path

import pytest

from edge_client.tokenizer import LlamaCppTokenizer
from shared.vocab import vocab_fingerprint


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> LlamaCppTokenizer:
    return LlamaCppTokenizer(smollm2_path)


def test_round_trip_keeps_bytes(tok: LlamaCppTokenizer) -> None:
    text = "Hello, wörld! 你好 🙂 tabs\tand\nnewlines"
    ids = tok.encode(text)
    assert tok.vocab_size == 49152
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids).decode("utf-8") == text
    # a multi-byte character may be split across tokens: pieces are bytes, joined before decoding
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_special_tokens_parse_and_render(tok: LlamaCppTokenizer) -> None:
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1  # <|im_start|> is one special token
    assert tok.decode(ids) == b"user"  # control tokens render as nothing by default
    assert tok.decode(ids, special=True) == b"<|im_start|>user"
    assert tok.encode("<|im_start|>", parse_special=False) != [1]


def test_long_text_grows_the_buffer(tok: LlamaCppTokenizer) -> None:
    text = "ab " * 3000
    assert tok.decode(tok.encode(text)).decode() == text


def test_eos_and_chat_template(tok: LlamaCppTokenizer) -> None:
    assert 2 in tok.eos_ids  # <|im_end|>
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.render_chat([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


def test_fingerprint_is_over_the_gguf_token_texts(tok: LlamaCppTokenizer, smollm2_path: Path) -> None:
    import gguf

    texts = gguf.GGUFReader(smollm2_path).fields["tokenizer.ggml.tokens"].contents()
    assert tok.token_texts()[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    assert tok.fingerprint == vocab_fingerprint(texts)


def test_out_of_range_token_is_refused(tok: LlamaCppTokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.token_bytes(tok.vocab_size)
