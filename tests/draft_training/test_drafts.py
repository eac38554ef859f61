"""`make drafts` (draft_training.drafts) on a micro recipe: the trained alias says to run `make drafts`
until it is built, the build collects, distills and exports into the model cache, the alias then
resolves to a GGUF that loads with the trained weights, a second build keeps what is built, and a
rebuild after a recipe change collects the changed side afresh."""

from __future__ import annotations

import json
from dataclasses import replace
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
    # the recipe changed since (longer held-out records): --rebuild sets the stale side aside and
    # collects it again, instead of stopping on the folder's manifest
    changed = replace(micro, heldout_tokens=8)
    build(changed, rebuild=True, progress=False)
    (aside,) = work.glob("heldout.stale-*")
    assert json.loads((aside / "manifest.json").read_text())["tokens"] == 6
    assert json.loads((work / "heldout" / "manifest.json").read_text())["tokens"] == 8
    assert not list(work.glob("train.stale-*"))  # the train side's settings did not change


def test_a_lora_recipe_writes_the_merged_draft_and_its_adapters_for_llama_cpp(cache: Path) -> None:
    """A LoRA recipe (the Qwen pilot's kind, here on the L8 draft): the merged file with the adapted
    tensors as Q8_0, and the adapters alone beside it, which the llama.cpp drafter applies to the
    unchanged base; trained with bf16 autocast. Pilots are built only when named."""
    from draft_training.drafts import _prompts, default_aliases, lora_file
    from draft_training.split import load_split
    from edge_client.drafters.llama_cpp import LlamaCppDrafter

    assert RECIPES["qwen2.5-coder-0.5b-kd"].pilot and "qwen2.5-coder-0.5b-kd" not in default_aliases()
    assert default_aliases(pilots=True) == list(RECIPES)
    some = _prompts(load_split(), "train", 13)
    assert len(some) == 13 and len({p.category for p in some}) == 13  # round-robin over the categories
    micro = Recipe(
        ALIAS, "tiny", "smollm2-135m-q4-l8", tokens=6, train_prompts=3, heldout_prompts=2,
        collect_batch=4, steps=2, batch=2, lr=1e-2, eval_every=1, gguf_type="q8_0", lora_rank=2,
        autocast="bf16", heldout_tokens=4,
    )  # fmt: skip
    info = build(micro, progress=False)
    path = Path(info["path"])
    work = cache / "draft_training" / ALIAS
    manifests = {
        side: json.loads((work / side / "manifest.json").read_text()) for side in ("train", "heldout")
    }
    assert (manifests["train"]["tokens"], manifests["heldout"]["tokens"]) == (6, 4)  # heldout_tokens
    adapter = lora_file(path)
    assert adapter.is_file() and adapter.name.endswith(".lora.gguf")
    run = json.loads((work / "run" / "train.json").read_text())
    assert run["distill"]["autocast"] == "bf16" and run["train_spec"]["lora_rank"] == 2
    base = resolve_draft("smollm2-135m-q4-l8", progress=False)
    prompt = [1, 504, 3458, 282, 4649, 314]

    def logits(model: Path, lora: Path | None = None) -> torch.Tensor:
        d = LlamaCppDrafter(model, n_threads=1, max_context=32, max_nodes=4, lora=lora)
        try:
            return torch.softmax(torch.tensor(d.sync(prompt)), -1)
        finally:
            d.close()

    merged, adapted, plain = logits(path), logits(base, adapter), logits(base)
    tvd = 0.5 * float((merged - adapted).abs().sum())
    assert tvd < 0.05 and not torch.equal(adapted, plain), tvd
