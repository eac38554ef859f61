"""Flags generated from a config dataclass (shared.config_cli): names, defaults, switches, parsers,
choices, repeatable flags, and the values read back by field name."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from shared.cli_args import integer
from shared.config_cli import add_config_flags, cli, config_values, flag_fields


@dataclass(frozen=True)
class _Example:
    port: int = field(default=8000, metadata=cli("TCP port"))
    wait_s: float = field(default=1.5, metadata=cli("seconds to wait", flag="--wait", aliases=("-w",)))
    mode: str = field(default="a", metadata=cli("the mode", choices=("a", "b")))
    batching: bool = field(default=True, metadata=cli("one at a time", flag="--no-batching"))
    verbose: bool = field(default=False, metadata=cli("say more"))
    origins: tuple[str, ...] = field(default=(), metadata=cli("an origin", append=True, metavar="O"))
    hidden: int = 3  # no cli metadata: no flag


def _rule(name: str) -> Callable[[str], object]:
    rules: dict[str, Callable[[str], object]] = {"port": integer(1, 65535), "wait_s": float}
    return rules.get(name, str)


def _parser(defaults: _Example | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(p, _Example, defaults=defaults, parse=_rule)
    return p


def test_flags_take_the_field_names_defaults_and_help() -> None:
    p = _parser()
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    assert set(flags) == {"port", "wait_s", "mode", "batching", "verbose", "origins"}
    assert flags["port"].option_strings == ["--port"] and flags["port"].help == "TCP port"
    assert flags["wait_s"].option_strings == ["--wait", "-w"]
    assert flags["origins"].metavar == "O"
    assert vars(p.parse_args([])) == {
        "port": 8000, "wait_s": 1.5, "mode": "a", "batching": True, "verbose": False, "origins": []
    }  # fmt: skip


def test_values_are_parsed_by_the_field_rules() -> None:
    args = _parser().parse_args(
        [
            "--port",
            "9",
            "-w",
            "2",
            "--mode",
            "b",
            "--no-batching",
            "--verbose",
            "--origins",
            "x",
            "--origins",
            "y",
        ]
    )
    assert config_values(_Example, args) == {
        "port": 9, "wait_s": 2.0, "mode": "b", "batching": False, "verbose": True, "origins": ["x", "y"]
    }  # fmt: skip
    with pytest.raises(argparse.ArgumentError):
        _parser().parse_args(["--port", "0"])
    with pytest.raises(argparse.ArgumentError):
        _parser().parse_args(["--mode", "c"])


def test_defaults_come_from_an_instance_when_given() -> None:
    args = _parser(_Example(port=1, verbose=True)).parse_args([])
    assert args.port == 1 and args.verbose is True


def test_only_fields_with_cli_metadata_are_flags() -> None:
    assert [f.name for f, _ in flag_fields(_Example)] == [
        "port",
        "wait_s",
        "mode",
        "batching",
        "verbose",
        "origins",
    ]


@dataclass(frozen=True, kw_only=True)
class _Needs:
    out: str = field(metadata=cli("where to write"))
    count: int = field(default=1, metadata=cli("how many", type=integer(0)))
    path: str = field(metadata=cli("what to read", metavar="FILE"))


def test_a_field_without_a_default_is_a_required_flag(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(p, _Needs)
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    assert [flags[n].required for n in ("out", "count", "path")] == [True, False, True]
    args = p.parse_args(["--path", "in", "--out", "o"])
    assert _Needs(**config_values(_Needs, args)) == _Needs(out="o", path="in")
    with pytest.raises(SystemExit):  # argparse reports a missing flag itself, exit_on_error or not
        p.parse_args(["--path", "in"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
