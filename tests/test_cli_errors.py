"""Every console script (`edge-client`, `cloud-verifier`, `draft-training`, run here as `python -m`)
answers bad input with one line and a conventional exit status, never a traceback: 2 for a usage
error (a missing or malformed file, a number out of range), 1 for a failure, 130 for Ctrl-C (SIGINT
during a long step). The line is what is left of stderr once argparse's usage block, progress output
and log records are set aside."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ")
PROGRESS = re.compile(r"^(export-onnx: |[^:]*: +\d+%\|)")  # export-onnx's stage lines, tqdm's bars
TIMEOUT_S = 300  # only a hung process reaches it


def _run(module: str, args: list[str], cwd: Path) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return r.returncode, r.stderr


def _error_lines(err: str) -> list[str]:
    """stderr without argparse's usage block, progress output and log records."""
    err = re.sub(r"(\d+%\|[^\r\n]*?\])", "\\1\n", err)  # a line written right after a tqdm bar
    lines = [line for line in re.split(r"[\r\n]+", err) if line.strip()]
    if lines and lines[0].startswith("usage:"):
        lines = lines[next(i for i, line in enumerate(lines) if ": error: " in line) :]
    return [line for line in lines if not LOG_RECORD.match(line) and not PROGRESS.match(line)]


def _check(err: str, rc: int, want_rc: int, prog: str, needle: str) -> None:
    assert "Traceback" not in err, err
    lines = _error_lines(err)
    assert rc == want_rc and len(lines) == 1, (rc, err)
    assert lines[0].startswith(prog) and needle in lines[0], err


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Paths the cases name: a missing file, a text file named .gguf, an export whose manifest
    lists no files, a browser bundle and a folder holding a user's file."""
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model\n")
    bundle = tmp_path / "web"
    for name in ("index.html", "edge-page.js", "treespec-edge.js", "ort/ort-wasm-simd-threaded.wasm"):
        (bundle / name).parent.mkdir(parents=True, exist_ok=True)
        (bundle / name).write_text("x")
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text(json.dumps({"format": 1, "files": []}))
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "thesis.txt").write_text("mine")
    return {
        "MISSING": str(tmp_path / "missing.gguf"),
        "NOT_GGUF": str(not_gguf),
        "BUNDLE": str(bundle),
        "EXPORT": str(export),
        "USER": str(tmp_path / "user"),
        "NEW": str(tmp_path / "new"),
    }


# (module, arguments, exit status, a piece of the line); NAMES in the arguments are `files`'s paths
EDGE = [
    ("edge_client", ["generate", "--draft", "MISSING", "--drafter", "llama_cpp", "hi"], 2, "MISSING"),
    ("edge_client", ["serve", "--draft", "MISSING", "--drafter", "llama_cpp"], 2, "MISSING"),
    ("edge_client", ["serve", "--draft", "NOT_GGUF", "--drafter", "llama_cpp"], 2, "NOT_GGUF"),
    ("edge_client", ["serve", "--web-draft", "EXPORT", "--web-bundle", "BUNDLE"], 2, "'files'"),
    ("edge_client", ["serve", "--web-draft", "MISSING", "--web-bundle", "BUNDLE"], 2, "not an ONNX export"),
    ("edge_client", ["generate", "--temperature", "nan", "hi"], 2, "--temperature"),
    ("edge_client", ["serve", "--port", "70000"], 2, "--port"),
    ("edge_client", ["export-onnx", "--draft", "MISSING", "--out", "NEW"], 1, "MISSING"),
    ("edge_client", ["export-onnx", "--draft", "tiny", "--out", "USER"], 2, "not an ONNX export"),
    ("edge_client", ["export-onnx", "--draft", "tiny", "--out", "."], 2, "working folder"),
    ("edge_client", ["generate", "--record", "NOT_GGUF", "--draft", "tiny", "hi"], 2, "--record"),
]
CLOUD = [
    ("cloud_verifier", ["serve", "--model", "MISSING", "--port", "0"], 1, "MISSING"),
    ("cloud_verifier", ["serve", "--model", "NOT_GGUF", "--port", "0"], 1, "NOT_GGUF"),
    ("cloud_verifier", ["serve", "--port", "nan"], 2, "--port"),
    ("cloud_verifier", ["serve", "--max-nodes", "99999999999"], 2, "--max-nodes"),
]
TRAINING = [
    ("draft_training", ["distill", "--records", "MISSING", "--out", "NEW", "--draft", "tiny"], 2, "MISSING"),
    ("draft_training", ["export", "--run", "MISSING"], 2, "MISSING"),
    ("draft_training", ["collect", "--out", "NEW", "--tokens", "nan"], 2, "--tokens"),
    ("draft_training", ["collect", "--out", "NEW", "--model", "NOT_GGUF", "--limit", "1"], 2, "NOT_GGUF"),
]
PROG = {"edge_client": "edge-client", "cloud_verifier": "cloud-verifier", "draft_training": "draft-training"}


