"""The onnxruntime drafter: its export agrees with the torch drafter on the same weights, the manifest
refuses what does not match, first use exports into the cache, and greedy generation through a live
verifier is exactly target-only `ar`.

Default suite: `tiny` (exported once per session by the `onnx_tiny` and `onnx_tiny_int8` fixtures):
the int8 export holds 8-bit blocks run by MatMulNBits, agrees with torch, and quantizes without a
float copy of its weights. SLOW=1 adds SmolLM2-135M: fp32 agreement, int8 top-1 agreement and
total variation (no worse than the onnxruntime quantize_dynamic export it replaced; the figures are
printed) and the greedy end-to-end check.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from bench.harness import load_prompts
from edge_client.cli import main as cli_main
from edge_client.client import TreeSpec
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.onnx.export import (
    DYNAMIC_LAYOUT,
    INT8_LAYOUT,
    MANIFEST,
    ExportError,
    check_manifest,
    read_manifest,
)

if TYPE_CHECKING:
    from edge_client.drafters.onnx_drafter import OnnxDrafter
    from edge_client.drafters.torch_drafter import TorchDrafter

FP32_ATOL = 1e-3  # the bound on max |Δlogit| between onnx fp32 and torch on the same weights
# SmolLM2-135M int8 vs fp32 over 48 greedy positions: onnxruntime's quantize_dynamic export (int8
# weights per channel, activations per tensor) scored top-1 0.917 and mean TV 0.125; the 8-bit
# blocks that replaced it score 0.958 and 0.038, and must stay at least as good as the old one
INT8_TOP1_FLOOR, INT8_TV_CEILING = 0.917, 0.125
# tiny vs torch: measured 1.0 and 0.021 (blocks), 1.0 and 0.024 (--int8-method dynamic)
TINY_INT8_TOP1_FLOOR, TINY_INT8_TV_CEILING = 0.9, 0.05
PROMPT = "Once upon a time, in a small village by the sea, there lived"
LIMITS = {"max_context": 256, "max_nodes": 32, "max_leaves": 16}


def _agreement(onnx: Drafter, ref: Drafter, steps: int = 4) -> float:
    """Max |Δlogit| over a prompt, `steps` greedy decode steps and one tree level of 8 rows."""
    s = onnx.tokenizer.encode(PROMPT)
    worst = 0.0
    for _ in range(steps):
        a, b = onnx.sync(s), ref.sync(s)
        worst = max(worst, float(np.abs(a - b).max()))
        s = [*s, int(np.argmax(b))]
    top = [int(t) for t in np.argsort(-ref.sync(s))[:4]]
    onnx.sync(s)
    level1 = [-1, -1, -1, -1]
    a, b = onnx.extend(level1, top), ref.extend(level1, top)
    worst = max(worst, float(np.abs(a - b).max()))
    parents, tokens = [0, 0, 1, 1, 2, 3, 4, 5], [11, 12, 13, 14, 15, 16, 17, 18]  # a level of 8 rows
    a, b = onnx.extend(parents, tokens), ref.extend(parents, tokens)
    assert a.shape == (8, onnx.vocab_size)
    return max(worst, float(np.abs(a - b).max()))


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    pa, pb = np.exp(a - a.max()), np.exp(b - b.max())
    return 0.5 * float(np.abs(pa / pa.sum() - pb / pb.sum()).sum())


def _greedy_agreement(ref: Drafter, d: Drafter, steps: int) -> tuple[float, float]:
    """Top-1 agreement and mean total variation of `d` against `ref` along ref's greedy path."""
    s = ref.tokenizer.encode(PROMPT)
    agree, tvs = 0, []
    for _ in range(steps):
        a, b = ref.sync(s), d.sync(s)
        agree += int(np.argmax(a)) == int(np.argmax(b))
        tvs.append(_tv(a, b))
        s = [*s, int(np.argmax(a))]
    return agree / steps, float(np.mean(tvs))


