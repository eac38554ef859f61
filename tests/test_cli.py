from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_verifier.cli import build_parser as cloud_parser
from edge_client.cli import build_parser as edge_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.parametrize("parser", [cloud_parser(), edge_parser()], ids=["cloud-verifier", "edge-client"])
def test_every_flag_is_explained(parser: argparse.ArgumentParser) -> None:
    subs = _subparsers(parser)
    assert subs
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 10, (
                f"{name} {action.option_strings or action.dest} lacks help"
            )


@pytest.mark.parametrize("module", ["cloud_verifier", "edge_client"])
def test_python_m_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True)
    assert "usage:" in out.stdout


def _edge_rc(argv: list[str]) -> int:
    """edge-client's exit status for argv (argparse's usage errors exit with 2 while parsing)."""
    from edge_client.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prespec", "--prespec-min-gain", "-0.5"], "out of range"),
        (["--prespec", "--prespec-min-gain", "nan"], "not a finite number"),
        (["--prespec-min-gain", "0.1"], "add --prespec"),
    ],
)
def test_edge_refuses_a_bad_prespec_min_gain_before_connecting(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # port 9 on localhost has no verifier: a refusal that came after connecting would fail differently
    rc = _edge_rc(["generate", "--server", "ws://127.0.0.1:9/v1/session", "--draft", "tiny", *flags, "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--prespec-min-gain" in err and message in err


def test_edge_refuses_parallel_drafters_with_one_draft(capsys: pytest.CaptureFixture[str]) -> None:
    from edge_client.cli import main

    rc = main(
        [
            "generate",
            "--server",
            "ws://127.0.0.1:9/v1/session",
            "--draft",
            "tiny",
            "--parallel-drafters",
            "hi",
        ]
    )
    assert rc == 2 and "--parallel-drafters needs two or more --draft" in capsys.readouterr().err


def test_edge_draft_lora_runs_on_llama_cpp_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from edge_client.cli import main

    base = ["generate", "--server", "ws://127.0.0.1:9/v1/session", "--draft", "tiny"]
    rc = main([*base, "--drafter", "torch", "--draft-lora", str(tmp_path / "a.gguf"), "hi"])
    assert rc == 2 and "--draft-lora runs on the llama.cpp drafter, not torch" in capsys.readouterr().err
    rc = main([*base, "--draft-lora", str(tmp_path / "a.gguf"), "hi"])  # auto: llama.cpp, which needs a GGUF
    assert rc == 2 and "cannot load the draft model 'tiny'" in capsys.readouterr().err


def test_edge_tree_defaults_follow_the_draft() -> None:
    from edge_client.cli import _tree_spec
    from shared.model_store.catalog import DEFAULT_DRAFT

    parser = edge_parser()
    pair = parser.parse_args(["generate", "hi"])
    assert pair.draft is None and DEFAULT_DRAFT == "qwen2.5-coder-0.5b-q4"  # applied when generating
    assert _tree_spec(pair, DEFAULT_DRAFT).expansion.ks == (2, 1, 1, 1, 1, 1, 1, 1)
    smol = parser.parse_args(["generate", "--draft", "smollm2-135m-q4", "--sequence", "hi"])
    assert smol.draft == ["smollm2-135m-q4"]
    spec = _tree_spec(smol, smol.draft[0])
    assert spec.kind == "sequence" and spec.expansion.ks == (1, 1, 3, 1, 1)
    given = parser.parse_args(["generate", "--tree", "1,2", "hi"])
    assert _tree_spec(given, DEFAULT_DRAFT).expansion.ks == (1, 2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prespec", "--prespec-cache", "--prespec-outcomes", "0"], "argument --prespec-outcomes"),
        (["--prespec-cache"], "add --prespec"),
        (["--prespec-backup", "chain"], "add --prespec"),
    ],
)
def test_edge_refuses_bad_outcome_cache_or_miss_path_flags_before_connecting(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = _edge_rc(["generate", "--server", "ws://127.0.0.1:9/v1/session", "--draft", "tiny", *flags, "hi"])
    assert rc == 2 and message in capsys.readouterr().err


def test_edge_help_explains_the_miss_path_and_the_outcome_cache(capsys: pytest.CaptureFixture[str]) -> None:
    from edge_client.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--prespec-backup" in out and "--prespec-cache" in out and "--prespec-outcomes" in out
