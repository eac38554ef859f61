"""The prepared GPU check: CUDA tests, the tree-attention microbenchmark and the 1.5B-shaped verify
forward benchmark, within one time budget; JSON and a log into OUTDIR.

`python -m bench gpu_check OUTDIR` is the one prepared GPU check, which `scripts/gpu_check.sh
OUTDIR` runs on a bare machine that has the repository and no network.

Stages, each a subprocess under `timeout` within one global budget (default 450 s, well under 8
minutes on an H200; a stage gets min(its own limit, what is left)):

  wheels        pip install --no-index every wheel of a `.whl/` folder in the repository, if any
  tests         pytest -m "cuda or gpu": the kernel's tests, the CUDA verify and forward tests, the
                chi-square matrix's CUDA cases (junit XML in OUTDIR/pytest.xml)
  kernel_bench  python -m bench.kernels.tree_attention: Triton vs SDPA (dense mask) vs the torch reference,
                sessions 1,4,16 x nodes 16,64 x prefix 1k,8k, bf16 (OUTDIR/tree_attention.json)
  forward_bench python -m bench.kernels.gpu_forward: the 1.5B's shape (random weights) in bf16, ms per
                verify forward at N = 1..64 (prefix 1024) and decode tokens/s, with the Triton
                kernel and with SDPA (OUTDIR/gpu_forward.json)
  serve_bench   python -m bench.serving.serve on the GPU verifier: `ar` against `auto` on the same arrivals
                (SmolLM2-135M and its q4 draft, 8 prompts x 48 tokens, all at once): latencies,
                the verifier's busy seconds per token, identical_to_ar (OUTDIR/serve.json); skipped
                when the model store holds no SmolLM2 files (the device has no network: carry them)
  tensor_parallel pytest tests/cloud_verifier/test_parallel_cuda.py: TP=2 over NCCL on cuda:0 and
                cuda:1 against TP=1 (bf16 logits, greedy, a killed worker); only with >= 2 GPUs
                visible, else recorded as "skipped: 1 GPU" (OUTDIR/pytest_tp.xml)
  tensor_parallel_bench python -m bench.kernels.parallel --device cuda: ms per verify forward of
                Qwen2.5-Coder-0.5B in bf16 at TP=2 (NCCL) vs TP=1; also only with >= 2 GPUs
                (OUTDIR/tensor_parallel.json)

Writes OUTDIR/gpu_check.json (bench.harness.write_result's {config, rows: the stages, complete}
besides environment, every stage's command, status ok / failed / timeout / skipped, exit code,
seconds and its JSON, the two goals) and OUTDIR/gpu_check.log (every stage's output). A
failing stage is recorded and the next one runs. Exit code: 0 when the report
was written (whatever the stages did: read "status"), 2 for bad arguments. Without a GPU nothing
runs and the report says "no-gpu"; --dry-run writes the plan without running anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import write_result
from bench.lib import runner
from bench.lib.runner import Result

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    "wheels",
    "tests",
    "kernel_bench",
    "forward_bench",
    "offload_bench",
    "serve_bench",
    "fleet",
    "tensor_parallel",
    "tensor_parallel_bench",
)
LIMITS_S = {
    "wheels": 120,
    "tests": 200,
    "kernel_bench": 150,
    "forward_bench": 150,
    "offload_bench": 150,
    "serve_bench": 150,
    "fleet": 150,
    "tensor_parallel": 120,
    "tensor_parallel_bench": 120,
}
SLOW_TESTS_LIMIT_S = 360  # the tests stage with --slow (45 chi-square cases, the 16-case kernel sweep)
TP_STAGES = ("tensor_parallel", "tensor_parallel_bench")
TP_TESTS = "tests/cloud_verifier/test_parallel_cuda.py"
TP_GPUS = 2  # the tensor_parallel stage runs with at least this many visible GPUs
TEST_PATHS = (
    "tests/treespec_kernels",
    "tests/cloud_verifier/test_verify_device.py",
    "tests/cloud_verifier/test_triton_forward.py",
    "tests/cloud_verifier/test_verify.py",
    "tests/cloud_verifier/test_verify_stats.py",
    "tests/cloud_verifier/test_offload.py",
    "tests/cloud_verifier/test_offload_gguf.py",
    "tests/cloud_verifier/test_offload_service.py",
)
KERNEL_GOAL = 1.5  # Triton >= 1.5x SDPA with a dense mask at 16 sessions x 64 nodes, prefix 8k
FORWARD_GOAL = 1.2  # a 16-row verify forward <= 1.2x a one-token decode step
BUDGET_SPENT = "the global time budget is spent"


@dataclass
class Stage:
    name: str
    command: list[str]
    limit_s: float
    json_path: Path | None = None
    status: str = "planned"  # planned / ok / failed / timeout / skipped
    rc: int | None = None
    seconds: float = 0.0
    note: str = ""
    result: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # set in the stage's environment

    def report(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": self.command,
            "limit_s": self.limit_s,
            "status": self.status,
            "rc": self.rc,
            "seconds": round(self.seconds, 2),
            "note": self.note,
            "json": str(self.json_path) if self.json_path else None,
            "result": self.result,
            "env": self.env,
            **self.extra,
        }


def wheels_stage(python: str, wheels: Sequence[Path]) -> Stage:
    """pip install --no-index every wheel of the repository's `.whl/` folder (plan skips the stage
    when there is none)."""
    return Stage(
        "wheels",
        [python, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, wheels)],
        LIMITS_S["wheels"],
        note="" if wheels else "no .whl/ folder with wheels in the repository",
    )


def tests_stage(out: Path, python: str, slow: bool = False) -> Stage:
    """pytest -m "cuda or gpu" on TEST_PATHS, junit XML into OUTDIR/pytest.xml; with `slow`, SLOW=1
    (the full chi-square matrix on CUDA and the kernel's sweep: a GPU machine is the only place they
    can run) under the longer SLOW_TESTS_LIMIT_S."""
    return Stage(
        "tests",
        [
            python,
            "-m",
            "pytest",
            "-m",
            "cuda or gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            f"--junitxml={out / 'pytest.xml'}",
            *TEST_PATHS,
        ],
        SLOW_TESTS_LIMIT_S if slow else LIMITS_S["tests"],
        env={"SLOW": "1"} if slow else {},
    )


def kernel_bench_stage(out: Path, python: str, quick: bool) -> Stage:
    """bench.kernels.tree_attention on CUDA in bf16: Triton vs SDPA vs the torch reference."""
    return Stage(
        "kernel_bench",
        [
            python,
            "-m",
            "bench.kernels.tree_attention",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--sessions",
            "1,4,16",
            "--nodes",
            "16,64",
            "--prefix",
            "1024,8192",
            "--repeats",
            "5" if quick else "20",
            "--json",
            str(out / "tree_attention.json"),
        ],
        LIMITS_S["kernel_bench"],
        out / "tree_attention.json",
    )


def forward_bench_stage(out: Path, python: str, quick: bool) -> Stage:
    """bench.kernels.gpu_forward on CUDA in bf16: ms per verify forward by rows, model kernel and SDPA."""
    return Stage(
        "forward_bench",
        [
            python,
            "-m",
            "bench.kernels.gpu_forward",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--attention",
            "model,sdpa",
            "--rows",
            "1,2,4,8,16,32,64",
            "--prefix",
            "1024",
            "--repeats",
            "3" if quick else "10",
            "--json",
            str(out / "gpu_forward.json"),
        ],
        LIMITS_S["forward_bench"],
        out / "gpu_forward.json",
    )


def tensor_parallel_stage(out: Path, python: str) -> Stage:
    """pytest -m cuda on TP_TESTS (TP=2 over NCCL against TP=1), junit XML into OUTDIR/pytest_tp.xml."""
    return Stage(
        "tensor_parallel",
        [
            python,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out / 'pytest_tp.xml'}",
            TP_TESTS,
        ],
        LIMITS_S["tensor_parallel"],
    )


def tensor_parallel_bench_stage(out: Path, python: str, quick: bool) -> Stage:
    """bench.kernels.parallel on CUDA in bf16 at TP=TP_GPUS against TP=1."""
    return Stage(
        "tensor_parallel_bench",
        [
            python,
            "-m",
            "bench.kernels.parallel",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--tensor-parallel",
            str(TP_GPUS),
            "--rows",
            "1,4,16,64",
            "--prefix",
            "1024",
            "--repeats",
            "3" if quick else "10",
            "--json",
            str(out / "tensor_parallel.json"),
        ],
        LIMITS_S["tensor_parallel_bench"],
        out / "tensor_parallel.json",
    )


def offload_bench_stage(out: Path, python: str, quick: bool) -> Stage:
    """bench.kernels.offload's forward part on CUDA: the 1.5B's shape (random bf16 weights) with its layers
    in pinned host memory copied in per forward on a side stream (--offload host), at resident
    fractions 1, 0.25 and 0: ms per forward vs rows and the copy hidden behind compute."""
    return Stage(
        "offload_bench",
        [
            python,
            "-m",
            "bench.kernels.offload",
            "--shape",
            "qwen2.5-coder-1.5b",
            "--device",
            "cuda",
            "--offload",
            "host",
            "--parts",
            "forward",
            "--resident",
            "1,0.25,0",
            "--rows",
            "1,4,16,64",
            "--repeats",
            "2" if quick else "5",
            "--json",
            str(out / "offload.json"),
        ],
        LIMITS_S["offload_bench"],
        out / "offload.json",
    )


SERVE_PAIR = ("smollm2-135m", "smollm2-135m-q4")  # small enough to carry to a device


def serve_bench_stage(out: Path, python: str, quick: bool) -> Stage:
    """bench.serving.serve, `ar` against `auto`, with the verifier on the GPU (its default device)."""
    return Stage(
        "serve_bench",
        [
            python,
            "-m",
            "bench.serving.serve",
            "--model",
            SERVE_PAIR[0],
            "--clients",
            "ar,auto",
            "--num-prompts",
            "4" if quick else "8",
            "--request-rate",
            "inf",
            "--max-tokens",
            "48",
            "--no-progress",
            "--json",
            str(out / "serve.json"),
        ],
        LIMITS_S["serve_bench"],
        out / "serve.json",
    )


def fleet_stage(out: Path, python: str) -> Stage:
    """bench.serving.fleet's proxy overhead and resumes with one replica on the GPU (Ray Serve)."""
    argv = ["--parts", "overhead,resume", "--model", SERVE_PAIR[0], "--device", "cuda", "--frames", "0",
            "--verify-sessions", "4", "--sessions", "6", "--no-progress",
            "--json", str(out / "fleet.json")]  # fmt: skip
    return Stage("fleet", [python, "-m", "bench.serving.fleet", *argv], LIMITS_S["fleet"], out / "fleet.json")


