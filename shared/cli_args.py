"""Argument types for every command line: numbers checked at parse time, so that a flag out of
range is a usage error naming the flag (argparse adds the flag's name and exits 2) instead of a
server that starts and then serves nobody.

Each factory returns a callable for `add_argument(type=...)`. Bounds are inclusive unless said
otherwise; floats must be finite (NaN and the infinities are refused) unless `allow_inf`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["fraction", "integer", "nonempty", "number", "positive_int", "seconds"]


def _parse_int(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _parse_float(text: str, allow_inf: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return x


def _show(x: float) -> str:
    """A bound as a person writes it: an integer whole (2147483647), a float short (0, 0.5,
    1e+15, not 1000000000000000.0)."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        if lo_open:
            return f"> {_show(lo)} and <= {_show(hi)}"
        return f"between {_show(lo)} and {_show(hi)}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_show(lo)}"
    assert hi is not None
    return f"<= {_show(hi)}"


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An int in [lo, hi] (either bound may be None)."""

    def parse(text: str) -> int:
        n = _parse_int(text)
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n} is out of range: expected {_range_text(lo, hi)}")
        return n

    parse.__name__ = "integer"  # argparse names the type in "invalid integer value"
    return parse


def positive_int(hi: int | None = None) -> Callable[[str], int]:
    """An int >= 1 (and <= hi when given)."""
    return integer(1, hi)


def number(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    allow_inf: bool = False,
) -> Callable[[str], float]:
    """A finite float in [lo, hi] ((lo, hi] with `lo_open`); `allow_inf` admits +inf and -inf."""

    def parse(text: str) -> float:
        x = _parse_float(text, allow_inf)
        low = lo is not None and (x <= lo if lo_open else x < lo)
        if low or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: expected {_range_text(lo, hi, lo_open)}"
            )
        return x

    parse.__name__ = "number"
    return parse


def seconds(hi: float = 365 * 24 * 3600.0, *, zero: bool = False) -> Callable[[str], float]:
    """A finite duration in seconds: > 0 (>= 0 with `zero`), at most `hi` (a year by default)."""
    return number(0.0, hi, lo_open=not zero)


def fraction(*, zero: bool = True) -> Callable[[str], float]:
    """A finite fraction in [0, 1] ((0, 1] without `zero`)."""
    return number(0.0, 1.0, lo_open=not zero)


def nonempty(what: str) -> Callable[[str], str]:
    """A string that is not empty or blank; `what` names it in the error."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text

    parse.__name__ = "string"
    return parse
