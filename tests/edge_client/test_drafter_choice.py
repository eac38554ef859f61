"""`--drafter auto`: the rule picks the faster backend from measured figures, the decision is cached
per device key (reused, measured again when the key changes), the fallbacks to llama.cpp (no
onnxruntime, a failed export) say why in one line, the micro-benchmark reports the medians of what
evaluations cost, the CLI offers `auto` as its default, and (SLOW=1) auto end to end on SmolLM2."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from edge_client.cli import build_parser
from edge_client.drafters import choice
from edge_client.drafters.choice import (
    LLAMA_CPP,
    ONNX,
    TIE,
    Choice,
    Figures,
    choose_backend,
    decision_path,
    pick_backend,
    read_decision,
    time_evaluations,
)
from edge_client.drafters.registry import backend_choices, create_drafter
from shared import model_store
from shared.gguf_check import GGUFError
from tests.edge_client.fake_drafter import FakeDrafter

# the Qwen draft measured on a quiet machine (docs/results.md): decode 25.4 vs 25.1 tok/s, a level
# of 8 rows 159 vs 94 ms (llama.cpp Q4_K_M vs ONNX int8)
QWEN = {LLAMA_CPP: {1: 39.4, 8: 158.6}, ONNX: {1: 39.8, 8: 94.0}}


# ---------------------------------------------------------------------------- the rule


def test_the_rule_picks_onnx_when_it_is_faster() -> None:
    assert pick_backend(QWEN) == ONNX


def test_the_rule_picks_llama_cpp_when_it_is_faster() -> None:
    assert pick_backend({LLAMA_CPP: {1: 15.0, 8: 40.0}, ONNX: {1: 20.0, 8: 45.0}}) == LLAMA_CPP


def test_the_rule_weighs_the_one_row_step_and_the_wide_level_together() -> None:
    # ONNX wins the 8-row level by 20 ms but loses the 1-row step by 30: llama.cpp is faster overall
    assert pick_backend({LLAMA_CPP: {1: 20.0, 8: 100.0}, ONNX: {1: 50.0, 8: 80.0}}) == LLAMA_CPP
    # and the other way round
    assert pick_backend({LLAMA_CPP: {1: 50.0, 8: 100.0}, ONNX: {1: 20.0, 8: 110.0}}) == ONNX


def test_a_near_tie_keeps_llama_cpp() -> None:
    llama = {1: 40.0, 8: 160.0}
    just_inside = {1: 40.0, 8: 160.0 - 200.0 * TIE * 0.9}
    just_outside = {1: 40.0, 8: 160.0 - 200.0 * TIE * 1.1}
    assert pick_backend({LLAMA_CPP: llama, ONNX: just_inside}) == LLAMA_CPP
    assert pick_backend({LLAMA_CPP: llama, ONNX: just_outside}) == ONNX
    assert pick_backend({ONNX: just_inside}) == ONNX  # only one measured
    with pytest.raises(ValueError):
        pick_backend({})


# ---------------------------------------------------------------------------- the micro-benchmark


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedFake(FakeDrafter):
    """A fake drafter whose evaluations of n rows take `cost(n)` ms on an injected clock."""

    def __init__(self, clock: _Clock, cost: Callable[[int], float]) -> None:
        super().__init__(vocab_size=64)
        self._clock, self._cost = clock, cost
        self.calls = 0

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        self.calls += 1
        # every 5th evaluation is an outlier (a page fault, another process): the median ignores it
        self._clock.now += (self._cost(count) * (10 if self.calls % 5 == 0 else 1)) / 1e3
        return super()._evaluate(first, count)


def test_the_micro_benchmark_reports_the_median_ms_per_row_count() -> None:
    clock = _Clock()
    a = _TimedFake(clock, lambda n: 30.0 + 10.0 * n)
    b = _TimedFake(clock, lambda n: 40.0 + 5.0 * n)
    figures = time_evaluations({LLAMA_CPP: a, ONNX: b}, warmup=1, repeats=5, clock=clock)
    assert figures == {LLAMA_CPP: {1: 40.0, 8: 110.0}, ONNX: {1: 45.0, 8: 80.0}}
    assert a.calls == b.calls == 2 * 6  # (warm-up + repeats) x (1 row, 8 rows), nothing else
    assert pick_backend(figures) == ONNX


# ---------------------------------------------------------------------------- the cache


class _Steps:
    """Stand-ins for choose_backend's steps, counting what ran."""

    def __init__(self, folder: Path, figures: Figures) -> None:
        self.folder, self.figures = folder, figures
        self.exports = self.measures = 0
        self.lines: list[str] = []
        self.cpu = "cpu A"
        self.imports: list[str] = []

    def import_module(self, name: str) -> ModuleType:
        self.imports.append(name)
        return ModuleType(name)

    def export(self, model: str) -> Path:
        self.exports += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder

    def measure(self, model: str, folder: Path, threads: int) -> Figures:
        assert folder == self.folder
        self.measures += 1
        return self.figures

    def key(self, threads: int) -> dict[str, str]:
        return {"cpu": self.cpu, "threads": str(threads), "onnxruntime": "1.32.0"}

    def choose(self, model: str = "smollm2-135m-q4", n_threads: int | None = 1) -> Choice:
        return choose_backend(
            model,
            n_threads=n_threads,
            import_module=self.import_module,
            export=self.export,
            folder_of=lambda m: self.folder,
            measure=self.measure,
            key=self.key,
            say=self.lines.append,
        )


