"""`draft-training`'s command line: the flags are the options dataclasses' fields (parsed defaults
are the fields' defaults, every flag reads back into its field), every number is checked when it is
parsed (finite, in range), an output a flag names that cannot be written is one line naming the
flag, before any work; the exit statuses (2 usage, 1 a known error while working, 130 interrupted)
and never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from draft_training import cli
from draft_training.cli import build_parser, main
from draft_training.cli_options import (
    COMMANDS,
    BoostOptions,
    CollectOptions,
    DistillOptions,
    DraftsOptions,
    ExportOptions,
    Options,
    SplitOptions,
    options_from_args,
)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_no_flag_reads_a_bare_number() -> None:
    """int and float took -1, nan and 1e308 alike (float also 'inf')."""
    for name, parser in _subcommands().items():
        for action in parser._actions:
            assert action.type not in (int, float), (name, action.option_strings)


# each command's required flags, and the options they give
NEEDED: dict[str, tuple[list[str], dict[str, object]]] = {
    "split": ([], {}),
    "collect": (["--out", "o"], {"out": Path("o")}),
    "distill": (["--records", "r", "--out", "o"], {"records": Path("r"), "out": Path("o")}),
    "export": (["--run", "r"], {"run": Path("r")}),
    "boost": (
        ["--records", "r", "--heldout", "h", "--ssm1", "s", "--out", "o"],
        {"records": Path("r"), "heldout": Path("h"), "ssm1": Path("s"), "out": Path("o")},
    ),
    "drafts": ([], {}),
}


def test_every_subcommand_has_its_options() -> None:
    assert list(_subcommands()) == [cls.COMMAND for cls in COMMANDS] == list(NEEDED)


@pytest.mark.parametrize("cls", COMMANDS, ids=[c.COMMAND for c in COMMANDS])
def test_the_parsed_defaults_are_the_options_defaults(cls: type[Options]) -> None:
    argv, needed = NEEDED[cls.COMMAND]
    assert options_from_args(build_parser().parse_args([cls.COMMAND, *argv])) == cls(**needed)  # type: ignore[arg-type]


def _options(cls: type[Options], **changed: object) -> Options:
    return dataclasses.replace(cls(**NEEDED[cls.COMMAND][1]), **changed)  # type: ignore[arg-type]


# every flag but the required ones (the defaults test reads those) given a value other than its default
ROUND_TRIP: list[tuple[list[str], Options]] = [
    (
        ["split", "--check", "--prompts-out", "p.jsonl", "--side", "train", "--per-category", "3"],
        _options(SplitOptions, check=True, prompts_out=Path("p.jsonl"), side="train", per_category=3),
    ),
    (
        ["collect", "--out", "o", "--model", "tiny", "--tokens", "9", "--temperatures", "0.5,2",
         "--batch", "2", "--top-k", "8", "--seed", "7", "--limit", "5", "--split", "s.json",
         "--side", "heldout", "--from-traces", "t", "--no-progress"],
        _options(
            CollectOptions, model="tiny", tokens=9, temperatures=(0.5, 2.0), batch=2, top_k=8, seed=7,
            limit=5, split=Path("s.json"), side="heldout", from_traces=Path("t"), progress=False,
        ),
    ),
    (
        ["distill", "--records", "r", "--out", "o", "--heldout", "h", "--draft", "tiny", "--steps", "3",
         "--batch", "2", "--lr", "0.01", "--loss", "tvd", "--ce-weight", "0.5", "--blocks", "4,5",
         "--lora-rank", "8", "--lora-alpha", "4", "--lora-targets", "qkv", "--eval-every", "2",
         "--checkpoint-every", "3", "--max-positions", "16", "--seed", "1", "--validation", "0.2",
         "--keep", "best", "--autocast", "bf16", "--no-progress"],
        _options(
            DistillOptions, heldout=Path("h"), draft="tiny", steps=3, batch=2, lr=0.01, loss="tvd",
            ce_weight=0.5, blocks="4,5", lora_rank=8, lora_alpha=4.0, lora_targets="qkv", eval_every=2,
            checkpoint_every=3, max_positions=16, seed=1, validation=0.2, keep="best", autocast="bf16",
            progress=False,
        ),
    ),
    (
        ["export", "--run", "r", "--draft", "tiny", "--gguf-type", "q8_0", "--out", "d.gguf", "--name",
         "mine", "--lora"],
        _options(ExportOptions, draft="tiny", gguf_type="q8_0", out=Path("d.gguf"), name="mine", lora=True),
    ),
    (
        ["boost", "--records", "r", "--heldout", "h", "--ssm1", "s", "--out", "o", "--draft", "tiny",
         "--m", "4", "--criterion", "window:8", "--no-control", "--min-gain", "0.5", "--steps", "3",
         "--batch", "2", "--autocast", "bf16", "--lr", "0.01", "--max-positions", "16", "--seed", "2",
         "--no-progress"],
        _options(
            BoostOptions, draft="tiny", m=4, criterion="window:8", control=False, min_gain=0.5, steps=3,
            batch=2, autocast="bf16", lr=0.01, max_positions=16, seed=2, progress=False,
        ),
    ),
    (
        ["drafts", "a", "b", "--rebuild", "--qwen", "--no-progress"],
        _options(DraftsOptions, aliases=("a", "b"), rebuild=True, qwen=True, progress=False),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), ROUND_TRIP, ids=[argv[0] for argv, _ in ROUND_TRIP])
def test_every_flag_reads_back_into_its_field(argv: list[str], expected: Options) -> None:
    opts = options_from_args(build_parser().parse_args(argv))
    assert opts == expected
    # the table gives every field a value other than its default (the required ones aside)
    default = _options(type(expected))
    assert all(getattr(opts, f.name) != getattr(default, f.name) for f in dataclasses.fields(opts)
               if f.name not in NEEDED[argv[0]][1]), argv  # fmt: skip


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
