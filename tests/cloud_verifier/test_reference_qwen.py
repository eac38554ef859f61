"""The real pair: the 1.5B target against transformers on the same GGUF, and one vocabulary on both sides.

- greedy generation of this runtime equals transformers' (both fp32, same GGUF) on 5 dev prompts
  (2 HumanEval raw, 3 Spec-Bench chat) x 64 new tokens; a divergence where the reference's top-2
  logit gap is < 1e-4 is reported as a near-tie, not failed (docs/architecture.md §4);
- tokenization of 12 prompts is the same in the verifier, in transformers and in the edge's
  llama.cpp tokenizer of the 0.5B draft; the vocabulary fingerprints and the end-of-generation
  sets agree between the 1.5B target and the 0.5B draft.

transformers runs first and is freed before this runtime loads: two fp32 copies of the 1.5B and
transformers' dequantization buffers would not fit beside each other on a 24 GB machine.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shared import model_store
from shared.model import gguf_loader, greedy_generate, load_target
from tests.cloud_verifier.helpers import PROMPTS

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b-q4"
NEW_TOKENS = 64
NEAR_TIE = 1e-4


def prompt_texts(tok: Any, humaneval: int, spec_bench: int) -> list[str]:
    lines = (PROMPTS / "humaneval_dev.jsonl").read_text(encoding="utf-8").splitlines()[:humaneval]
    texts = [json.loads(line)["prompt"] for line in lines]
    lines = (PROMPTS / "spec_bench_dev.jsonl").read_text(encoding="utf-8").splitlines()
    for line in lines[:spec_bench]:
        turn = json.loads(line)["turns"][0]
        texts.append(tok.apply_chat_template([{"role": "user", "content": turn}]))
    return texts


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]
    gaps: list[list[float]]  # the reference's top-2 logit gap at every generated position


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    path = model_store.resolve(TARGET, "target")
    return gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(path), path)


@pytest.fixture(scope="module")
def reference(tokenizer: Any) -> Reference:
    transformers = pytest.importorskip("transformers")
    path = model_store.resolve(TARGET, "target")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    eos = list(tokenizer.eos_ids)
    ref = Reference([], [], [])
    for text in prompt_texts(tokenizer, 2, 3):
        ids = tokenizer.encode(text)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
        ref.prompts.append(ids)
        ref.tokens.append(gen.sequences[0, len(ids) :].tolist())
        gaps = []
        for scores in gen.scores:
            top = torch.topk(scores[0].float(), 2).values
            gaps.append(float(top[0] - top[1]))
        ref.gaps.append(gaps)
    del model
    gc.collect()
    return ref


def test_greedy_generation_matches_transformers(reference: Reference) -> None:
    ours = load_target(TARGET, progress=False)
    ours.model.prepare(release=True)
    kv = ours.new_kv_cache(64)
    full, ties = 0, []
    for i, (ids, theirs, gaps) in enumerate(
        zip(reference.prompts, reference.tokens, reference.gaps, strict=True)
    ):
        mine = greedy_generate(ours.model, kv, ids, NEW_TOKENS, ours.eos_ids)
        j = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        if j is None:
            assert len(mine) == len(theirs), f"prompt {i}: one stopped at EOS, the other did not"
            full += 1
            continue
        assert gaps[j] < NEAR_TIE, (
            f"prompt {i}: diverged at {j} with a top-2 gap of {gaps[j]:.3g} (not a near-tie)"
        )
        ties.append((i, j, gaps[j]))
    print(
        f"greedy vs transformers ({TARGET}): {full}/{len(reference.prompts)} prompts identical, "
        f"near-ties {ties}"
    )


def test_one_vocabulary_and_stop_set_on_both_sides(tokenizer: Any) -> None:
    from edge_client.tokenizer import LlamaCppTokenizer
    from shared.vocab import vocab_fingerprint

    transformers = pytest.importorskip("transformers")
    path = model_store.resolve(TARGET, "target")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    edge = LlamaCppTokenizer(model_store.resolve(DRAFT, "draft"))
    small_path = model_store.resolve("qwen2.5-coder-0.5b", "target")
    small = gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(small_path), small_path)
    assert (
        vocab_fingerprint(tokenizer.token_texts())
        == edge.fingerprint
        == vocab_fingerprint(small.token_texts())
    )
    assert tokenizer.eos_ids == edge.eos_ids == small.eos_ids == (151643, 151645)
    for text in prompt_texts(tokenizer, 4, 8):
        ids = tokenizer.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == ids
        assert edge.encode(text, add_special=False, parse_special=True) == ids