@pytest.fixture
def steps(tmp_path: Path) -> Iterator[_Steps]:
    yield _Steps(tmp_path / "onnx" / "export-int8", QWEN)


def test_the_decision_is_measured_once_and_read_back(steps: _Steps) -> None:
    first = steps.choose()
    assert (first.backend, first.cached, first.threads) == (ONNX, False, 1)
    assert first.figures == QWEN and first.options == {"int8": True}
    assert (steps.exports, steps.measures) == (1, 1)
    assert len(steps.lines) == 2  # "timing ..." then the decision with the figures
    assert "ONNX" in steps.lines[-1] and "94.0" in steps.lines[-1] and "158.6" in steps.lines[-1]
    path = decision_path(steps.folder, steps.key(1))
    assert path.parent == steps.folder.parent and path.name.startswith(steps.folder.name)
    record = json.loads(path.read_text())
    assert record["backend"] == ONNX and record["key"] == steps.key(1)
    assert record["figures"] == {b: {str(n): ms for n, ms in per.items()} for b, per in QWEN.items()}

    again = steps.choose()
    assert (again.backend, again.cached, again.figures) == (ONNX, True, QWEN)
    assert (steps.exports, steps.measures) == (1, 1)  # neither exported nor measured again
    assert len(steps.lines) == 2  # printed once


def test_a_new_key_measures_again(steps: _Steps) -> None:
    steps.choose()
    steps.cpu = "cpu B"  # another machine (or another package version)
    steps.figures = {LLAMA_CPP: {1: 10.0, 8: 30.0}, ONNX: {1: 20.0, 8: 40.0}}
    other = steps.choose()
    assert (other.backend, other.cached) == (LLAMA_CPP, False)
    assert steps.measures == 2
    assert other.options == {}
    steps.choose(n_threads=2)  # the thread count is part of the key too
    assert steps.measures == 3
    # both decisions stay cached side by side: back on machine A, nothing is measured
    steps.cpu = "cpu A"
    assert steps.choose().backend == ONNX and steps.measures == 3


def test_a_damaged_or_foreign_decision_file_is_measured_again(steps: _Steps) -> None:
    steps.choose()
    path = decision_path(steps.folder, steps.key(1))
    path.write_text("{not json")
    assert not steps.choose().cached and steps.measures == 2
    record = json.loads(path.read_text())
    record["key"]["cpu"] = "another"  # a file copied from elsewhere under this name
    path.write_text(json.dumps(record))
    assert read_decision(path, steps.key(1)) is None
    assert not steps.choose().cached and steps.measures == 3


# ---------------------------------------------------------------------------- fallbacks


def test_without_onnxruntime_auto_drafts_with_llama_cpp_and_says_why(steps: _Steps) -> None:
    def no_onnxruntime(name: str) -> ModuleType:
        if name == "onnxruntime":
            raise ModuleNotFoundError("No module named 'onnxruntime'")
        return ModuleType(name)

    got = choose_backend(
        "qwen2.5-coder-0.5b-q4",
        import_module=no_onnxruntime,
        export=steps.export,
        folder_of=lambda m: steps.folder,
        measure=steps.measure,
        key=steps.key,
        say=steps.lines.append,
    )
    assert got.backend == LLAMA_CPP and got.figures is None
    assert (steps.exports, steps.measures) == (0, 0)
    assert len(steps.lines) == 1
    assert "onnxruntime" in steps.lines[0] and "treespec[onnx]" in steps.lines[0]
    assert "llama.cpp" in steps.lines[0]


def test_a_failed_export_falls_back_once_and_is_remembered(steps: _Steps) -> None:
    def broken(model: str) -> Path:
        steps.exports += 1
        raise RuntimeError("out of memory while writing the graph")

    steps.export = broken  # type: ignore[method-assign]
    got = steps.choose()
    assert got.backend == LLAMA_CPP and "out of memory" in got.reason
    assert len(steps.lines) == 1 and "llama.cpp" in steps.lines[0] and "out of memory" in steps.lines[0]
    again = steps.choose()
    assert (again.backend, again.cached, steps.exports, steps.measures) == (LLAMA_CPP, True, 1, 0)
    assert len(steps.lines) == 1


def test_an_export_that_cannot_be_run_falls_back_and_is_remembered(steps: _Steps) -> None:
    def unrunnable(model: str, folder: Path, threads: int) -> Figures:
        steps.measures += 1
        raise RuntimeError("onnxruntime 1.20 cannot run 8-bit MatMulNBits")

    steps.measure = unrunnable  # type: ignore[method-assign]
    got = steps.choose()
    assert got.backend == LLAMA_CPP and "MatMulNBits" in got.reason
    assert steps.lines[-1].startswith("drafting with llama.cpp") and "MatMulNBits" in steps.lines[-1]
    assert steps.choose().cached and steps.measures == 1


