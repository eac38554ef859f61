"""The TypeScript client (clients/typescript): its own tests (the protocol vectors, prompt lookup)
and, against a live verifier, exactly the tokens of target-only decoding. Skipped, saying why, on a
machine without Node 20 and npm."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shared.messages import Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, LiveServer, reference, slow_forwards, tiny

TS = Path(__file__).resolve().parents[2] / "clients" / "typescript"


@functools.cache
def _built() -> str | None:
    """Install and compile once; None when it worked, else why not."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "Node.js 20 and npm are not installed: the TypeScript client's tests are skipped"
    major = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip().lstrip("v")
    if int(major.split(".")[0]) < 20:
        return f"Node.js {major} is older than 20: the TypeScript client's tests are skipped"
    if not (TS / "node_modules").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=TS, check=True, capture_output=True)
    subprocess.run([npm, "run", "build"], cwd=TS, check=True, capture_output=True)
    return None


@pytest.fixture
def built() -> None:
    why = _built()
    if why is not None:
        pytest.skip(why)


def _cli(*args: str) -> dict[str, object]:
    r = subprocess.run(
        ["node", "dist/src/cli.js", *args, "--json"], cwd=TS, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    doc: dict[str, object] = json.loads(r.stdout)
    return doc


def test_typescript_unit_tests_and_vectors(built: None) -> None:
    r = subprocess.run(["node", "--test", "dist/test/"], cwd=TS, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "# fail 0" in r.stdout and "# pass " in r.stdout


# a prompt that repeats itself, where prompt lookup finds continuations
PROMPT = [101, 102, 103, 104, 105, 106, 101, 102, 103, 104, 105, 106, 101, 102]


def test_greedy_through_the_typescript_client_equals_target_only(built: None) -> None:
    with LiveServer() as srv:
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint,
                   "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "40")  # fmt: skip
    assert out["tokens"] == reference(tuple(PROMPT), 40)
    stats = out["stats"]
    assert isinstance(stats, dict) and stats["tokens"] == len(out["tokens"])


def _seeded_ar(url: str) -> list[int]:
    """Target-only decoding of PROMPT in mode ar at T 0.9, seed 77, 30 tokens."""

    async def ar() -> list[int]:
        s = await AsyncSession.open(url)
        assert isinstance(await s.recv(), Welcome)
        await s.ws.send(s.proto.prompt(Prompt(np.array(PROMPT), Mode.AR, 0.9, 0, 1.0, 77, 30)))
        toks: list[int] = []
        while True:
            v = await s.recv()
            assert isinstance(v, Verdict)
            toks += v.tokens.tolist()
            if v.done:
                await s.close()
                return toks

    return asyncio.run(ar())


def _auto_cli(url: str, *args: str) -> dict[str, object]:
    return _cli("--server", url, "--fingerprint", tiny().vocab_fingerprint,
                "--prompt-ids", ",".join(map(str, PROMPT)), *args)  # fmt: skip


def test_auto_through_the_typescript_client_equals_ar(built: None) -> None:
    """Mode auto, the client's default (prompt lookup drafting): greedy output is the target's own
    under both objectives, and at T 0.9 (auto verifies match) exactly seeded ar's; the verifier
    honours round.stream, so the latency plan keeps a stream waiting behind its trees."""
    with LiveServer() as srv:
        for objective in ("latency", "cost"):
            out = _auto_cli(srv.ws, "--max-new-tokens", "40", "--objective", objective)
            assert out["tokens"] == reference(tuple(PROMPT), 40), objective
            st = out["stats"]
            assert isinstance(st, dict) and st["mode"] == "greedy" and st["tokens"] == 40, st
            if objective == "latency":
                assert st["streams"] >= 1, st
        seeded = _auto_cli(srv.ws, "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30")
        assert isinstance(seeded["stats"], dict) and seeded["stats"]["mode"] == "match"
        assert seeded["tokens"] == _seeded_ar(srv.ws)


def test_auto_speculates_as_before_against_a_verifier_without_streams(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier that does not honour round.stream (its welcome.features lacks it): auto sends no
    stream and keeps the output; one of an earlier release, which refuses hello.features, is spoken
    to again without them."""
    import shared.messages
    import shared.server_protocol
    from shared.messages import FEATURE_STREAM, FEATURES

    monkeypatch.setattr(shared.server_protocol, "FEATURES", tuple(f for f in FEATURES if f != FEATURE_STREAM))
    with LiveServer() as srv:
        out = _auto_cli(srv.ws, "--max-new-tokens", "40")
    assert out["tokens"] == reference(tuple(PROMPT), 40)
    assert isinstance(out["stats"], dict) and out["stats"]["streams"] == 0

    hello = shared.messages._DECODERS["hello"]

    def earlier(r: Any) -> Any:  # the decoder of a release before hello.features
        if r.has("features"):
            raise r.bad("features", "unknown field")
        return hello(r)

    monkeypatch.setitem(shared.messages._DECODERS, "hello", earlier)
    with LiveServer() as srv:
        old = _auto_cli(srv.ws, "--max-new-tokens", "40")
    assert old["tokens"] == reference(tuple(PROMPT), 40)
    assert isinstance(old["stats"], dict) and old["stats"]["streams"] == 0


def test_auto_trees_drafted_below_a_stream_are_re_rooted_and_keep_the_output(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the target streams, auto sends a tree drafted below the sequence it knows (no
    prediction of the streamed tokens); the verifier re-roots it below the tokens streamed meanwhile
    (PROTOCOL.md section 5) and verifies it instead of the next stream step, and the client checks
    the verdict's accepted nodes against the re-rooted tree it computes: greedy output stays the
    target's own and seeded match seeded ar's. 30 ms a forward, so the tree arrives mid-stream."""
    import shared.server_protocol

    slow_forwards(monkeypatch, 0.03)
    usable = shared.server_protocol.ServerProtocol._usable
    rerooted = []

    def counting(gen: Any, tree: Any) -> Any:
        u = usable(gen, tree)
        if u is not None and u is not tree:
            rerooted.append(len(u.cond) - len(tree.cond))
        return u

    monkeypatch.setattr(shared.server_protocol.ServerProtocol, "_usable", staticmethod(counting))
    with LiveServer() as srv:
        out = _auto_cli(srv.ws, "--max-new-tokens", "40")
        assert out["tokens"] == reference(tuple(PROMPT), 40)
        st = out["stats"]
        assert isinstance(st, dict) and st["aheadTrees"] >= 1 and st["hits"] >= 1, st
        assert rerooted and min(rerooted) >= 1, rerooted
        seeded = _auto_cli(srv.ws, "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30")
        assert seeded["tokens"] == _seeded_ar(srv.ws)


def test_seeded_match_through_the_typescript_client_equals_seeded_ar(built: None) -> None:
    with LiveServer() as srv:
        want = _seeded_ar(srv.ws)
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint, "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--mode", "match", "--temperature", "0.9", "--seed", "77",
                   "--max-new-tokens", "30")  # fmt: skip
        assert out["tokens"] == want


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model exported to ONNX (fp32), as `edge-client export-onnx tiny` writes it."""
    from edge_client.onnx.export import export

    out = tmp_path_factory.mktemp("onnx") / "tiny"
    export("tiny", out, progress=False)
    return out


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


EDGE_SCRIPT = """
import * as ort from "onnxruntime-node";
import { Edge, folderReader } from "./dist/src/index.js";
const [url, folder] = process.argv.slice(1);
const edge = await Edge.open(url, await folderReader(folder), ort, { tree: [1, 2, 1, 1] });
let text = "";
for await (const piece of edge.generate("Say hi in three languages", { maxNewTokens: 24 })) text += piece;
edge.close();
const doc = { text, ids: edge.encode("Say hi in three languages"), tau: edge.last.tau };
process.stdout.write(JSON.stringify(doc), () => process.exit(0));
"""


@pytest.mark.slow  # a live verifier and Node processes: ~20 s
def test_the_edge_sdk_streams_the_targets_text(built: None, tiny_export: Path) -> None:
    """The SDK object (Edge: session + ONNX drafter + tokenizer): a text prompt in, the target's own
    greedy answer out as text, streamed in pieces that join to the Python tokenizer's decoding."""
    from edge_client.onnx.export import read_manifest
    from edge_client.stored_tokenizer import StoredTokenizer

    with LiveServer() as srv:
        cmd = ["node", "--input-type=module", "-e", EDGE_SCRIPT, srv.ws, str(tiny_export)]
        r = subprocess.run(cmd, cwd=TS, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    m = read_manifest(tiny_export)
    tok = StoredTokenizer(tiny_export, bos_id=m.bos_id, eos_ids=m.eos_ids, chat_template=m.chat_template)
    chat = tok.render_chat(
        [{"role": "user", "content": "Say hi in three languages"}], add_generation_prompt=True
    )
    ids = tok.encode(chat, add_special=False, parse_special=True)
    assert doc["ids"] == ids
    want = tok.decode(reference(tuple(ids), 24)).decode("utf-8", "replace")
    assert doc["text"] == want and doc["tau"] >= 1.0  # mode auto (the default) may let the target stream


BACKGROUND_SCRIPT = """
import * as ort from "onnxruntime-node";
import { Edge, folderReader } from "./dist/src/index.js";
const [url, folder, ids, mode] = process.argv.slice(1);
let release;
const gate = new Promise((r) => (release = r));
// onnxruntime's session is made only after the third verdict: a draft model that loads slowly
const create = async (...a) => {
  await gate;
  return ort.InferenceSession.create(...a);
};
const slow = { ...ort, InferenceSession: { create } };
const edge = await Edge.open(url, await folderReader(folder), slow, { tree: [1, 2, 1, 1], background: true });
const loadedAtOpen = edge.drafting;
const marks = [];
const onVerdict = (v) => {
  marks.push(v.cloudOnly);
  if (marks.length === 3) release();
};
const opts = mode === "match"
  ? { mode, temperature: 0.9, seed: 77n, maxNewTokens: 30 }
  : { mode, maxNewTokens: 40 };
const tokens = [];
for await (const _ of edge.generate(ids.split(",").map(Number), { ...opts, onVerdict })) {}
tokens.push(...edge.client.committed.slice(ids.split(",").length));
edge.close();
const doc = { tokens, loadedAtOpen, marks, stats: edge.last };
process.stdout.write(JSON.stringify(doc), () => process.exit(0));
"""


@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_the_edge_starts_before_its_model_is_loaded_and_keeps_the_output(
    built: None, tiny_export: Path, mode: str
) -> None:
    """`background: true` (the page's default): Edge.open returns once the verifier answers, the first
    rounds are the target's own tokens (empty trees, marked `cloudOnly`), and drafting starts with
    the first round after the model is loaded; greedy output is the target's own, seeded match
    seeded ar's."""
    with LiveServer() as srv:
        ids = ",".join(map(str, PROMPT))
        cmd = ["node", "--input-type=module", "-e", BACKGROUND_SCRIPT, srv.ws, str(tiny_export), ids, mode]
        r = subprocess.run(cmd, cwd=TS, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        want = reference(tuple(PROMPT), 40) if mode == "greedy" else _seeded_ar(srv.ws)
    assert doc["tokens"] == want
    assert doc["loadedAtOpen"] is False and doc["marks"][:3] == [True, True, True]
    st = doc["stats"]
    assert 3 <= st["cloudRounds"] < len(doc["marks"]) and st["draftedNodes"] > 0, st
    drafted = doc["marks"].index(False)  # from here on the model drafts
    assert all(not m for m in doc["marks"][drafted:]) and len(doc["marks"]) < len(want), doc["marks"]


DYNAMIC_SCRIPT = """
import * as ort from "onnxruntime-node";
import { draftDynamic, folderReader, OnnxDrafter } from "./dist/src/index.js";
const [folder, ids, budget] = process.argv.slice(1);
const drafter = await OnnxDrafter.load(await folderReader(folder), folder, ort);
const out = await draftDynamic(drafter, ids.split(",").map(Number), Number(budget), { maxDepth: 6 });
process.stdout.write(JSON.stringify(out.tree), () => process.exit(0));
"""


@pytest.mark.slow  # a live verifier and Node processes: ~20 s
def test_budget_trees_in_typescript_are_the_python_edges_and_keep_the_output(
    built: None, tiny_export: Path
) -> None:
    """The best-first budget tree drafted in TypeScript is the one the Python edge drafts with the
    same export (trees.draft_dynamic on its ONNX drafter); through the verifier, a fixed budget and
    one sized each round from the cost curve both give exactly the target's greedy output."""
    from edge_client.drafters.onnx_drafter import OnnxDrafter
    from edge_client.trees import DraftOptions, draft_dynamic

    d = OnnxDrafter(tiny_export, progress=False)
    for prompt, budget in ((PROMPT, 12), (PROMPT[:5], 20)):
        want = draft_dynamic(d, prompt, budget, DraftOptions(), max_depth=6).tree
        cmd = [
            "node",
            "--input-type=module",
            "-e",
            DYNAMIC_SCRIPT,
            str(tiny_export),
            ",".join(map(str, prompt)),
        ]
        r = subprocess.run([*cmd, str(budget)], cwd=TS, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["tokens"] == want.tokens.tolist() and got["parents"] == want.parents.tolist()
    d.close()
    with LiveServer() as srv:
        # auto: this test server advertises a one-point cost curve ({1: 1 ms}), so auto sizes trees of 1
        for size, tau in (("12", 2.5), ("auto", 1.0)):
            out = _cli("generate", "--server", srv.ws, "--draft", str(tiny_export), "--prompt-ids",
                       ",".join(map(str, PROMPT)), "--max-new-tokens", "40", "--budget", size,
                       "--mode", "greedy")  # fmt: skip
            assert out["tokens"] == reference(tuple(PROMPT), 40), size
            assert isinstance(out["stats"], dict) and out["stats"]["tau"] > tau, size


def test_the_typescript_budget_is_the_python_edges(built: None) -> None:
    """chooseBudget sizes a tree as speculation.estimates.choose_budget does, over cost curves,
    gains, round trips and drafting speeds."""
    from edge_client.speculation.estimates import choose_budget

    cases = []
    rng = np.random.default_rng(3)
    for _ in range(40):
        sizes = sorted(rng.choice(np.arange(1, 65), size=int(rng.integers(1, 6)), replace=False).tolist())
        base = float(rng.uniform(5, 100))
        cost = {int(n): base + float(rng.uniform(0.1, 3.0)) * n for n in sizes}
        gains = np.sort(rng.uniform(0, 1, size=int(rng.integers(1, 70))))[::-1].tolist()
        rtt, per = float(rng.choice([0.0, 25.0, 100.0])), float(rng.uniform(0, 5))
        want = choose_budget(cost, gains, rtt_ms=rtt, draft_ms_per_node=per, max_nodes=48)
        cases.append(
            {
                "cost": {str(k): v for k, v in cost.items()},
                "gains": gains,
                "rtt": rtt,
                "per": per,
                "want": want,
            }
        )
    script = """
    import { chooseBudget } from "./dist/src/index.js";
    const cases = JSON.parse(process.argv[1]);
    const size = (c) => chooseBudget(c.cost, c.gains, { rttMs: c.rtt, draftMsPerNode: c.per, maxNodes: 48 });
    const got = cases.map(size);
    process.stdout.write(JSON.stringify(got), () => process.exit(0));
    """
    r = subprocess.run(["node", "--input-type=module", "-e", script, json.dumps(cases)], cwd=TS,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [c["want"] for c in cases]


RESUME_SCRIPT = """
import * as ort from "onnxruntime-node";
import { createInterface } from "node:readline";
import { draftStatic, folderReader, OnnxDrafter, TreespecClient } from "./dist/src/index.js";
const [url, folder, mode, pauseAt] = process.argv.slice(1);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const drafter = await OnnxDrafter.load(await folderReader(folder), folder, ort);
const c = await TreespecClient.connect(url, drafter.manifest.fingerprint, undefined,
                                       { resume: { attempts: 60, backoffMs: 200, maxBackoffMs: 1000 } });
const out = [];
let chunks = 0;
for await (const ids of c.generate(PROMPT_IDS, { mode, temperature: 0.8, seed: 4n, maxNewTokens: 60,
                                         draft: (ctx) => draftStatic(drafter, ctx, [1, 2, 1]) })) {
  out.push(...ids);
  if (++chunks === Number(pauseAt)) {
    process.stdout.write("paused\\n");
    await lines.next();  // the test kills and restarts the verifier meanwhile
  }
}
c.close();
process.stdout.write(JSON.stringify({ tokens: out, resumes: c.last.resumes }) + "\\n", () => process.exit(0));
""".replace("PROMPT_IDS", json.dumps(PROMPT))


@pytest.mark.parametrize("mode", ["greedy", pytest.param("match", marks=pytest.mark.slow)])
def test_the_typescript_edge_resumes_after_the_verifier_is_killed(
    built: None, tiny_export: Path, mode: str
) -> None:
    """The verifier is SIGKILLed after the third verdict and a new process takes its port: the
    TypeScript edge reconnects, sends every committed token as the new session's prompt and goes on
    with exactly the tokens of an uninterrupted run (greedy: the target's; match: seeded, the same)."""
    import signal

    from tests.cloud_verifier.test_lifecycle import _free_port
    from tests.edge_client.test_resume import _serve

    port = _free_port()
    url = f"ws://127.0.0.1:{port}/v1/session"
    procs = [_serve(port)]

    def run(pause_at: int) -> dict[str, object]:
        cmd = ["node", "--input-type=module", "-e", RESUME_SCRIPT, url, str(tiny_export), mode, str(pause_at)]
        p = subprocess.Popen(cmd, cwd=TS, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None and p.stdout is not None
        if pause_at:
            assert p.stdout.readline().strip() == "paused"
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait()
            procs.append(_serve(port))
            p.stdin.write("go\n")
            p.stdin.flush()
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        doc: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return doc

    try:
        deadline = time.monotonic() + 120
        while True:  # wait for the first process to serve
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the verifier did not start"
            time.sleep(0.2)
        killed = run(3)
        whole = run(0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert killed["resumes"] == 1 and whole["resumes"] == 0
    assert killed["tokens"] == whole["tokens"]
    if mode == "greedy":
        assert killed["tokens"] == reference(tuple(PROMPT), 60)


def test_a_verifier_with_another_vocabulary_is_named(built: None, tiny_export: Path, tmp_path: Path) -> None:
    """An export whose vocabulary fingerprint is not the verifier's: the session is refused before any
    drafting, with an error naming the vocabulary (exit 1), not a wrong answer."""
    other = tmp_path / "other"
    shutil.copytree(tiny_export, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["fingerprint"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with LiveServer() as srv:
        cmd = [
            "node",
            "dist/src/cli.js",
            "generate",
            "--server",
            srv.ws,
            "--draft",
            str(other),
            "--prompt-ids",
            "1,2",
        ]
        r = subprocess.run(cmd, cwd=TS, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "VOCAB_MISMATCH" in r.stderr, r.stderr