def _models_stored() -> bool:
    from shared import model_store

    return all(model_store.local_path(alias) is not None for alias in SERVE_PAIR)


def plan(out: Path, python: str, stages: Sequence[str], quick: bool, slow: bool = False) -> list[Stage]:
    """The stages to run, in order."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    all_stages = {
        "wheels": wheels_stage(python, wheels),
        "tests": tests_stage(out, python, slow),
        "kernel_bench": kernel_bench_stage(out, python, quick),
        "forward_bench": forward_bench_stage(out, python, quick),
        "offload_bench": offload_bench_stage(out, python, quick),
        "serve_bench": serve_bench_stage(out, python, quick),
        "fleet": fleet_stage(out, python),
        "tensor_parallel": tensor_parallel_stage(out, python),
        "tensor_parallel_bench": tensor_parallel_bench_stage(out, python, quick),
    }
    chosen = [all_stages[s] for s in stages]
    for st in chosen:
        if st.name == "wheels" and not wheels:
            st.status = "skipped"
        if st.name in ("serve_bench", "fleet") and not _models_stored():
            st.status, st.note = "skipped", f"the model store holds no {' / '.join(SERVE_PAIR)} files"
        if st.name == "fleet" and importlib.util.find_spec("ray") is None:
            st.status, st.note = "skipped", "Ray Serve is not installed (the fleet extra)"
    return chosen


def environment(python: str) -> dict[str, Any]:
    """What the machine has: GPU (nvidia-smi and torch), Python, torch, triton."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    smi = shutil.which("nvidia-smi")
    env["nvidia_smi"] = None
    if smi:
        try:
            env["nvidia_smi"] = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=20, check=False
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"error: {exc}"
    probe = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.cuda.is_available()}\n"
        "d['devices'] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]\n"
        "d['cuda_version'] = torch.version.cuda\n"
        "try:\n import triton; d['triton'] = triton.__version__\n"
        "except Exception as e: d['triton'] = None; d['triton_error'] = str(e)\n"
        "print(json.dumps(d))\n"
    )
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        env.update(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {})
        if r.returncode:
            env["torch_error"] = r.stderr.strip()[-2000:]
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        env["torch_error"] = str(exc)
    env["gpu"] = bool(env.get("cuda"))
    return env


