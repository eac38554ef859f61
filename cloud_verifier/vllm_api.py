"""The bodies of vLLM's utility routes on the verifier, which tools written for vLLM call besides
the OpenAI API: `/tokenize`, `/detokenize` and `/version` (`/health` is the service's, beside
`/healthz`). The routes themselves sit with the OpenAI ones (openai_api.install), behind the same
keys, body limits and error bodies; this module turns a parsed body into the answer.

- POST /tokenize {"model"?, "prompt": str, "add_special_tokens"? (true)} or {"model"?, "messages":
  [...], "add_generation_prompt"? (true), "add_special_tokens"? (false)} ->
  {"count": n, "max_model_len": the context a session may use, "tokens": [ids]}
- POST /detokenize {"model"?, "tokens": [ids]} -> {"prompt": text}
- GET /version -> {"version": the package's version}
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from shared.model import Target
from shared.openai_compat import ApiError, chat_messages, text_bytes

# (target, text, add_special) -> token ids (openai_api._encode: lets go of the GIL while it works)
Encoder = Callable[[Target, str, bool], list[int]]


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be true or false, got {type(v).__name__}", key)
    return v


def tokenize(body: dict[str, Any], target: Target, max_context: int, encode: Encoder) -> dict[str, Any]:
    """POST /tokenize: a prompt's token ids, or a chat's through the model's chat template (CPU
    work: call it off the event loop)."""
    if "messages" in body and "prompt" in body:
        raise ApiError(400, "give 'prompt' or 'messages', not both", "messages")
    if "messages" in body:
        messages = chat_messages(body)
        generation = _flag(body, "add_generation_prompt", True)
        special = _flag(body, "add_special_tokens", False)
        try:
            text = target.tokenizer.apply_chat_template(messages, add_generation_prompt=generation)
        except Exception as exc:
            raise ApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
        text_bytes(prompt, "prompt")
        text = prompt
        special = _flag(body, "add_special_tokens", True)
    ids = encode(target, text, special)
    return {"count": len(ids), "max_model_len": max_context, "tokens": ids}


def detokenize(body: dict[str, Any], target: Target) -> dict[str, Any]:
    """POST /detokenize: the text of token ids (special tokens included, as vLLM's)."""
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise ApiError(400, f"'tokens' must be a list of token ids, got {type(ids).__name__}", "tokens")
    vocab = target.config.vocab_size
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            shown = repr(t)[:40] if isinstance(t, int | float | str) else type(t).__name__
            raise ApiError(
                400, f"tokens[{i}] = {shown} is not a token id of this model (0 to {vocab - 1})", "tokens"
            )
    return {"prompt": target.tokenizer.decode(ids)}


def version() -> dict[str, str]:
    """GET /version: the installed package's version."""
    try:
        return {"version": metadata.version("treespec")}
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}
