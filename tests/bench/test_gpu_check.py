"""The CPU-only parts of the prepared GPU check: scripts/gpu_check.sh and bench.kernels.gpu_check (arguments,
the plan, the report without a GPU, failing and timed-out stages, the goals read from the
benchmarks' JSON), bench.kernels.gpu_forward on a tiny shape, and the CLI's CUDA flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.kernels import gpu_check, gpu_forward
from cloud_verifier.cli import build_parser
from shared.model.weights import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_plan(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    # the default budget keeps the whole check under 8 minutes; each stage gets at most what is left
    assert report["status"] == "dry-run" and report["budget_s"] <= 8 * 60 - 30
    names = [s["name"] for s in report["stages"]]
    assert names == [
        "wheels",
        "tests",
        "kernel_bench",
        "forward_bench",
        "offload_bench",
        "serve_bench",
        "fleet",
        "tensor_parallel",
        "tensor_parallel_bench",
    ]
    cmd = {s["name"]: " ".join(s["command"]) for s in report["stages"]}
    assert "--sessions 1,4,16 --nodes 16,64 --prefix 1024,8192" in cmd["kernel_bench"]
    assert "--dtype bf16" in cmd["kernel_bench"] and "--dtype bf16" in cmd["forward_bench"]
    assert "--rows 1,2,4,8,16,32,64 --prefix 1024" in cmd["forward_bench"]
    assert "-m cuda or gpu" in cmd["tests"]
    assert "bench.serving.serve" in cmd["serve_bench"] and "--clients ar,auto" in cmd["serve_bench"]
    assert "bench.serving.fleet" in cmd["fleet"] and "--device cuda" in cmd["fleet"]
    assert (tmp_path / "out" / "gpu_check.log").is_file()


def test_without_a_gpu_the_report_says_so(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main([str(tmp_path), "--stages", "tests,forward_bench"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "no-gpu" and report["environment"]["gpu"] is False
    assert report["environment"]["torch"] == torch.__version__
    assert [s["status"] for s in report["stages"]] == ["skipped", "skipped"]
    assert report["goals"]["forward_16_over_1_bf16"]["met"] is None


@pytest.mark.parametrize(
    "argv", [["--stages", "tests,nope"], ["--stages", ""], ["--budget-s", "1"], ["--budget-s", "1e9"]]
)
def test_bad_arguments_exit_2(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([str(tmp_path), *argv]) == 2
    assert "bench.kernels.gpu_check:" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_tensor_parallel_stage_runs_only_with_two_gpus(tmp_path: Path) -> None:
    for devices, want in (([], "skipped: 0 GPUs"), (["NVIDIA H200"], "skipped: 1 GPU"), (["a", "b"], None)):
        tests, bench, other = gpu_check.plan(
            tmp_path, "python", ["tensor_parallel", "tensor_parallel_bench", "forward_bench"], quick=True
        )
        assert "-m cuda" in " ".join(tests.command) and tests.command[-1] == gpu_check.TP_TESTS
        assert (ROOT / gpu_check.TP_TESTS).is_file()
        assert "bench.kernels.parallel --device cuda --dtype bf16 --tensor-parallel 2" in " ".join(
            bench.command
        )
        gpu_check.skip_for_gpus([tests, bench, other], {"devices": devices})
        for st in (tests, bench):
            assert (st.status, st.note) == (("skipped", want) if want else ("planned", ""))
        assert other.status == "planned"


def test_a_failing_or_slow_stage_is_recorded(tmp_path: Path) -> None:
    py = sys.executable
    fail = gpu_check.Stage("x", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
    slow = gpu_check.Stage("y", [py, "-c", "import time; time.sleep(30)"], 30)
    late = gpu_check.Stage("z", [py, "-c", "pass"], 30)
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_stage(fail, 100, log)
        gpu_check.run_stage(slow, 1.5, log)
        gpu_check.run_stage(late, 0.5, log)
    assert (fail.status, fail.rc) == ("failed", 3)
    assert slow.status == "timeout" and slow.seconds < 10
    assert late.status == "skipped" and late.note == gpu_check.BUDGET_SPENT
    text = (tmp_path / "log").read_text()
    assert "boom" in text and "===== x: failed rc=3" in text


def test_goals_read_from_the_benchmarks() -> None:
    kernel = gpu_check.Stage("kernel_bench", [], 1)
    kernel.result = {
        "rows": [
            {"sessions": 16, "nodes": 64, "prefix": 8192, "dtype": "bf16", "speedup_vs_sdpa": 1.7},
            {"sessions": 1, "nodes": 64, "prefix": 8192, "dtype": "bf16", "speedup_vs_sdpa": 0.9},
        ]
    }
    forward = gpu_check.Stage("forward_bench", [], 1)
    forward.result = {"by_attention": {"model": {"ratio_16_over_1": 1.31, "attention_kernel": "triton"}}}
    g = gpu_check.goals([kernel, forward])
    assert g["kernel_speedup_16x64_8k"] == {"at_least": 1.5, "value": 1.7, "met": True}
    assert g["forward_16_over_1_bf16"]["value"] == 1.31 and g["forward_16_over_1_bf16"]["met"] is False


def test_junit_counts(tmp_path: Path) -> None:
    xml = tmp_path / "p.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    assert gpu_check.junit_counts(xml) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") is None


def test_gpu_forward_on_a_tiny_shape_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--rows", "1,16", "--prefix", "20"]
    argv += ["--repeats", "1", "--decode-tokens", "2", "--attention", "sdpa", "--json", str(out)]
    assert gpu_forward.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["dtype"] == "float32" and "random weights" in r["weights"]
    s = r["by_attention"]["sdpa"]
    assert set(s["forward_ms"]) == {"1", "16"} and all(v > 0 for v in s["forward_ms"].values())
    assert s["decode_tok_s"] > 0 and s["attention_kernel"] == "sdpa"
    assert s["goal_16_over_1"]["at_most"] == 1.2 and isinstance(s["goal_16_over_1"]["met"], bool)


def test_gpu_forward_shape_is_the_1_5b() -> None:
    c = gpu_forward.QWEN_1_5B
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (1536, 28, 12, 2, 128)
    assert (c.intermediate_size, c.vocab_size, c.qkv_bias, c.tie_embeddings) == (8960, 151936, True, False)
    assert c.rope_theta == 1e6 and 1.5e9 < c.num_parameters() < 1.8e9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "1,70"], "--rows"),
        (["--prefix", "0"], "--prefix"),
        (["--attention", "model,fast"], "--attention"),
        (["--dtype", "fp8"], "--dtype"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_gpu_forward_refuses_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:  # the parser's error: usage, the message, status 2
        gpu_forward.main(["--shape", "tiny", "--device", "cpu", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_takes_the_cuda_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--device", "cuda", "--dtype", "bf16", "--attention", "triton"]
    )
    assert (args.device, args.dtype, args.attention) == ("cuda", "bf16", "triton")
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) == torch.float16
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32


def test_slow_runs_the_tests_stage_with_slow_set(tmp_path: Path) -> None:
    """--slow: the tests stage runs with SLOW=1 in its environment under the longer limit; without
    it the environment is left alone."""
    from bench.kernels import gpu_check

    for flag, env, limit in (
        ([], {}, gpu_check.LIMITS_S["tests"]),
        (["--slow"], {"SLOW": "1"}, gpu_check.SLOW_TESTS_LIMIT_S),
    ):
        out = tmp_path / ("slow" if flag else "plain")
        assert gpu_check.main([str(out), "--dry-run", "--stages", "tests", *flag]) == 0
        (st,) = json.loads((out / "gpu_check.json").read_text())["stages"]
        assert st["env"] == env and st["limit_s"] == limit
