from __future__ import annotations

from edge_client.tokenizer import IncrementalDetokenizer, as_messages, find_stop


def test_detokenizer_never_splits_a_utf8_character() -> None:
    text = "héllo 🌍 wörld"
    data = text.encode()
    pieces = [data[i : i + 1] for i in range(len(data))]  # one byte per "token": splits every character
    d = IncrementalDetokenizer(lambda t: pieces[t])
    chunks = [d.push([i]) for i in range(len(pieces))]
    chunks.append(d.flush())
    assert "".join(chunks) == text
    for c in chunks:
        c.encode("utf-8")  # every chunk is whole characters: no lone surrogates / replacement chars
        assert "\ufffd" not in c
    # a chunk is empty exactly while a multi-byte character is incomplete
    assert chunks[1] == "" and chunks[2] == "é"


def test_find_stop_across_chunks() -> None:
    assert find_stop("abc STOP def", ["STOP"]) == 4
    text = "one two thr"
    assert find_stop(text, ["three"], start=len(text)) is None
    text += "ee four"
    assert find_stop(text, ["three"], start=len("one two thr")) == 8  # split across two chunks
    assert find_stop("x", [""]) is None
    assert find_stop("a END b STOP", ["STOP", "END"]) == 2


def test_plain_prompt_is_one_user_turn() -> None:
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert as_messages(msgs) == msgs
