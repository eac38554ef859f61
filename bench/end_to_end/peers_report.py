"""bench.end_to_end.peers' measurements and rows: one system and mode over the prompts (`Runs`), and the rows
of its table and JSON (speed-ups against each system's own plain decoding, same outputs)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Runs:
    """One system + mode over the prompts."""

    system: str
    mode: str
    ms_per_token: list[float] = field(default_factory=list)
    tokens: int = 0
    forwards: float = 0.0
    outputs: list[Any] = field(default_factory=list)  # per prompt: token ids, or text for llama.cpp

    def add(self, wall_s: float, new_tokens: int, forwards: float, output: Any) -> None:
        self.ms_per_token.append(wall_s * 1e3 / max(new_tokens, 1))
        self.tokens += new_tokens
        self.forwards += forwards
        self.outputs.append(output)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms_per_token) if self.ms_per_token else 0.0


PLAIN = {"hf-transformers": "generate", "llama.cpp": "plain", "treespec": "ar"}


def _same(outputs: list[Any], plain: list[Any]) -> bool:
    """Outputs equal prompt by prompt. Texts (llama.cpp) count as equal when one is a prefix of
    the other: its speculative tool may overshoot the token count by the last round's drafts."""
    return len(outputs) == len(plain) and _same_count(outputs, plain) == len(plain)


def _same_count(outputs: list[Any], plain: list[Any]) -> int:
    """How many prompts' outputs equal plain decoding's (the prefix rule of `_same`)."""
    n = 0
    for a, b in zip(outputs, plain, strict=False):
        if isinstance(a, str) and isinstance(b, str):
            n += a.startswith(b) or b.startswith(a)
        else:
            n += a == b
    return n


def rows_of(runs: list[Runs], plain_of: dict[str, str]) -> list[dict[str, Any]]:
    by = {(r.system, r.mode): r for r in runs}
    rows = []
    for r in runs:
        own = by.get((r.system, plain_of[r.system]))
        speed = own.median_ms / r.median_ms if own is not None and r.median_ms else None
        identical = None if own is None else _same(r.outputs, own.outputs)
        same_n = None if own is None else _same_count(r.outputs, own.outputs)
        rows.append(
            {
                "system": r.system,
                "mode": r.mode,
                "ms_per_token": round(r.median_ms, 2),
                "speedup_vs_own_ar": None if speed is None else round(speed, 3),
                "tokens_per_target_forward": round(r.tokens / r.forwards, 3) if r.forwards else None,
                "identical": identical,
                "identical_prompts": same_n,  # of len(outputs)
                "tokens": r.tokens,
                "outputs": r.outputs,  # per prompt: token ids (llama.cpp: text)
            }
        )
    return rows
