"""Logging of the service: plain text or one JSON object per line (`--log-format json`).

Session events carry the session id as a field of their own (`extra={"session": id}`), so a log
pipeline can follow one client's sessions: welcomed, generation started and ended, errors, closed.
"""

from __future__ import annotations

import json
import logging
import time

FIELDS = ("session", "principal", "mode", "prompt_tokens", "tokens", "reason", "code", "round")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for f in FIELDS:
            if hasattr(record, f):
                doc[f] = getattr(record, f)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = " ".join(f"{f}={getattr(record, f)}" for f in FIELDS if hasattr(record, f))
        return f"{text} [{extra}]" if extra else text


def setup(level: str, fmt: str) -> None:
    """Root logging for `cloud-verifier serve`: `fmt` is "text" or "json" (uvicorn's loggers too)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
