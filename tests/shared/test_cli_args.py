"""The parse-time argument types refuse what a server could not serve with, naming the flag."""

from __future__ import annotations

import argparse

import pytest

from shared.cli_args import fraction, integer, nonempty, number, positive_int, seconds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x", exit_on_error=False)
    p.add_argument("--n", type=positive_int(100))
    p.add_argument("--k", type=integer(0))
    p.add_argument("--t", type=seconds())
    p.add_argument("--z", type=seconds(zero=True))
    p.add_argument("--f", type=fraction())
    p.add_argument("--x", type=number(0.0, lo_open=True))
    p.add_argument("--m", type=nonempty("--m"))
    return p


@pytest.mark.parametrize(
    "argv",
    [
        ["--n", "0"],
        ["--n", "-1"],
        ["--n", "101"],
        ["--n", "1.5"],
        ["--k", "-3"],
        ["--t", "nan"],
        ["--t", "inf"],
        ["--t", "0"],
        ["--t", "-1"],
        ["--t", "1e308"],
        ["--z", "-0.5"],
        ["--f", "1.5"],
        ["--f", "nan"],
        ["--x", "0"],
        ["--x", "-inf"],
        ["--m", ""],
        ["--m", "  "],
    ],
)
def test_out_of_range_values_are_usage_errors_naming_the_flag(argv: list[str]) -> None:
    with pytest.raises(argparse.ArgumentError) as err:
        _parser().parse_args(argv)
    assert argv[0] in str(err.value)


def test_values_in_range_parse() -> None:
    a = _parser().parse_args(
        ["--n", "100", "--k", "0", "--t", "2.5", "--z", "0", "--f", "1", "--x", "1e-9", "--m", "a"]
    )
    assert (a.n, a.k, a.t, a.z, a.f, a.x, a.m) == (100, 0, 2.5, 0.0, 1.0, 1e-9, "a")


def test_a_range_error_writes_its_bounds_as_a_person_would() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        number(0.0, 1e15)("1e16")
    assert str(err.value) == "1e16 is out of range: expected between 0 and 1e+15"
    with pytest.raises(argparse.ArgumentTypeError) as err:
        integer(0, 2147483647)("-1")
    assert str(err.value) == "-1 is out of range: expected between 0 and 2147483647"
