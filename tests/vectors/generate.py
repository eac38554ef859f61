"""Write the protocol's test vectors (tests/vectors/*.json) from the Python implementation.

    python -m tests.vectors.generate

frames.json: single frames as hex, each with its decoded meaning (valid) or the error a conforming
decoder raises (code, field, fatal). sessions.json: short sessions against a server: the frames a
client sends, the server application's own frames (welcome, verdicts), and the frames the server
protocol must answer with, in order. PROTOCOL.md explains both formats. The default suite checks the
Python implementation against the committed files (tests/shared/test_vectors.py); regenerate only
when the protocol changes on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

# the frames, the sessions and the vectors' shared settings, re-exported here
from tests.vectors.frame_vectors import frames as frames
from tests.vectors.session_vectors import sessions as sessions
from tests.vectors.vector_wire import ARRAY_FIELDS as ARRAY_FIELDS
from tests.vectors.vector_wire import FP as FP
from tests.vectors.vector_wire import LIMITS as LIMITS
from tests.vectors.vector_wire import LIMITS_WIRE as LIMITS_WIRE
from tests.vectors.vector_wire import VOCAB as VOCAB
from tests.vectors.vector_wire import invalid as invalid
from tests.vectors.vector_wire import meaning as meaning
from tests.vectors.vector_wire import valid as valid

HERE = Path(__file__).resolve().parent


def main() -> None:
    for name, doc in (("frames", frames()), ("sessions", sessions())):
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path} ({len(doc)} vectors)")


if __name__ == "__main__":
    main()
