"""bench.exactness.weights_agreement: the comparison of two targets' greedy decoding (identical outputs, the
first divergence and the fp32 target's gap there, teacher-forced agreement), and the whole command
on SmolLM2 (a Q4_1 GGUF) writing its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.exactness import weights_agreement as wa
from shared.model import Target, load_target


class Nudged:
    """A target whose next-token logits are the wrapped one's with token `tok` raised by `by` (so it
    prefers `tok` where the gap is smaller than `by`): a second target that differs a little."""

    def __init__(self, target: Target, tok: int, by: float) -> None:
        self.t, self.tok, self.by = target, tok, by
        self.eos_ids = target.eos_ids
        self.model = self

    def new_kv_cache(self, *a: Any) -> Any:
        return self.t.new_kv_cache(*a)

    def forward_packed(self, inputs: Any, kv: Any) -> Any:
        return [self._nudge(r) for r in self.t.model.forward_packed(inputs, kv)]

    def _nudge(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[..., self.tok] += self.by
        return out


def test_a_target_against_itself_agrees_everywhere_and_a_nudged_one_is_caught() -> None:
    t = load_target("tiny", progress=False)
    prompt = [5, 17, 300, 42, 7]
    same = wa.compare(prompt, t, t, 16)
    assert same["identical"] and same["first_divergence"] is None and same["forced_agreement"] == 1.0
    ref = same["fp32_tokens"]
    # raise a token the reference never picks far above every logit: it wins at every step
    other = next(x for x in range(3, 500) if x not in ref)
    gaps = wa.greedy(t, prompt, 16)[1]
    nudged = Nudged(t, other, 1e4)
    with torch.inference_mode():
        diff = wa.compare(prompt, t, nudged, 16)
    assert not diff["identical"] and diff["first_divergence"] == 0
    assert diff["gap_at_divergence"] == round(gaps[0], 4)
    assert diff["forced_agreement"] == 0.0 and diff["quantized_tokens"][0] == other


def test_the_command_on_smollm2_writes_rows_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "wa.json"
    assert wa.main(["--model", "smollm2-135m", "--humaneval", "1", "--prompts", "1", "--tokens", "8",
                    "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 2 and res["complete"]
    for r in res["rows"]:
        assert r["tokens"] == len(r["fp32_tokens"]) <= 8 and 0.0 <= r["forced_agreement"] <= 1.0
        assert r["identical"] == (r["fp32_tokens"] == r["quantized_tokens"])
    s = res["summary"]
    assert s["prompts"] == 2 and s["identical_prompts"] == sum(r["identical"] for r in res["rows"])