@pytest.mark.parametrize(
    ("module", "args", "want_rc", "needle"),
    EDGE + CLOUD + TRAINING,
    ids=[f"{m}:{' '.join(a)}" for m, a, _, _ in EDGE + CLOUD + TRAINING],
)
def test_bad_input_is_one_line_and_an_exit_status(
    module: str, args: list[str], want_rc: int, needle: str, files: dict[str, str], tmp_path: Path
) -> None:
    argv = [files.get(a, a) for a in args]
    rc, err = _run(module, argv, tmp_path)
    _check(err, rc, want_rc, PROG[module], files.get(needle, needle))
    assert (tmp_path / "user" / "thesis.txt").read_text() == "mine"


def _interrupt(argv: list[str], cwd: Path, started: str) -> tuple[int, str]:
    """Run argv, send SIGINT once stderr shows `started`; the exit status and the whole stderr."""
    p = subprocess.Popen(argv, cwd=cwd, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    seen = []
    try:
        for line in p.stderr:  # text mode: tqdm's \r ends a line too
            seen.append(line)
            if started in line:
                p.send_signal(signal.SIGINT)
                break
        seen.append(p.stderr.read())
        return p.wait(TIMEOUT_S), "".join(seen)
    finally:
        p.kill()
        p.wait()


def test_ctrl_c_during_an_export_is_130_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "exports" / "tiny"
    argv = [sys.executable, "-m", "edge_client", "export-onnx", "--draft", "tiny", "--out", str(out)]
    rc, err = _interrupt(argv, tmp_path, "export-onnx: loading")
    _check(err, rc, 130, "edge-client", "interrupted")
    exports = tmp_path / "exports"
    assert not exports.exists() or list(exports.iterdir()) == []  # neither the folder nor a scratch copy


def test_ctrl_c_while_waiting_for_the_verifier_is_130_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts the connection, never answers the handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(TIMEOUT_S)
        url = f"ws://127.0.0.1:{silent.getsockname()[1]}/v1/session"
        argv = [sys.executable, "-m", "edge_client", "generate", "--server", url, "--draft", "tiny"]
        p = subprocess.Popen(
            [*argv, "--drafter", "torch", "hi"], cwd=tmp_path, stderr=subprocess.PIPE, text=True
        )
        try:
            conn, _ = silent.accept()
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=TIMEOUT_S)
            conn.close()
        finally:
            p.kill()
            p.wait()
    assert p.returncode == 130 and err.strip() == "edge-client: interrupted", (p.returncode, err)


def test_ctrl_c_while_collecting_is_130_in_one_line(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "draft_training",
        "collect",
        "--model",
        "tiny",
        "--out",
        str(tmp_path / "c"),
    ]
    rc, err = _interrupt([*argv, "--limit", "2"], tmp_path, "collect:")
    _check(err, rc, 130, "draft-training", "interrupted")


def test_ctrl_c_while_the_verifier_serves_stops_it_cleanly(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "cloud_verifier", "serve", "--model", "tiny", "--port", "0"]
    rc, err = _interrupt(argv, tmp_path, "Uvicorn running")
    assert rc in (0, 130) and "Traceback" not in err, (rc, err)
