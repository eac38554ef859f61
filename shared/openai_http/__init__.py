"""The OpenAI-compatible HTTP layer both endpoints stand on: the verifier's API
(cloud_verifier.openai_api) and the edge's local one (edge_client.serve). Each supplies a
CompletionSource (the model it serves, its generations); this package has the routes, the
server-sent events, the error bodies, the body limits, the Host/Origin/Content-Type guards and the
streams that end their generation however they end.

- routes: `install`, CompletionSource, Generation, Piece, ClosingStream, the SSE framing
- body: reading a JSON body within its limits, the client's departure, errors as responses
- guard: HttpConfig, and Guard, the middleware for an endpoint that spends its user's key
"""

from shared.openai_http.body import (
    check_model,
    client_gone,
    internal,
    read_json,
    respond,
    until_gone,
    valid_text,
    watch_disconnect,
)
from shared.openai_http.guard import Guard, HttpConfig, origin_key
from shared.openai_http.routes import (
    ClosingStream,
    CompletionSource,
    Generation,
    Piece,
    install,
    sse_data,
    sse_error,
)

__all__ = [
    "ClosingStream",
    "CompletionSource",
    "Generation",
    "Guard",
    "HttpConfig",
    "Piece",
    "check_model",
    "client_gone",
    "install",
    "internal",
    "origin_key",
    "read_json",
    "respond",
    "sse_data",
    "sse_error",
    "until_gone",
    "valid_text",
    "watch_disconnect",
]
