"""Every flag of `edge-client` is checked as it is parsed: a number out of its (finite) range, NaN, an
infinity or a name left empty is a usage error (exit status 2) naming the flag, before a model is
loaded or a verifier reached; a tree over the protocol's node limit is refused the same way, and so
is a --record folder that cannot be written."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edge_client.cli import main
from edge_client.cli_parser import build_parser
from edge_client.speculation.config import MAX_TREE_NODES, TreeSpec
from shared.tree import ExpansionConfig
from tests.fs_faults import FullDiskOS

NOWHERE = "ws://127.0.0.1:9/v1/session"  # no verifier: a refusal after connecting would read differently
POSITIONAL = {"generate": ["hi"], "serve": [], "export-onnx": ["--draft", "tiny", "--out", "x"]}
NOT_NUMBERS = [
    "nan",
    "inf",
    "-inf",
    "1e400",
    "-1e30",
    "1e30",
    "99999999999999999999999",
    "-99999999999999999999",
]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _valued_flags() -> list[tuple[str, argparse.Action]]:
    """(subcommand, action) of every flag that takes a value of its own (not a choice, not a switch)."""
    return [
        (cmd, a)
        for cmd, p in _subcommands().items()
        for a in p._actions
        if a.option_strings and a.nargs != 0 and a.choices is None and not isinstance(a, argparse._HelpAction)
    ]


def _numeric_flags() -> list[tuple[str, str]]:
    return [
        (cmd, a.option_strings[0])
        for cmd, a in _valued_flags()
        if getattr(a.type, "__name__", "") in ("integer", "number")
    ]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    return capsys.readouterr().err


def test_every_flag_that_takes_a_value_is_checked_as_it_is_parsed() -> None:
    """No flag takes a bare int, float, str or Path: numbers have bounds, names may not be empty
    (--api-key excepted: its default comes from the environment, where empty means none)."""
    loose = [
        f"{cmd} {a.option_strings[-1]}"
        for cmd, a in _valued_flags()
        if a.type in (None, int, float, str, Path) and a.dest != "api_key"
    ]
    assert loose == []
    assert len(_numeric_flags()) >= 14  # generate's 11, serve's port, threads and saguaro-c


@pytest.mark.parametrize(("command", "flag"), _numeric_flags())
def test_every_numeric_flag_refuses_nan_infinities_and_huge_values(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for value in NOT_NUMBERS:
        err = _usage_error([command, *POSITIONAL[command], f"{flag}={value}"], capsys)
        assert f"argument {flag}" in err and "error:" in err, (value, err)


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("generate", "--draft"),
        ("generate", "--server"),
        ("generate", "--fallback"),
        ("generate", "--record"),
        ("generate", "--draft-lora"),
        ("generate", "--ca-file"),
        ("generate", "--tree"),
        ("serve", "--draft"),
        ("serve", "--web-draft"),
        ("serve", "--web-bundle"),
        ("serve", "--host"),
        ("export-onnx", "--draft"),
        ("export-onnx", "--out"),
    ],
)
def test_an_empty_model_file_or_folder_name_is_a_usage_error_naming_the_flag(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for empty in ("", "  "):
        err = _usage_error([command, *POSITIONAL[command], f"{flag}={empty}"], capsys)
        assert f"argument {flag}: the value must not be empty" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--budget", "4096", "hi"],
        ["generate", "--temperature", "10000", "--top-p", "1e-9", "--top-k", "2147483647", "hi"],
        ["generate", "--seed", str(2**63 - 1), "--max-new-tokens", "1", "--resume-attempts", "0", "hi"],
        ["serve", "--port", "65535", "--threads", "0", "--saguaro-c", "1"],
    ],
)
def test_values_at_the_bounds_parse(argv: list[str]) -> None:
    build_parser().parse_args(argv)


def test_budget_is_capped_at_the_protocols_tree_node_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["generate", "--budget", str(MAX_TREE_NODES), "hi"]).budget == 4096
    err = _usage_error(["generate", "--budget", str(MAX_TREE_NODES + 1), "hi"], capsys)
    assert "argument --budget" in err and "4096" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--draft", "tiny", "--tree", "100,100"], "--tree 100,100: an expansion tree of"),
        (["--draft", "tiny", "--draft", "tiny@budget=5000"], "budget of 5000"),
        (["--draft", "tiny", "--draft", "tiny@sequence=-1"], "depth of -1"),
        (["--draft", "tiny", "--draft", "tiny@64,64,64"], "an expansion tree of"),
    ],
)
def test_a_tree_over_the_node_limit_is_refused_before_connecting(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["generate", "--server", NOWHERE, "--drafter", "torch", *argv, "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "4096" in err and "verifier" not in err, err


def test_a_tree_spec_holds_at_most_the_protocols_nodes() -> None:
    TreeSpec("static", ExpansionConfig((64, 63)))  # 64 + 4032 = 4096 nodes
    for bad in (
        {"expansion": ExpansionConfig((64, 64))},
        {"expansion": ExpansionConfig((10**30, 10**30))},
        {"kind": "budget", "budget": MAX_TREE_NODES + 1},
        {"kind": "sequence", "depth": -1},
    ):
        with pytest.raises(ValueError, match="at most 4096"):
            TreeSpec(**bad)


def test_serve_names_a_draft_it_cannot_load_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_gguf = tmp_path / "draft.gguf"
    not_gguf.write_text("not a model")
    for draft in (str(tmp_path / "missing.gguf"), str(not_gguf)):
        rc = main(["serve", "--draft", draft, "--drafter", "llama_cpp", "--server", NOWHERE])
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert rc == 2 and len(lines) == 1, err
        assert lines[0].startswith("edge-client: error: cannot load the draft model") and draft in lines[0]


def test_a_record_folder_that_cannot_be_written_is_named_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    for record in (taken, taken / "sub"):
        argv = ["generate", "--server", NOWHERE, "--draft", "tiny", "--drafter", "torch", "hi"]
        rc = main([*argv, "--record", str(record)])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("edge-client: --record: cannot write session records into"), err
        assert "verifier" not in err and taken.read_text() == "mine"


def test_a_record_that_fails_after_the_generation_blames_the_record_not_the_verifier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_client import record
    from tests.cloud_verifier.service import LiveServer

    monkeypatch.setattr(record, "os", FullDiskOS())
    with LiveServer() as srv:
        argv = ["generate", "--server", srv.ws, "--draft", "tiny", "--drafter", "torch", "--max-tokens", "4"]
        rc = main([*argv, "--record", str(tmp_path / "records"), "hi"])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("edge-client: error: --record: cannot write session records into"), err
    assert "No space left" in lines[0] and "verifier" not in lines[0]
    assert list((tmp_path / "records").iterdir()) == []  # no half-written record left behind
