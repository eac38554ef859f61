"""An ASGI app (the edge's local endpoint) on uvicorn in a thread, on a free loopback port."""

from bench.harness import served

__all__ = ["served"]
