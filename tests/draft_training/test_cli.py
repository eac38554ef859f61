"""`draft-training`'s command line: every number is checked when it is parsed (finite, in range),
an output a flag names that cannot be written is one line naming the flag, before any work; the
exit statuses (2 usage, 1 a known error while working, 130 interrupted) and never a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from draft_training import cli
from draft_training.cli import build_parser, main


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_no_flag_reads_a_bare_number() -> None:
    """int and float took -1, nan and 1e308 alike (float also 'inf')."""
    for name, parser in _subcommands().items():
        for action in parser._actions:
            assert action.type not in (int, float), (name, action.option_strings)


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "records").mkdir()
    return {"out": str(tmp_path / "out"), "rec": str(tmp_path / "records")}


BOOST = ["--records", "{rec}", "--heldout", "{rec}", "--ssm1", "{rec}", "--out", "{out}"]
REFUSED = [
    ("split", ["--prompts-out", "{out}/p.jsonl", "--per-category", "-1"], "--per-category"),
    ("collect", ["--out", "{out}", "--tokens", "0"], "--tokens"),
    ("collect", ["--out", "{out}", "--temperatures", "0,nan"], "--temperatures"),
    ("collect", ["--out", "{out}", "--temperatures", "-1"], "--temperatures"),
    ("collect", ["--out", "{out}", "--batch", "0"], "--batch"),
    ("collect", ["--out", "{out}", "--top-k", "-5"], "--top-k"),
    ("collect", ["--out", "{out}", "--seed", "-1"], "--seed"),
    ("collect", ["--out", "{out}", "--limit", "-1"], "--limit"),
    ("collect", ["--out", "{out}", "--model", ""], "--model"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--steps", "0"], "--steps"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--lr", "nan"], "--lr"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--lr", "inf"], "--lr"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--ce-weight", "nan"], "--ce-weight"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--lora-alpha", "inf"], "--lora-alpha"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--lora-rank", "-1"], "--lora-rank"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--validation", "nan"], "--validation"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--eval-every", "-1"], "--eval-every"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--max-positions", "1e3"], "--max-positions"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--blocks", "4,x"], "--blocks"),
    ("distill", ["--records", "{rec}", "--out", "{out}", "--draft", " "], "--draft"),
    ("export", ["--run", "{rec}", "--draft", ""], "--draft"),
    ("export", ["--run", "{rec}", "--name", ""], "--name"),
    ("boost", [*BOOST, "--m", "1"], "--m"),
    ("boost", [*BOOST, "--min-gain", "nan"], "--min-gain"),
    ("boost", [*BOOST, "--lr", "-1"], "--lr"),
]


@pytest.mark.parametrize(("command", "args", "flag"), REFUSED, ids=[f"{c} {f}" for c, _, f in REFUSED])
def test_a_bad_number_or_name_is_a_usage_error_naming_the_flag(
    command: str, args: list[str], flag: str, dirs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, *(a.format(**dirs) for a in args)]) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and "Traceback" not in err, err
    assert not Path(dirs["out"]).exists()  # refused before anything was made


OUTPUTS = [
    ("split", ["--prompts-out", "{blocked}/p.jsonl"], "--prompts-out"),
    ("split", ["--prompts-out", "{folder}"], "--prompts-out"),
    ("collect", ["--out", "{blocked}/out", "--model", "tiny"], "--out"),
    ("distill", ["--records", "{folder}", "--out", "{blocked}/run", "--draft", "tiny"], "--out"),
    (
        "boost",
        ["--records", "{folder}", "--heldout", "{folder}", "--ssm1", "{folder}", "--out", "{blocked}"],
        "--out",
    ),
    ("export", ["--run", "{folder}", "--draft", "tiny", "--out", "{blocked}/d.gguf"], "--out"),
]


@pytest.mark.parametrize(("command", "args", "flag"), OUTPUTS, ids=[f"{c} {f} {a[1]}" for c, a, f in OUTPUTS])
def test_an_output_that_cannot_be_written_is_one_line_naming_the_flag(
    command: str, args: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any work (a model load, a collection): one line, the flag, the path and why."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    paths = {"blocked": str(blocked), "folder": str(tmp_path)}
    assert main([command, *(a.format(**paths) for a in args)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"draft-training {command}: {flag} "), lines
    assert "cannot be written" in lines[0] or "is a folder" in lines[0], lines


def test_an_os_error_while_working_is_exit_1_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(a: argparse.Namespace) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "_run", full)
    assert main(["collect", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == "draft-training collect: [Errno 28] No space left on device\n"


def test_ctrl_c_is_exit_130_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(a: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert main(["collect", "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "draft-training: interrupted\n"


def test_a_file_that_is_not_a_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("hi")
    out = str(tmp_path / "out")
    assert main(["collect", "--out", out, "--model", str(bad), "--limit", "1", "--no-progress"]) == 2
    assert main(["collect", "--out", out, "--model", str(tmp_path / "none.gguf"), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("draft-training collect: ") for line in lines), lines


def test_help_is_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["collect", "--help"]) == 0
    assert "--temperatures" in capsys.readouterr().out
