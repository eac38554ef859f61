"""Fixtures shared by the edge tests: the packaged GGUF, the derived 8-block draft and the ONNX
exports of `tiny` (fp32 and int8).

The 8-block file is written once per test session into a temporary cache directory (about 4 s),
so the tests never touch the user's real cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_client import models


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return models.smollm2_gguf()
    except models.ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def treespec_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TREESPEC_CACHE pointed at a session temp dir for every test."""
    path = tmp_path_factory.mktemp("treespec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESPEC_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def l8_path(smollm2_path: Path, treespec_cache: Path) -> Path:
    return models.resolve_draft(models.L8_ALIAS)


@pytest.fixture(scope="session")
def onnx_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` exported to ONNX (fp32) once per session, for the onnx drafter's tests."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from edge_client.onnx.export import export

    out = tmp_path_factory.mktemp("onnx") / "tiny"
    export("tiny", out, progress=False)
    return out


@pytest.fixture(scope="session")
def onnx_tiny_int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` exported to ONNX with --int8 (8-bit blocks, MatMulNBits) once per session."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from edge_client.onnx.export import export

    out = tmp_path_factory.mktemp("onnx") / "tiny-int8"
    export("tiny", out, int8=True, progress=False)
    return out
