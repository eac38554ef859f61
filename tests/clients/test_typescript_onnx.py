"""The TypeScript edge drafting with an ONNX export (onnxruntime-node): the same output as the
target alone, pre-speculation, auto with a draft model, the coupling and tokenizer the Python edge
uses, a damaged export named, an aborted generation. Skipped without Node 20 and npm."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.clients.typescript_support import PROMPT, TS, _cli, _seeded_ar
from tests.cloud_verifier.service import LiveServer, reference, slow_forwards, tiny


def test_the_typescript_edge_drafts_with_an_onnx_model_and_keeps_the_output(
    built: None, tiny_export: Path
) -> None:
    """`treespec-ts generate --draft EXPORT_DIR`: the export drafted by onnxruntime-node (the tiny
    model drafting for itself, so nearly every tree is accepted whole), greedy output exactly the
    target's own, seeded match exactly seeded ar's; coupled drafting in match, and pre-speculation
    in both, keep the output and do what they are for (more accepted, conditional trees taken)."""
    prompt = ",".join(map(str, PROMPT))
    with LiveServer() as srv:
        out = _cli("generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids", prompt,
                   "--max-new-tokens", "40", "--tree", "1,2,1,1", "--mode", "greedy")  # fmt: skip
        assert out["tokens"] == reference(tuple(PROMPT), 40)
        stats = out["stats"]
        assert isinstance(stats, dict) and stats["tau"] > 3.0  # the model's own trees, not lookup's
        lookup = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint, "--prompt-ids", prompt,
                      "--max-new-tokens", "40", "--mode", "greedy")  # fmt: skip
        assert isinstance(lookup["stats"], dict) and stats["tau"] > lookup["stats"]["tau"]
        seeded = ["--mode", "match", "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30"]
        match = _cli("generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids", prompt,
                     *seeded)  # fmt: skip
        assert match["tokens"] == _seeded_ar(srv.ws)
        # coupled drafting (the keyed token first): the self-draft proposes the very tokens the
        # target samples; the draft's likeliest tokens (--no-couple) match far fewer at T 0.9
        plain = _cli("generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids", prompt,
                     *seeded, "--no-couple")  # fmt: skip
        assert plain["tokens"] == match["tokens"]
        coupled, uncoupled = match["stats"], plain["stats"]
        assert isinstance(coupled, dict) and isinstance(uncoupled, dict)
        assert coupled["tau"] > 3.0 and coupled["tau"] > uncoupled["tau"] + 1.0, (coupled, uncoupled)


def test_typescript_prespeculation_hides_the_wait_and_keeps_the_output(
    built: None, tiny_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--prespec`: while a tree is verified the edge drafts the tree after its likeliest outcome and
    sends it conditional on it. The verifier here takes 100 ms a forward (a sleep: on loopback `tiny`
    verifies in ~1 ms, before any conditional tree could arrive), so the server finds the tree
    waiting and goes on at once (`next_round`); greedy and seeded match keep exactly the output."""
    slow_forwards(monkeypatch, 0.1)
    prompt = ",".join(map(str, PROMPT))
    gen = [
        "generate",
        "--server",
        "",
        "--draft",
        str(tiny_export),
        "--prompt-ids",
        prompt,
        "--tree",
        "1,2,1,1",
    ]
    with LiveServer() as srv:
        gen[2] = srv.ws
        pre = _cli(*gen, "--max-new-tokens", "40", "--prespec", "--mode", "greedy")
        assert pre["tokens"] == reference(tuple(PROMPT), 40)
        st = pre["stats"]
        assert isinstance(st, dict) and st["hits"] >= 2 and st["hitRate"] > 0.5, st
        seeded = ["--mode", "match", "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30"]
        pre_match = _cli(*gen, *seeded, "--prespec")
        assert pre_match["tokens"] == _seeded_ar(srv.ws)
        assert isinstance(pre_match["stats"], dict) and pre_match["stats"]["hits"] >= 1


