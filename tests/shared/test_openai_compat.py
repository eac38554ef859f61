"""The OpenAI request rules both HTTP endpoints share (shared.openai_compat): every client mistake
is an ApiError with status 400 naming the parameter, never an exception of another kind (a 500),
and no parameter that changes the output is silently ignored."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from shared.openai_compat import (
    DEFAULT_CHAT_TOKENS,
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    chat_messages,
    completion_prompt_value,
    parse_common,
    parse_json_body,
)

HUGE = int("9" * 400)
CONTEXT = 512


def _error(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as exc:
        call(*args)
    return exc.value


def _common(body: dict[str, Any], ids: list[int] | None = None, chat: bool = False) -> Any:
    return parse_common(body, [1, 2, 3] if ids is None else ids, CONTEXT, chat)


@pytest.mark.parametrize("key", ["temperature", "top_p", "top_k", "seed", "max_tokens", "n"])
def test_a_400_digit_number_is_a_400_naming_it(key: str) -> None:
    """float(10**400) raised OverflowError (a 500); the message stays short."""
    for value in (HUGE, -HUGE, float("inf"), float("nan")):
        err = _error(_common, {key: value})
        assert (err.status, err.param) == (400, key), (key, value)
        assert len(err.message) < 200


def test_json_nested_100k_deep_is_a_400() -> None:
    deep = 100_000
    for raw in ("[" * deep + "]" * deep, '{"prompt": ' + '{"a": ' * deep + "1" + "}" * deep + "}"):
        err = _error(parse_json_body, raw.encode())
        assert (err.status, err.code) == (400, "invalid_json") and "JSON" in err.message


def test_an_empty_prompt_is_a_400_naming_it() -> None:
    """It used to reach the engine and fail its packed step (every co-batched session re-ran alone)."""
    assert _error(_common, {}, []).param == "prompt"
    assert _error(_common, {}, [], True).param == "messages"
    prompts: list[Any] = [[], [[]], None, 5]
    for prompt in prompts:
        assert _error(completion_prompt_value, {"prompt": prompt}, 100).param == "prompt"


def test_a_lone_surrogate_is_a_400_naming_the_field() -> None:
    """JSON may carry "\\ud800"; no tokenizer can encode it (UnicodeEncodeError, a 500)."""
    body = json.loads('{"prompt": "a\\ud800b"}')
    err = _error(completion_prompt_value, body, 100)
    assert (err.status, err.param) == (400, "prompt") and "surrogate" in err.message
    err = _error(completion_prompt_value, json.loads('{"prompt": ["a\\udfffb"]}'), 100)
    assert err.param == "prompt"
    for content in ('"a\\udfffb"', '[{"type": "text", "text": "\\ud800"}]'):
        body = json.loads(f'{{"messages": [{{"role": "user", "content": {content}}}]}}')
        err = _error(chat_messages, body)
        assert (err.status, err.param) == (400, "messages") and "messages[0].content" in err.message


def test_a_text_part_that_is_not_a_string_is_a_400() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}
    assert _error(chat_messages, body).param == "messages"


def test_a_prompt_of_ids_longer_than_the_context_is_refused_before_its_items_are_read() -> None:
    err = _error(completion_prompt_value, {"prompt": [1] * CONTEXT + ["x"]}, 100, CONTEXT)
    assert (err.param, err.code) == ("prompt", "context_length_exceeded") and str(CONTEXT) in err.message
    assert completion_prompt_value({"prompt": [1] * (CONTEXT - 1)}, 100, CONTEXT) == [1] * (CONTEXT - 1)


UNSUPPORTED_VALUES: list[tuple[str, Any]] = [
    ("repetition_penalty", 1.3),
    ("min_tokens", 5),
    ("tool_choice", "auto"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("function_call", "auto"),
    ("logit_bias", {"50": 100}),
    ("best_of", 2),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("response_format", {"type": "json_object"}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -0.1),
    ("min_p", 0.1),
    ("ignore_eos", True),
    ("stop_token_ids", [2]),
    ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]),
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"),
    ("guided_choice", ["a", "b"]),
    ("prompt_logprobs", 1),
    ("truncate_prompt_tokens", 10),
    ("chat_template", "{{ messages }}"),
    ("echo", True),
    ("suffix", "x"),
]


@pytest.mark.parametrize(("key", "value"), UNSUPPORTED_VALUES)
def test_a_parameter_that_would_change_the_output_is_refused_naming_it(key: str, value: Any) -> None:
    """repetition_penalty, min_tokens, tool_choice (and their kind) were silently ignored."""
    err = _error(_common, {key: value})
    assert (err.status, err.param) == (400, key) and "not supported" in err.message


NEUTRAL_VALUES: list[tuple[str, Any]] = [
    ("repetition_penalty", 1.0),
    ("repetition_penalty", 1),
    ("min_tokens", 0),
    ("tool_choice", "none"),
    ("tools", []),
    ("logit_bias", {}),
    ("n", 1),
    ("best_of", 1),
    ("logprobs", False),
    ("presence_penalty", 0),
    ("frequency_penalty", 0.0),
    ("response_format", {"type": "text"}),
    ("skip_special_tokens", True),
    ("ignore_eos", False),
    ("stop_token_ids", []),
    ("min_p", 0.0),
    ("user", "someone"),
    ("stop", None),
]


@pytest.mark.parametrize(("key", "value"), NEUTRAL_VALUES)
def test_a_parameter_at_its_neutral_value_is_accepted(key: str, value: Any) -> None:
    assert _common({key: value}).max_tokens == DEFAULT_COMPLETION_TOKENS


def test_ignore_eos_is_parsed_only_where_the_caller_implements_it() -> None:
    """The verifier implements vLLM's ignore_eos (parse_common(ignore_eos=True)); the edge's
    endpoint does not, and refuses it rather than ignore it."""
    assert parse_common({"ignore_eos": True}, [1, 2], CONTEXT, False, ignore_eos=True).ignore_eos
    assert not parse_common({"ignore_eos": False}, [1, 2], CONTEXT, True, ignore_eos=True).ignore_eos
    assert not parse_common({}, [1, 2], CONTEXT, False, ignore_eos=True).ignore_eos
    for value in ("yes", 1, [True]):
        err = _error(
            functools.partial(parse_common, ignore_eos=True), {"ignore_eos": value}, [1, 2], CONTEXT, False
        )
        assert (err.status, err.param) == (400, "ignore_eos") and "boolean" in err.message
    assert _error(_common, {"ignore_eos": True}).param == "ignore_eos"


def test_a_boolean_that_is_not_a_boolean_is_a_400_naming_it() -> None:
    for body, param in (
        ({"stream": "yes"}, "stream"),
        ({"return_token_ids": 1}, "return_token_ids"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": [1]}, "stream_options"),
        ({"stop": [1]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop": ""}, "stop"),
    ):
        assert _error(_common, body).param == param, body


def test_chat_max_tokens_defaults_to_a_bound_not_the_whole_context() -> None:
    assert _common({}, chat=True).max_tokens == min(DEFAULT_CHAT_TOKENS, CONTEXT - 3)
    req = parse_common({}, [1, 2, 3], 100_000, True)
    assert req.max_tokens == DEFAULT_CHAT_TOKENS
    assert parse_common({"max_tokens": 5000}, [1, 2, 3], 100_000, True).max_tokens == 5000
