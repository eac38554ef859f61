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
# parameters OpenAI defines that this server does not implement: refused unless at their no-op value
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v in (None, {"type": "text"}),
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


# ------------------------------------------------------------------------------------- parsing
def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
        raise ApiError(400, f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def parse_common(
    body: dict[str, Any], prompt_ids: list[int], max_context: int, chat: bool
) -> CompletionRequest:
    for key, is_noop in UNSUPPORTED.items():
        if key in body and not is_noop(body[key]):
            raise ApiError(400, f"'{key}' is not supported by this server", key)
    n = _int(body, "n", 1, 1, 1 << 30)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n}", "n")
    if len(prompt_ids) >= max_context:
        raise ApiError(
            400,
            f"the prompt is {len(prompt_ids)} tokens; this model's context is {max_context}",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    room = max_context - len(prompt_ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if chat else DEFAULT_COMPLETION_TOKENS
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
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
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
        include_usage=bool(opts.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
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
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return clean


def completion_prompt_value(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    """/v1/completions' prompt: one string or one list of token ids (a batch of one is unwrapped)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(p)
    raise ApiError(400, "'prompt' must be one string or one list of token ids", "prompt")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON", None, "invalid_json") from None
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