def test_typescript_auto_with_a_draft_model_equals_ar(
    built: None, tiny_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`treespec-ts generate` in mode auto (the default) against a verifier of 30 ms a forward:
    greedy output exactly the target's own and seeded match (T 0.9) exactly seeded ar's, while it
    pre-speculates, keeps streams waiting behind its trees and drafts ahead of a running stream."""
    slow_forwards(monkeypatch, 0.03)
    prompt = ",".join(map(str, PROMPT))
    with LiveServer() as srv:
        gen = ["generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids", prompt,
               "--tree", "1,2,1,1"]  # fmt: skip
        out = _cli(*gen, "--max-new-tokens", "40")
        assert out["tokens"] == reference(tuple(PROMPT), 40)
        st = out["stats"]
        assert isinstance(st, dict) and st["mode"] == "greedy" and st["streams"] >= 1 and st["hits"] >= 1, st
        cost = _cli(*gen, "--max-new-tokens", "40", "--objective", "cost")
        assert cost["tokens"] == out["tokens"]
        seeded = _cli(*gen, "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30")
        assert seeded["tokens"] == _seeded_ar(srv.ws)


def test_the_typescript_coupling_is_the_python_edges(built: None) -> None:
    """keyedUniform is shared.keyed's (PROTOCOL.md section 7), and the coupled token is the Python
    edge's trees.Coupling.token on random rows, temperatures, top-k and top-p."""
    from edge_client.trees.sampling import Coupling
    from shared.keyed import keyed_uniform

    rng = np.random.default_rng(5)
    cases = []
    for i in range(60):
        logits = (rng.standard_normal(300) * rng.uniform(0.5, 4.0)).astype(np.float32)
        seed, pos = int(rng.integers(0, 2**63 - 1)), int(rng.integers(0, 5000))
        t, k, p = [0.3, 0.9, 1.5][i % 3], [0, 5, 40][(i // 3) % 3], [1.0, 0.9, 0.5][(i // 9) % 3]
        want = Coupling(seed, t, k, p).token(logits, pos)
        cases.append({"logits": logits.tolist(), "seed": str(seed), "pos": pos, "t": t, "k": k, "p": p,
                      "u": keyed_uniform(seed, pos), "want": want})  # fmt: skip
    script = """
    import { readFileSync } from "node:fs";
    import { coupledToken, keyedUniform } from "./dist/src/index.js";
    const cases = JSON.parse(readFileSync(0, "utf8"));
    const opts = (c) => ({ seed: BigInt(c.seed), temperature: c.t, topK: c.k, topP: c.p });
    const got = cases.map((c) => [keyedUniform(BigInt(c.seed), c.pos),
                                  coupledToken(Float32Array.from(c.logits), c.pos, opts(c))]);
    process.stdout.write(JSON.stringify(got), () => process.exit(0));
    """
    r = subprocess.run(["node", "--input-type=module", "-e", script], cwd=TS, input=json.dumps(cases),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [u for u, _ in got] == [c["u"] for c in cases]
    assert [tok for _, tok in got] == [c["want"] for c in cases]


def test_a_damaged_export_is_named(built: None, tiny_export: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export, bad)
    (bad / "model.onnx.data").write_bytes(b"cut")

    def run(folder: Path) -> subprocess.CompletedProcess[str]:
        cmd = ["node", "dist/src/cli.js", "generate", "--server", "ws://127.0.0.1:9/", "--draft", str(folder)]
        cmd += ["--prompt-ids", "1,2"]
        return subprocess.run(cmd, cwd=TS, capture_output=True, text=True, timeout=120)

    r = run(bad)
    assert r.returncode == 1 and "model.onnx.data" in r.stderr and "re-export" in r.stderr
    r = run(tmp_path / "nothing")
    assert r.returncode == 1 and "not an ONNX export" in r.stderr


def test_the_typescript_tokenizer_gives_the_python_edges_ids(built: None, tiny_export: Path) -> None:
    """Every prompt of the project's sets (chat prompts under the template, HumanEval raw), and
    prompts with special tokens, unicode and odd whitespace: the TypeScript tokenizer
    (@huggingface/tokenizers over the export's tokenizer.json) gives the Python edge's ids."""
    from bench.harness import load_suite
    from edge_client.onnx.export import read_manifest
    from edge_client.stored_tokenizer import StoredTokenizer

    m = read_manifest(tiny_export)
    tok = StoredTokenizer(tiny_export, bos_id=m.bos_id, eos_ids=m.eos_ids, chat_template=m.chat_template)
    items = [{"text": p.text, "raw": p.raw} for p in load_suite(40, 80)]
    items += [
        {"text": t, "raw": raw}
        for t in (
            "<|im_start|>user<|im_end|> hi",
            "naïve café — 東京 🚀 ∑x²",
            "  tabs\tand\n\nnewlines  ",
            "",
        )
        for raw in (False, True)
    ]
    want = []
    for it in items:
        if it["raw"]:
            want.append(tok.encode(str(it["text"]), add_special=True, parse_special=False))
        else:
            text = tok.render_chat([{"role": "user", "content": str(it["text"])}], add_generation_prompt=True)
            want.append(tok.encode(text, add_special=False, parse_special=True))
    r = subprocess.run(["node", "dist/src/cli.js", "tokenize", "--draft", str(tiny_export)], cwd=TS,
                       input=json.dumps(items), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    bad = [(it, w, g) for it, w, g in zip(items, want, got, strict=True) if w != g]
    assert not bad, f"{len(bad)} of {len(items)} prompts differ, first: {bad[0]}"


@pytest.mark.slow  # a live verifier and Node processes: ~20 s
def test_an_aborted_generation_keeps_what_was_committed(built: None, tiny_export: Path) -> None:
    """generate()'s AbortSignal: the server is told to cancel, the generation ends early, and the
    tokens committed until then are the target's own."""
    with LiveServer() as srv:
        out = _cli("generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--max-new-tokens", "60", "--cancel-after", "3")  # fmt: skip
    tokens = out["tokens"]
    assert out["cancelled"] is True and isinstance(tokens, list) and 3 <= len(tokens) < 60
    assert tokens == reference(tuple(PROMPT), 60)[: len(tokens)]
