"""The TypeScript edge SDK driven by Node scripts: streamed text, a start before the model is loaded,
budget trees as the Python edge's, a resume after the verifier is killed, and a verifier of another
vocabulary named. Skipped without Node 20 and npm."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.clients.typescript_support import PROMPT, TS, _cli, _seeded_ar
from tests.cloud_verifier.service import LiveServer, reference

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