def test_tiny_agrees_with_torch_on_steps_and_a_tree_level(onnx_tiny: Path) -> None:
    with (
        create_drafter("onnx", str(onnx_tiny), **LIMITS) as d,
        create_drafter("torch", "tiny", **LIMITS) as ref,
    ):
        assert d.vocab_fingerprint() == ref.vocab_fingerprint()
        assert d.tokenizer.encode(PROMPT) == ref.tokenizer.encode(PROMPT)
        ids = d.tokenizer.encode("naïve café 你好 🙂 <|im_start|>user")
        assert d.tokenizer.decode(ids) == ref.tokenizer.decode(ids)
        assert _agreement(d, ref) <= FP32_ATOL


def test_tiny_int8_export_holds_8bit_blocks(onnx_tiny: Path, onnx_tiny_int8: Path) -> None:
    import onnx
    from onnx import TensorProto

    manifest = read_manifest(onnx_tiny_int8)
    assert manifest.int8 and manifest.int8_layout == INT8_LAYOUT
    assert read_manifest(onnx_tiny).int8_layout is None
    model = onnx.load(str(onnx_tiny_int8 / "model.onnx"), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 * manifest.num_layers + 1  # q|k|v, o, gate|up, down per layer; the head
    inits = {t.name: t for t in model.graph.initializer}
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and set(n.input) & set(inits)]
    embed = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    assert embed.input[0] == nbits[-1].input[1]  # tied: the head runs on the embedding's blocks
    nbytes: Counter[int] = Counter()
    for t in inits.values():
        nbytes[t.data_type] += int(np.prod(t.dims)) * (1 if t.data_type == TensorProto.UINT8 else 4)
    assert nbytes[TensorProto.FLOAT] < nbytes[TensorProto.UINT8] / 8  # scales and norms only
    assert manifest.files["model.onnx.data"] < 0.3 * read_manifest(onnx_tiny).files["model.onnx.data"]
    with pytest.raises(ExportError, match="int8 export but fp32 was asked"):
        create_drafter("onnx", str(onnx_tiny_int8), int8=False)


def test_tiny_int8_agrees_with_torch(onnx_tiny_int8: Path) -> None:
    with (
        create_drafter("onnx", str(onnx_tiny_int8), int8=True, **LIMITS) as d,
        create_drafter("torch", "tiny", **LIMITS) as ref,
    ):
        top1, tv = _greedy_agreement(ref, d, 16)
        assert top1 >= TINY_INT8_TOP1_FLOOR and tv <= TINY_INT8_TV_CEILING, (top1, tv)
        parents, tokens = [-1, -1, 0, 1, 2, 3], [11, 12, 13, 14, 15, 16]  # two levels of a tree
        a = np.concatenate([d.extend(parents[:2], tokens[:2]), d.extend(parents[2:], tokens[2:])])
        b = np.concatenate([ref.extend(parents[:2], tokens[:2]), ref.extend(parents[2:], tokens[2:])])
        assert np.mean([_tv(x, y) for x, y in zip(a, b, strict=True)]) <= TINY_INT8_TV_CEILING


def test_int8_method_dynamic_is_onnxruntimes_quantize_dynamic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`export-onnx --int8 --int8-method dynamic`: onnxruntime's dynamic quantization over the fp32
    graph (MatMulInteger, no fp32 graph left behind); it runs in the drafter and agrees with torch."""
    import onnx

    out = tmp_path / "tiny-dynamic"
    args = ["export-onnx", "--draft", "tiny", "--out", str(out), "--int8-method", "dynamic"]
    assert cli_main(args) == 2  # a usage error
    assert "add --int8" in capsys.readouterr().err and not out.exists()
    assert cli_main([*args, "--int8"]) == 0
    manifest = read_manifest(out)
    assert manifest.int8 and manifest.int8_layout == DYNAMIC_LAYOUT
    assert {p.name for p in out.iterdir()} == {*manifest.files, MANIFEST}  # no fp32 graph left
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulInteger"] >= 4 * manifest.num_layers and not ops["MatMulNBits"]
    with (
        create_drafter("onnx", str(out), int8=True, **LIMITS) as d,
        create_drafter("torch", "tiny", **LIMITS) as ref,
    ):
        top1, tv = _greedy_agreement(ref, d, 16)
        print(f"tiny dynamic int8 vs torch: top-1 {top1:.3f}, TV {tv:.3f}")
        assert top1 >= TINY_INT8_TOP1_FLOOR and tv <= TINY_INT8_TV_CEILING, (top1, tv)


def test_int8_export_needs_onnxruntime_1_22(onnx_tiny_int8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.21.1")
    with pytest.raises(ExportError, match=r"onnxruntime>=1\.22"):
        create_drafter("onnx", str(onnx_tiny_int8))
    monkeypatch.setattr(onnxruntime, "__version__", "1.22.0.dev20250401")
    create_drafter("onnx", str(onnx_tiny_int8)).close()


def test_int8_export_quantizes_without_a_float_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's buffers are traced by tracemalloc: the fp32 export's transposed head copy shows,
    the int8 export's peak stays a small fraction of one weight (rows are quantized in chunks)."""
    from edge_client.onnx import quant as onnx_quant
    from edge_client.onnx.graph import write_model
    from shared.model import load_target

    model = load_target("tiny", dtype="float32", device="cpu", progress=False).model
    head_bytes = model.embed.numel() * 4
    monkeypatch.setattr(onnx_quant, "CHUNK_VALUES", 1 << 16)
    peaks = {}
    for int8 in (False, True):
        tracemalloc.start()
        try:
            write_model(model, tmp_path / f"{int8}.onnx", f"{int8}.data", int8=int8)
            peaks[int8] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[False] >= head_bytes
    assert peaks[True] < head_bytes / 8, peaks


