"""vLLM's utility routes on the verifier, which tools written for vLLM probe and call: GET /health
(load tools validate a backend with it, and stopped at our 404), /version, POST /tokenize and
/detokenize, behind the OpenAI routes' keys, body limits and error bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cloud_verifier.openai_api import chat_prompt
from shared.openai_compat import MAX_BODY_BYTES
from tests.cloud_verifier.service import BASE, service, tiny

KEY = {"Authorization": "Bearer k-1"}
MESSAGES = [{"role": "user", "content": "Write a haiku about rain."}]


@pytest.fixture(scope="module")
def client() -> Any:
    with service() as c:
        yield c


def _error(r: Any, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param and err["message"], err
    return err


def test_health_is_200_with_an_empty_body_while_serving(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.content == b""


def test_health_is_503_while_draining() -> None:
    with service() as c:
        c.app.state.verifier.draining = True  # type: ignore[attr-defined]
        assert c.get("/health").status_code == 503
        c.app.state.verifier.draining = False  # type: ignore[attr-defined]


def test_version_names_the_package_version(client: TestClient) -> None:
    r = client.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_tokenize_a_prompt_as_the_target_does(client: TestClient) -> None:
    t = tiny()
    text = "def fib(n):\n    return n"
    want = t.tokenizer.encode(text, add_special=True)
    r = client.post("/tokenize", json={"model": t.model_id, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(want), "max_model_len": BASE.max_context, "tokens": want}
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == t.tokenizer.encode(text, add_special=False)


def test_tokenize_messages_through_the_chat_template(client: TestClient) -> None:
    t = tiny()
    want = chat_prompt({"messages": MESSAGES}, t)  # what /v1/chat/completions generates from
    r = client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] != want and want[: len(bare["tokens"])] == bare["tokens"]


def test_detokenize_gives_the_text_back(client: TestClient) -> None:
    text = "Write a haiku about rain."
    ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = client.post("/detokenize", json={"model": tiny().model_id, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"model": 7, "prompt": "hi"}, 400, "model"),
        ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "hi"}, 400, "messages"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 1}, 400, "add_generation_prompt"),
    ],
)
def test_a_bad_request_is_a_400_or_404_naming_the_field(
    client: TestClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    err = _error(client.post(path, json=body), status, param)
    if path == "/detokenize" and status == 400 and isinstance(body.get("tokens"), list):
        assert "tokens[" in err["message"] and "0 to 49151" in err["message"], err


def test_bodies_are_held_to_the_openai_routes_limits(client: TestClient) -> None:
    for path in ("/tokenize", "/detokenize"):
        assert _error(client.post(path, content=b"{nope"), 400, None)["code"] == "invalid_json"
        big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
        assert _error(client.post(path, content=big), 413, None)["code"] == "too_large"
    # a lone surrogate, which JSON allows and no tokenizer encodes
    _error(client.post("/tokenize", content=b'{"prompt": "a\\ud800"}'), 400, "prompt")


def test_with_keys_the_routes_need_one_and_health_stays_open(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-1\n")
    with service(api_key_file=str(keys)) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in (
            ("GET", "/version", None),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ):
            assert _error(c.request(method, path, json=body), 401, None)["code"] == "invalid_api_key"
            assert c.request(method, path, json=body, headers=KEY).status_code == 200, path


def test_a_draining_verifier_refuses_them_as_the_openai_routes() -> None:
    with service() as c:
        c.app.state.verifier.draining = True  # type: ignore[attr-defined]
        r = c.post("/tokenize", json={"prompt": "hi"})
        err = _error(r, 503, None)
        c.app.state.verifier.draining = False  # type: ignore[attr-defined]
    assert err["code"] == "draining" and err["type"] == "server_error" and "draining" in err["message"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "5"