def skip_for_gpus(stages: Sequence[Stage], env: dict[str, Any]) -> None:
    """The tensor-parallel stages need TP_GPUS visible GPUs: skipped (and said so) with fewer."""
    n = len(env.get("devices") or [])
    for st in stages:
        if st.name in TP_STAGES and n < TP_GPUS:
            st.status, st.note = "skipped", f"skipped: {n} GPU" + ("" if n == 1 else "s")


def run_stage(st: Stage, left_s: float, log: Any) -> None:
    """Run one stage under min(its limit, left_s) seconds, its output appended to `log`."""
    limit = min(st.limit_s, left_s)
    if st.status == "skipped":
        return
    if limit < 1:
        st.status, st.note = "skipped", BUDGET_SPENT
        return
    log.write(f"\n===== {st.name}: {' '.join(st.command)} (limit {limit:.0f} s)\n")
    log.flush()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            st.command,
            cwd=ROOT,
            env={**os.environ, **st.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=limit,
            check=False,
        )
        st.rc = proc.returncode
        st.status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        st.status, st.note = "timeout", f"killed after {limit:.0f} s"
    except OSError as exc:
        st.status, st.note = "failed", str(exc)
    st.seconds = time.monotonic() - t0
    log.write(f"===== {st.name}: {st.status} rc={st.rc} in {st.seconds:.1f} s\n")
    log.flush()
    if st.json_path is not None and st.json_path.is_file():
        try:
            st.result = json.loads(st.json_path.read_text())
        except json.JSONDecodeError as exc:
            st.note = f"{st.note}; unreadable JSON: {exc}".strip("; ")


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests / failures / errors / skipped of a pytest junit XML file."""
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def goals(stages: Sequence[Stage]) -> dict[str, Any]:
    """The two goals, from the benchmarks' JSON (None where a stage gave none)."""
    out: dict[str, Any] = {
        "kernel_speedup_16x64_8k": {"at_least": KERNEL_GOAL, "value": None, "met": None},
        "forward_16_over_1_bf16": {"at_most": FORWARD_GOAL, "value": None, "met": None},
    }
    by = {s.name: s.result for s in stages if s.result}
    for row in (by.get("kernel_bench") or {}).get("rows", []):
        if (row.get("sessions"), row.get("nodes"), row.get("prefix"), row.get("dtype")) == (
            16,
            64,
            8192,
            "bf16",
        ):
            v = row.get("speedup_vs_sdpa")
            out["kernel_speedup_16x64_8k"].update(value=v, met=v is not None and v >= KERNEL_GOAL)
    fwd = (by.get("forward_bench") or {}).get("by_attention", {})
    r = fwd.get("model") or next(iter(fwd.values()), None)
    if r and r.get("ratio_16_over_1") is not None:
        v = r["ratio_16_over_1"]
        out["forward_16_over_1_bf16"].update(
            value=v, met=v <= FORWARD_GOAL, attention_kernel=r.get("attention_kernel")
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    return runner.build_parser(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Exit code 0 when OUTDIR/gpu_check.json was written (its 'status' says how the stages "
        "went: ok, partial, no-gpu, dry-run), 2 for bad arguments."
    )
    p.add_argument("outdir", type=Path, help="directory for gpu_check.json, gpu_check.log and stage files")
    p.add_argument("--budget-s", type=float, default=450.0, help="global time budget for all stages")
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma list of stages to run, from {', '.join(STAGES)}"
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats in the benchmarks")
    p.add_argument(
        "--slow",
        action="store_true",
        help=f"run the tests stage with SLOW=1 (the slow CUDA cases too) under {SLOW_TESTS_LIMIT_S} s",
    )
    p.add_argument("--dry-run", action="store_true", help="write the plan as JSON; run nothing")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the stages")


def refused(message: str) -> Result:
    """A bad argument: the message on stderr, no report, exit status 2."""
    print(f"bench.kernels.gpu_check: {message}", file=sys.stderr)
    return Result([], status=2)


def run_planned(
    args: argparse.Namespace, planned: Sequence[Stage], stages: Sequence[str], out: Path, t0: float
) -> dict[str, Any]:
    """Run the planned stages (none on a dry run or without a GPU), logging into OUTDIR/gpu_check.log;
    the report's budget, start, environment and status (`t0`: when the budget started)."""
    report: dict[str, Any] = {"budget_s": args.budget_s, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(out / "gpu_check.log", "a", encoding="utf-8") as log:
        log.write(f"gpu_check {report['started']} budget {args.budget_s} s, stages {list(stages)}\n")
        if args.dry_run:
            report["status"] = "dry-run"
        else:
            report["environment"] = env = environment(args.python)
            log.write(f"environment: {json.dumps(env)}\n")
            if not env["gpu"]:
                report["status"] = "no-gpu"
                for st in planned:
                    st.status, st.note = "skipped", "no CUDA device"
            else:
                skip_for_gpus(planned, env)
                for st in planned:
                    run_stage(st, args.budget_s - (time.monotonic() - t0), log)
                bad = [st for st in planned if st.status in ("failed", "timeout") or st.note == BUDGET_SPENT]
                report["status"] = "partial" if bad else "ok"
    return report


def run(args: argparse.Namespace) -> Result:
    """The report is OUTDIR/gpu_check.json (there is no --json); the printed line says where."""
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        return refused(f"--stages: unknown {bad or 'none'}; choose from {STAGES}")
    if not 10 <= args.budget_s <= 3600:
        return refused(f"--budget-s must be in [10, 3600], got {args.budget_s}")
    out: Path = args.outdir.resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return refused(f"cannot create {out}: {exc}")
    t0 = time.monotonic()
    planned = plan(out, args.python, stages, args.quick, args.slow)
    report = run_planned(args, planned, stages, out, t0)
    report["elapsed_s"] = round(time.monotonic() - t0, 2)
    report["stages"] = [st.report() for st in planned]
    report["tests"] = junit_counts(out / "pytest.xml") if "tests" in stages else None
    report["tp_tests"] = junit_counts(out / "pytest_tp.xml") if "tensor_parallel" in stages else None
    report["goals"] = goals(planned)
    # complete: every planned stage ran to its end (ok or failed) or was skipped for a reason other
    # than the spent budget; rows: the stages (also under "stages", as the readers know it)
    ran = bool(planned) and all(st.status in ("ok", "failed", "skipped") for st in planned)
    complete = (
        report["status"] in ("ok", "partial") and ran and all(st.note != BUDGET_SPENT for st in planned)
    )
    write_result(out / "gpu_check.json", args, report["stages"], complete, **report)
    line = f"bench.gpu_check: {report['status']} in {report['elapsed_s']} s; wrote {out / 'gpu_check.json'}"
    return Result(report["stages"], line, complete=complete)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