def test_one_tree_level_is_one_run(onnx_tiny: Path) -> None:
    with create_drafter("onnx", str(onnx_tiny), **LIMITS) as d:
        calls: list[int] = []
        session = cast("OnnxDrafter", d)._session
        run = session.run

        def counted(*args: object, **kw: object) -> object:
            calls.append(1)
            return run(*args, **kw)

        session.run = counted
        d.sync(d.tokenizer.encode(PROMPT))
        before = len(calls)
        d.extend([-1, -1, 0, 1], [5, 6, 7, 8])
        d.extend([2, 2, 3], [9, 10, 11])
        assert len(calls) - before == 2
        d.sync([*d.tokenizer.encode(PROMPT), 6, 8, 11])  # the accepted path is cached: no run
        assert len(calls) - before == 2


def test_manifest_mismatches_are_refused(onnx_tiny: Path, tmp_path: Path) -> None:
    manifest = read_manifest(onnx_tiny)
    assert manifest.source == "tiny" and not manifest.int8 and manifest.vocab_size == 49152
    with pytest.raises(ExportError, match="fp32 export but int8 was asked"):
        create_drafter("onnx", str(onnx_tiny), int8=True)
    with pytest.raises(ExportError, match="another model file"):
        check_manifest(manifest, onnx_tiny, source_id="0123456789abcdef")
    with pytest.raises(ExportError, match="not an ONNX export"):
        read_manifest(tmp_path)

    broken = tmp_path / "broken"
    shutil.copytree(onnx_tiny, broken)
    raw = json.loads((broken / MANIFEST).read_text())
    (broken / "model.onnx.data").write_bytes(b"\0" * 16)
    with pytest.raises(ExportError, match=r"model\.onnx\.data.*manifest says"):
        create_drafter("onnx", str(broken))
    raw["format"] = 99
    (broken / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="export format 99"):
        read_manifest(broken)


