"""`cloud-verifier serve`'s command line: every number is checked when it is parsed (finite, in
range) by its ServerConfig field's rule, so a value no client could use is a usage error naming the
flag or variable, never a server that starts and then serves nobody; the exit statuses."""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
from dataclasses import fields

import pytest

from cloud_verifier import cli
from cloud_verifier.cli import build_parser, main
from cloud_verifier.server_config import ServerConfig, field_type
from shared.messages import SessionLimits
from tests.cloud_verifier.test_lifecycle import verifier_process


@pytest.fixture(autouse=True)
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value the command line should refuse but takes would start a server: it returns 99."""
    from cloud_verifier import server

    monkeypatch.setattr(server, "serve", lambda config: 99)


def _serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if a.option_strings]


def test_every_flag_that_takes_a_value_is_parsed_by_its_fields_rule() -> None:
    """No flag reads a bare int or float (which took -1, 0, nan and 1e308 alike)."""
    numeric = 0
    for action in _serve_actions():
        assert action.type not in (int, float), action.option_strings
        if action.dest in {f.name for f in fields(ServerConfig)} and action.nargs != 0:
            if action.choices is None and field_type(action.dest) is not str:  # str: free text
                assert action.type is field_type(action.dest), action.option_strings
            numeric += isinstance(getattr(ServerConfig(), action.dest), int | float)
    assert numeric >= 25


def test_every_number_field_has_a_rule_that_refuses_nan() -> None:
    for f in fields(ServerConfig):
        if type(f.default) in (int, float):
            with pytest.raises(argparse.ArgumentTypeError):
                field_type(f.name)("nan")


UNUSABLE = [
    ("--max-pending", "-1"),
    ("--max-context", "0"),
    ("--max-depth", "-3"),
    ("--max-nodes", "0"),
    ("--max-draws", "0"),
    ("--max-row-draws", "0"),
    ("--max-q-ids", "0"),
    ("--max-q-row", "0"),
    ("--max-bytes", "0"),
    ("--max-pending-bytes", "0"),
    ("--max-sessions", "0"),
    ("--max-waiting", "-1"),
    ("--max-handshakes", "0"),
    ("--idle-timeout", "nan"),
    ("--hello-timeout", "nan"),
    ("--header-timeout", "0"),
    ("--queue-wait", "inf"),
    ("--drain-timeout", "-1"),
    ("--frames-per-s", "nan"),
    ("--threads", "-1"),
    ("--tensor-parallel", "0"),
    ("--token-budget", "0"),
    ("--prefill-chunk", "0"),
    ("--kv-blocks", "-1"),
    ("--block-size", "0"),
    ("--offload-threads", "0"),
    ("--resident-gb", "nan"),
    ("--resident-gb", "inf"),
    ("--resident-gb", "1e308"),
    ("--resident-gb", "-1"),
    ("--port", "70000"),
    ("--model", ""),
    ("--model", "  "),
    ("--host", ""),
    ("--device", ""),
    ("--max-nodes", "many"),
]


@pytest.mark.parametrize(("flag", "value"), UNUSABLE, ids=[f"{f}={v}" for f, v in UNUSABLE])
def test_an_unusable_value_is_a_usage_error_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "tiny", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and "Traceback" not in err, err


@pytest.mark.parametrize(("flag", "value"), [("--resident-gb", "0"), ("--resident-gb", "1e12")])
def test_the_resident_budgets_that_serve_are_still_taken(flag: str, value: str) -> None:
    args = build_parser().parse_args(["serve", flag, value])
    assert args.resident_gb == float(value)


def test_the_session_limits_take_what_clients_take() -> None:
    """The flags of welcome.limits read by SessionLimits.RANGES: the least of each is accepted,
    one less is not."""
    parser = build_parser()
    for name, (lo, hi) in SessionLimits.RANGES.items():
        flag = "--" + name.replace("_", "-")
        assert getattr(parser.parse_args(["serve", flag, str(lo)]), name) == lo
        assert getattr(parser.parse_args(["serve", flag, str(hi)]), name) == hi
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, str(lo - 1)])


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CLOUD_VERIFIER_MAX_PENDING", "-1"),
        ("CLOUD_VERIFIER_IDLE_TIMEOUT_S", "nan"),
        ("CLOUD_VERIFIER_RESIDENT_GB", "1e308"),
        ("CLOUD_VERIFIER_MAX_BYTES", "0"),
        ("CLOUD_VERIFIER_PING_INTERVAL_S", "0"),
        ("CLOUD_VERIFIER_MODEL", ""),
        ("CLOUD_VERIFIER_DTYPE", "float8"),
        ("CLOUD_VERIFIER_LOG_FORMAT", "xml"),
    ],
)
def test_an_unusable_environment_value_is_a_usage_error_naming_the_variable(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["serve", "--model", "tiny"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cloud-verifier: {variable}={value!r}: "), lines


@pytest.mark.parametrize(
    "change",
    [
        {"max_pending": -1},
        {"max_context": 0},
        {"max_bytes": 100},
        {"idle_timeout_s": math.nan},
        {"hello_timeout_s": math.inf},
        {"resident_gb": 1e308},
        {"threads": -1},
        {"port": 65536},
        {"model": ""},
        {"weights": "int4"},
        {"max_sessions": 2.5},
        {"max_nodes": True},
    ],
    ids=repr,
)
def test_a_config_made_in_code_is_held_to_the_same_rule(change: dict[str, object]) -> None:
    (name,) = change
    with pytest.raises(ValueError, match=f"ServerConfig.{name}"):
        ServerConfig(**change)  # type: ignore[arg-type]


def test_ctrl_c_is_exit_130_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert main(["serve"]) == 130
    assert capsys.readouterr().err == "cloud-verifier: interrupted\n"


def test_help_is_exit_0_and_says_what_drain_timeout_0_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0: no wait: running generations end at once" in out


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_with_drain_timeout_0_drains_at_once_and_exits_0() -> None:
    """`--drain-timeout 0` exited 143 (uvicorn re-raised the signal); a drain of 0 s is a drain."""
    with verifier_process("--drain-timeout", "0") as (proc, _):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        err = proc.stderr.read() if proc.stderr is not None else ""
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err


def test_openmp_threads_sleep_alone_and_spin_briefly_together_unless_the_environment_says() -> None:
    """One verifier thread: OpenMP's waiters sleep (PASSIVE); several: a bounded spin before they
    sleep (GOMP_SPINCOUNT), so the ~200 regions of a forward do not each wake a sleeping thread; an
    environment that names either variable is left as it is."""
    from cloud_verifier.server_config import SPIN_COUNT, openmp_waiting

    assert openmp_waiting(1, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_waiting(2, {}) == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert openmp_waiting(8, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_waiting(1, {"GOMP_SPINCOUNT": "0"}) == {}