def test_a_malformed_gguf_is_refused_not_remembered(steps: _Steps) -> None:
    """The export refuses a malformed draft GGUF (shared.gguf_check): auto raises that one-line
    error for the CLI to print, and neither falls back to llama.cpp (which would refuse the same
    file) nor remembers a decision."""

    def malformed(model: str) -> Path:
        steps.exports += 1
        raise GGUFError(f"{model}: llama.block_count is 0, must be >= 1")

    steps.export = malformed  # type: ignore[method-assign]
    with pytest.raises(GGUFError, match="block_count is 0"):
        steps.choose()
    assert steps.lines == [] and not list(steps.folder.parent.glob("*.auto-*.json"))
    with pytest.raises(GGUFError):
        steps.choose()
    assert steps.exports == 2


def test_an_export_that_needs_a_missing_package_is_not_remembered(steps: _Steps) -> None:
    def no_torch(model: str) -> Path:
        steps.exports += 1
        raise ModuleNotFoundError("No module named 'torch'")

    steps.export = no_torch  # type: ignore[method-assign]
    assert steps.choose().backend == LLAMA_CPP
    assert "torch" in steps.lines[0]
    steps.choose()
    assert steps.exports == 2  # installing torch is enough: the next start tries again


def test_what_auto_does_with_other_models(steps: _Steps, tmp_path: Path) -> None:
    assert steps.choose(model=str(tmp_path)).backend == ONNX  # an export-onnx folder
    gguf = tmp_path / "some.gguf"
    gguf.write_bytes(b"GGUF")
    assert steps.choose(model=str(gguf)).backend == LLAMA_CPP  # a path: only aliases are exported
    assert (steps.exports, steps.measures, steps.lines) == (0, 0, [])


# ---------------------------------------------------------------------------- the CLI and registry


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_lists_auto_as_the_default_drafter(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[command]
    drafter = next(a for a in cmd._actions if "--drafter" in a.option_strings)
    assert drafter.default == "auto"
    assert list(drafter.choices or []) == ["auto", "llama_cpp", "torch", "onnx"]
    assert "{auto,llama_cpp,torch,onnx}" in cmd.format_help()
    assert "auto" in (drafter.help or "")


def test_no_parser_spells_out_the_backends_itself() -> None:
    """Every --drafter flag takes its choices from the registry (backend_choices /
    available_backends), so a new backend appears in every parser, help text and error at once."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    listed = re.compile(r"choices=\[[^\]]*[\"']llama_cpp[\"']")
    offenders = [
        str(f.relative_to(root))
        for pkg in ("edge_client", "bench", "cloud_verifier", "shared")
        for f in sorted((root / pkg).rglob("*.py"))
        if listed.search(f.read_text())
    ]
    assert offenders == []


def test_the_registry_defaults_to_auto_and_the_default_draft() -> None:
    assert backend_choices() == ["auto", "llama_cpp", "torch", "onnx"]
    params = inspect.signature(create_drafter).parameters
    assert params["backend"].default == choice.AUTO == "auto"
    assert params["model"].default == model_store.DEFAULT_DRAFT


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_auto_end_to_end_on_smollm2(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    opts = {"n_threads": 1, "max_context": 256, "max_nodes": 32}
    d = create_drafter("auto", "smollm2-135m-q4", **opts)
    try:
        err = capfd.readouterr().err
        assert "exporting smollm2-135m-q4 to ONNX (int8)" in err and "This happens once" in err
        assert "exporting smollm2-135m-q4: done" in err  # the progress bar ran to its end
        (decision,) = (tmp_path / "onnx").glob("*.auto-*.json")
        record = json.loads(decision.read_text())
        assert record["key"]["threads"] == "1"
        figures = {b: {int(n): ms for n, ms in per.items()} for b, per in record["figures"].items()}
        assert set(figures) == {LLAMA_CPP, ONNX} and all(
            ms > 0 for per in figures.values() for ms in per.values()
        )
        assert record["backend"] == pick_backend(figures) == d.name
        assert f"drafting with {'ONNX Runtime' if d.name == ONNX else 'llama.cpp'}" in err
        ids = d.tokenizer.encode("def add(a, b):")
        assert d.sync(ids).shape == (d.vocab_size,)
        assert d.extend([-1, -1], [1, 2]).shape == (2, d.vocab_size)
    finally:
        d.close()
    mtime = decision.stat().st_mtime_ns
    again = create_drafter("auto", "smollm2-135m-q4", **opts)  # read back: no export, no timing
    try:
        assert again.name == record["backend"]
        assert "drafter auto" not in capfd.readouterr().err
        assert decision.stat().st_mtime_ns == mtime
    finally:
        again.close()