def test_first_use_exports_into_the_cache(
    onnx_tiny: Path,
    onnx_tiny_int8: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An alias is exported on first use: to int8 unless int8=False (the backend's fast export,
    the one `--drafter auto` picks), each precision into its own cache folder, once."""
    from edge_client.onnx import export as onnx_export

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    exported: list[Path] = []

    def fake_export(source: str, out: Path, **kw: object) -> object:
        exported.append(out)
        shutil.copytree(onnx_tiny_int8 if kw.get("int8") else onnx_tiny, out)
        return read_manifest(out)

    monkeypatch.setattr(onnx_export, "export", fake_export)
    with pytest.raises(ExportError, match="export-onnx --draft tiny --out DIR --int8"):
        create_drafter("onnx", "tiny", export=False)
    with create_drafter("onnx", "tiny", **LIMITS) as d:
        assert cast("OnnxDrafter", d).manifest.int8
    int8_folder = tmp_path / "onnx" / f"tiny-int8-{onnx_export.INT8_LAYOUT}-f{onnx_export.FORMAT}"
    assert exported == [int8_folder]
    assert "exporting tiny to ONNX" in capsys.readouterr().err
    create_drafter("onnx", "tiny", export=False, **LIMITS).close()  # cached: no second export
    assert len(exported) == 1
    with create_drafter("onnx", "tiny", int8=False, **LIMITS) as d:  # fp32 when asked for
        assert not cast("OnnxDrafter", d).manifest.int8
    assert exported == [int8_folder, tmp_path / "onnx" / f"tiny-fp32-f{onnx_export.FORMAT}"]


def test_cli_export_onnx_errors_and_help(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["export-onnx", "--draft", "no-such-model", "--out", str(tmp_path / "x")]) == 1
    assert "not a draft alias" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["export-onnx", "--help"])
    assert "--int8" in capsys.readouterr().out


def test_greedy_tiny_onnx_drafter_is_exact(onnx_tiny: Path) -> None:
    """Through a live verifier serving `tiny`: the onnx drafter's output is target-only `ar`'s."""
    from tests.cloud_verifier.service import LiveServer, tiny
    from tests.edge_client.test_e2e import _check_greedy

    prompts = [p.text for p in load_prompts(2)]
    with create_drafter("onnx", str(onnx_tiny)) as drafter, LiveServer() as srv:
        _check_greedy(tiny(), srv.ws, drafter, prompts, 24, TreeSpec())
        _check_greedy(tiny(), srv.ws, drafter, prompts[:1], 24, TreeSpec("budget", budget=12))


# ------------------------------------------------------------------------------------ SmolLM2 (slow)
@pytest.fixture(scope="module")
def smollm2_torch() -> Iterator[Drafter]:
    d = create_drafter("torch", "smollm2-135m", **LIMITS)
    yield d
    d.close()


@pytest.fixture(scope="module")
def smollm2_exports(smollm2_torch: Drafter, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from edge_client.onnx.export import export

    root = tmp_path_factory.mktemp("onnx-smollm2")
    target = cast("TorchDrafter", smollm2_torch)._target
    out = {"fp32": root / "fp32", "int8": root / "int8"}
    export("smollm2-135m", out["fp32"], progress=False, target=target)
    export("smollm2-135m", out["int8"], int8=True, progress=False, target=target)
    return out


@pytest.mark.slow
def test_smollm2_fp32_agrees_with_torch(smollm2_torch: Drafter, smollm2_exports: dict[str, Path]) -> None:
    with create_drafter("onnx", str(smollm2_exports["fp32"]), **LIMITS) as d:
        assert d.vocab_fingerprint() == smollm2_torch.vocab_fingerprint()
        worst = _agreement(d, smollm2_torch)
        print(f"smollm2 fp32 onnx vs torch: max |dlogit| {worst:.2e}")
        assert worst <= FP32_ATOL


@pytest.mark.slow
def test_int8_smollm2_agreement(smollm2_exports: dict[str, Path]) -> None:
    """int8 vs fp32 along fp32's greedy path: top-1 agreement and total variation, bounded."""
    with (
        create_drafter("onnx", str(smollm2_exports["fp32"]), **LIMITS) as f,
        create_drafter("onnx", str(smollm2_exports["int8"]), int8=True, **LIMITS) as q,
    ):
        top1, tv = _greedy_agreement(f, q, 48)
        print(f"smollm2 int8 vs fp32: top-1 agreement {top1:.3f}, mean TV {tv:.3f}")
        assert top1 >= INT8_TOP1_FLOOR and tv <= INT8_TV_CEILING


@pytest.mark.slow
def test_greedy_smollm2_onnx_drafter_is_exact(smollm2_exports: dict[str, Path]) -> None:
    from tests.cloud_verifier.service import LiveServer
    from tests.edge_client.test_e2e import _check_greedy, smollm2

    prompts = [p.text for p in load_prompts(2)]
    with LiveServer(target=smollm2(), max_context=4096) as srv:
        for kind in ("fp32", "int8"):
            with create_drafter("onnx", str(smollm2_exports[kind])) as drafter:
                _check_greedy(smollm2(), srv.ws, drafter, prompts, 32, TreeSpec())
