"""`make drafts` (draft_training.drafts) on a micro recipe: the trained alias says to run `make drafts`
until it is built, the build collects, distills and exports into the model cache, the alias then
resolves to a GGUF that loads with the trained weights, and a second build keeps what is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draft_training.drafts import RECIPES, Recipe, build
from edge_client.models import resolve_draft
from shared.model import load_target
from shared.model_store import ModelNotFoundError

ALIAS = "smollm2-135m-l8-kd"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    try:
        resolve_draft("smollm2-135m-q4-l8", progress=False)  # the base, derived into this cache
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return tmp_path / "cache"


def test_the_trained_alias_is_built_by_make_drafts(cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="make drafts"):
        resolve_draft(ALIAS, progress=False)
    assert ALIAS in RECIPES and RECIPES[ALIAS].draft == "smollm2-135m-q4-l8"
    micro = Recipe(
        ALIAS, "tiny", "smollm2-135m-q4-l8", tokens=6, train_prompts=3, heldout_prompts=2,
        collect_batch=4, steps=2, batch=2, eval_every=1,
    )  # fmt: skip
    info = build(micro, progress=False)
    path = resolve_draft(ALIAS, progress=False)
    assert Path(info["path"]) == path and path.is_file()
    assert [e["step"] for e in info["evals"]] == [0, 1, 2] and info["rewritten_tensors"] > 0
    assert json.loads(path.with_name(path.name + ".json").read_text())["recipe"]["steps"] == 2
    trained = dict(load_target(str(path), progress=False).model.named_parameters())
    base = load_target(str(resolve_draft("smollm2-135m-q4-l8", progress=False)), progress=False).model
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, trained[n])]
    assert moved, "training changed no weight"
    work = cache / "draft_training" / ALIAS
    assert (work / "train" / "records").is_dir() and (work / "run" / "draft.safetensors").is_file()
    mtime = path.stat().st_mtime_ns
    again = build(micro, progress=False)  # built: kept as it is
    assert path.stat().st_mtime_ns == mtime and again["evals"] == info["evals"]
