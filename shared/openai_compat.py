"""The OpenAI API's request rules, shared by the verifier's endpoints (cloud_verifier.openai_api)
and the edge's local endpoint (edge_client.serve): parameter checks with OpenAI-style errors naming
the parameter, chat messages, and the shapes of responses and server-sent event chunks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 4 << 20  # a request body (prompt text or messages)
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# chat's default max_tokens (OpenAI's is the whole context): at most this, and the context's room
DEFAULT_CHAT_TOKENS = 1024


def _absent(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


def _one(v: Any) -> bool:
    return v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == 1)


def _zero(v: Any) -> bool:
    return v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == 0)


# parameters of OpenAI's API and vLLM's extensions that this server does not implement: refused,
# naming the parameter, unless at their no-op value (a silently ignored parameter changes the
# output the client asked for without telling it)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "best_of": _one,
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": _zero,
    "frequency_penalty": _zero,
    "logit_bias": _falsy,
    "tools": _falsy,
    "functions": _falsy,
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v in (None, {"type": "text"}),
    "prediction": _absent,
    "audio": _absent,
    "modalities": lambda v: v in (None, ["text"]),
    "web_search_options": _absent,
    # vLLM's sampling and output extensions
    "repetition_penalty": _one,
    "length_penalty": _one,
    "min_p": _zero,
    "min_tokens": _zero,
    "use_beam_search": lambda v: v in (None, False),
    "ignore_eos": lambda v: v in (None, False),
    "stop_token_ids": _falsy,
    "bad_words": _falsy,
    "allowed_token_ids": _absent,
    "include_stop_str_in_output": lambda v: v in (None, False),
    "skip_special_tokens": lambda v: v in (None, True),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "prompt_logprobs": _absent,
    "truncate_prompt_tokens": _absent,
    "logits_processors": _falsy,
    "return_tokens_as_token_ids": lambda v: v in (None, False),
    "guided_json": _absent,
    "guided_regex": _absent,
    "guided_choice": _absent,
    "guided_grammar": _absent,
    "structural_tag": _absent,
    "guided_decoding_backend": _absent,
    "chat_template": _absent,
    "chat_template_kwargs": _falsy,
    "add_generation_prompt": lambda v: v in (None, True),
    "continue_final_message": lambda v: v in (None, False),
    "add_special_tokens": _absent,
    "documents": _falsy,
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the parameter at fault, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request: what to decode and how."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool = False  # vLLM's extension: end-of-text ids do not end the generation


# ------------------------------------------------------------------------------------- parsing
def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    # compare before float(): a 400-digit integer is out of range, not an OverflowError
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be a number in [{lo:g}, {hi:g}], got {_short(v)}", key)
    return float(v)


def _short(v: Any) -> str:
    """A value for an error message, cut short: a container is named by its type (its repr could
    be megabytes, or recurse as deep as the JSON nests), a 400-digit integer by its size."""
    if isinstance(v, (list, dict)):
        return "a list" if isinstance(v, list) else "an object"
    if isinstance(v, int) and v.bit_length() > 64:
        return f"an integer of {len(str(v))} digits"
    r = repr(v[:80]) if isinstance(v, str) else repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be an integer in [{lo}, {hi}], got {_short(v)}", key)
    return v


def _bool(body: dict[str, Any], key: str, where: str | None = None) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{where or key}' must be a boolean, got {_short(v)}", where or key)
    return v


def parse_common(
    body: dict[str, Any], prompt_ids: list[int], max_context: int, chat: bool, *, ignore_eos: bool = False
) -> CompletionRequest:
    """The request's sampling and output parameters, checked (ApiError naming the parameter).
    `max_tokens` (chat also `max_completion_tokens`) defaults to 16 on /v1/completions (OpenAI's
    default) and to the context's room but at most DEFAULT_CHAT_TOKENS on chat. `ignore_eos`: the
    caller implements vLLM's `ignore_eos` field (a boolean), otherwise it is refused unless false."""
    for key, is_noop in UNSUPPORTED.items():
        if key == "ignore_eos" and ignore_eos:
            continue
        if key in body and not is_noop(body[key]):
            raise ApiError(400, f"'{key}' is not supported by this server", key, "unsupported_parameter")
    n = _int(body, "n", 1, 1, 1 << 30)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n}", "n")
    if not prompt_ids:  # the engine needs at least one token to condition on
        raise ApiError(400, "the prompt is empty: give some text or at least one token id",
                       "messages" if chat else "prompt")  # fmt: skip
    if len(prompt_ids) >= max_context:
        raise ApiError(
            400,
            f"the prompt is {len(prompt_ids)} tokens; this model's context is {max_context}",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    room = max_context - len(prompt_ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(room, DEFAULT_CHAT_TOKENS) if chat else DEFAULT_COMPLETION_TOKENS
    max_tokens = _int(body, key, default, 1, 1 << 30)
    assert max_tokens is not None
    if max_tokens > room:
        raise ApiError(
            400,
            f"{key} {max_tokens} + the prompt's {len(prompt_ids)} tokens exceed the context of {max_context}",
            key,
            "context_length_exceeded",
        )
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"'stop': at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_CHARS} chars", "stop"
        )
    seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    stream = _bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
    return CompletionRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 1e4),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(int(_int(body, "top_k", 0, -1, 1 << 30) or 0), 0),  # -1 (vLLM's "off") is 0 here
        seed=(seed % (1 << 63))
        if seed is not None
        else int.from_bytes(uuid.uuid4().bytes[:8], "little") >> 1,
        stop=stops,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        ignore_eos=_bool(body, "ignore_eos") if ignore_eos else False,
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The request's messages as {role, content} (text parts joined; `developer` is `system`)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise ApiError(400, f"messages[{i}]: only text content is supported", "messages")
            if not all(isinstance(c.get("text"), str) for c in content):
                raise ApiError(400, f"messages[{i}]: a text part's 'text' must be a string", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        text_bytes(content, "messages", f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return clean


def text_bytes(text: str, param: str, where: str | None = None) -> int:
    """The UTF-8 length of `text`; a lone surrogate (JSON allows "\\ud800", no tokenizer can
    encode it) is a 400 naming `param`."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"'{where or param}' is not valid Unicode: a lone surrogate at character "
                       f"{exc.start}", param) from None  # fmt: skip


def completion_prompt_value(
    body: dict[str, Any], vocab_size: int, max_context: int | None = None
) -> str | list[int]:
    """/v1/completions' prompt: one string or one list of token ids (a batch of one is unwrapped).
    A string is valid Unicode; a list of ids is non-empty, in the vocabulary and, given
    `max_context`, shorter than it (checked before its items, so a huge list costs nothing)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        text_bytes(p, "prompt")
        return p
    if isinstance(p, list) and max_context is not None and len(p) >= max_context:
        raise ApiError(400, f"the prompt is {len(p)} tokens; this model's context is {max_context}",
                       "prompt", "context_length_exceeded")  # fmt: skip
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(p)
    raise ApiError(400, "'prompt' must be one string or one list of token ids", "prompt")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else (not JSON, nested deeper than Python's
    parser recurses, not an object) is a 400 with the code invalid_json. Nothing downstream
    recurses into the values (error messages name a container's type, not its repr)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON", None, "invalid_json") from None
    except RecursionError:  # the parser recurses per level: 100k nested brackets end here
        raise ApiError(400, "the body is not valid JSON here: nested too deeply", None,
                       "invalid_json") from None  # fmt: skip
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    """A whole response's choice."""
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": None}  # fmt: skip
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


def chunk_choice(chat: bool, piece: str, finish: str | None) -> dict[str, Any]:
    """A streamed chunk's choice (chat: a delta)."""
    c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        c["delta"] = {"content": piece} if piece or finish is None else {}
    else:
        c["text"] = piece
    return c


def sse(rid: str, created: int, model: str, chat: bool, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """One server-sent event holding a chunk object."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    doc = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
