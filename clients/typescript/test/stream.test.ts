// Stream rounds in the TypeScript client (PROTOCOL.md `stream`): the new frames as the vectors state
// them, the client checks of streaming verdicts (shared/client_protocol.py), the sessions' server
// frames replayed into the checks, and mode auto's pricing.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { ClientChecks } from "../src/checks.js";
import { choosePlan, costAt, DEFAULT_PLAN, splitAhead } from "../src/client.js";
import { decodeMessage, encodeMessage, type Message, ProtocolError } from "../src/protocol.js";

type Welcome = Extract<Message, { type: "welcome" }>;
type Verdict = Extract<Message, { type: "verdict" }>;

const dir = fileURLToPath(new URL("../../../../tests/vectors/", import.meta.url));
const frames = JSON.parse(readFileSync(dir + "frames.json", "utf8"));
const sessions = JSON.parse(readFileSync(dir + "sessions.json", "utf8"));
const hex = (s: string) => Uint8Array.from(Buffer.from(s, "hex"));
const frame = (name: string) => {
  const v = frames.find((f: { name: string }) => f.name === name);
  assert.ok(v, `no vector named ${name}`);
  return v;
};

test("the stream frames decode to the vectors' meaning", () => {
  const s = decodeMessage(hex(frame("stream").hex));
  assert.deepEqual(s, { type: "stream", round: 4, k: 8 });
  const p = decodeMessage(hex(frame("prompt with stream").hex));
  assert.ok(p.type === "prompt" && p.stream === 4);
  const v = decodeMessage(hex(frame("verdict of a stream, more to come").hex));
  assert.ok(v.type === "verdict" && v.streaming === true && v.tokens.length === 1 && !v.accepted_nodes.length);
  const end = decodeMessage(hex(frame("verdict ending a stream for a matching tree").hex));
  assert.ok(end.type === "verdict" && end.streaming === undefined && end.next_round === 5);
  const c = decodeMessage(hex(frame("verdict with cost maps").hex));
  assert.ok(c.type === "verdict");
  assert.deepEqual(c.forward_ms, { 0: 4.5, 1: 5, 8: 6.25 });
  assert.deepEqual(c.marginal_ms, { 0: 1.5, 1: 2, 8: 3.25 });
  const w = decodeMessage(hex(frame("welcome with features").hex));
  assert.ok(w.type === "welcome");
  assert.deepEqual(w.features, ["welcome.features", "round.stream", "verdict.cost_ms"]);
});

test("streaming false is not written, and a verdict's cost maps go out in increasing node count", () => {
  const v: Verdict = { type: "verdict", round: 1, tokens: [4], accepted_nodes: [], has_bonus: true, committed_len: 5, verify_ms: 1,
    done: false, streaming: false, forward_ms: { 8: 6.25, 0: 4.5, 1: 5 } };  // prettier-ignore
  const back = decodeMessage(encodeMessage(v));
  assert.ok(back.type === "verdict" && back.streaming === undefined);
  assert.deepEqual(Object.keys(back.forward_ms!), ["0", "1", "8"]);
});

// ------------------------------------------------------------------------------------ the checks
const WELCOME: Welcome = {
  type: "welcome", version: 1, session_id: "s", model_id: "tiny", vocab_size: 1000, vocab_fingerprint: "",
  eos_ids: [2], allowed_modes: ["greedy", "match", "ar"], verify_cost_ms: { 1: 3 }, features: ["round.stream"],
  limits: { max_nodes: 8, max_depth: 4, max_pending: 2, max_bytes: 4096, max_context: 64 },
};  // prettier-ignore
const verdict = (round: number, tokens: number[], committed_len: number, extra: Partial<Verdict> = {}): Verdict => ({
  type: "verdict", round, tokens, accepted_nodes: [], has_bonus: true, committed_len, verify_ms: 1, done: false, ...extra,
});  // prettier-ignore
const refuses = (f: () => void, code: string, field: string) =>
  assert.throws(f, (e: unknown) => e instanceof ProtocolError && e.code === code && e.field === field);

/** A generation on [10, 11, 12] whose prompt's verdict committed 13. */
function started(): ClientChecks {
  const c = new ClientChecks(WELCOME);
  c.prompt([10, 11, 12], "greedy", 16);
  c.verdict(verdict(0, [13], 4));
  assert.equal(c.inFlight, null);
  return c;
}

test("a stream round: a verdict a token, in flight while streaming, answered by its last", () => {
  const c = started();
  c.stream(1);
  assert.equal(c.inFlight, 1);
  assert.ok(c.isStream(1) && c.waitingStream() === null);
  c.verdict(verdict(1, [14], 5, { streaming: true }));
  assert.equal(c.inFlight, 1);
  assert.equal(c.streaming, 1);
  c.verdict(verdict(1, [15], 6));
  assert.equal(c.inFlight, null);
  assert.deepEqual(c.committed, [10, 11, 12, 13, 14, 15]);
  assert.equal(c.outstanding.size, 0);
});

test("a waiting stream is the fallback for a miss, even after a later tree's verdict", () => {
  const c = started();
  c.tree(1, { base: 4, cond: [], tokens: [14, 15], parents: [-1, 0] });
  c.tree(2, { base: 4, cond: [14, 15, 16], tokens: [17], parents: [-1] });
  c.stream(3);
  assert.equal(c.inFlight, 1);
  assert.equal(c.waitingStream(), 3);
  c.stale(2);
  c.verdict({ ...verdict(1, [14, 20], 6), accepted_nodes: [0], next_round: 3 });
  assert.equal(c.inFlight, 3);
  assert.equal(c.waitingStream(), null);
  c.verdict(verdict(3, [21], 7, { streaming: true }));
  c.verdict(verdict(3, [22], 8));
  assert.equal(c.inFlight, null);
});

test("a matching tree ends the stream: the verdict names it", () => {
  const c = started();
  c.stream(1);
  c.tree(2, { base: 4, cond: [14], tokens: [15, 16], parents: [-1, 0] });
  c.verdict(verdict(1, [14], 5, { next_round: 2 }));
  assert.equal(c.inFlight, 2);
  assert.equal(c.treeOf(2)?.tokens.length, 2);
});

test("the checks refuse a verdict that breaks the stream rules", () => {
  let c = started();
  c.tree(1, { base: 4, cond: [], tokens: [14], parents: [-1] });
  refuses(() => c.verdict(verdict(1, [14], 5, { streaming: true })), "BAD_MESSAGE", "streaming"); // not a stream
  c = started();
  c.stream(1);
  refuses(() => c.verdict(verdict(1, [14], 5, { streaming: true, done: true })), "BAD_MESSAGE", "streaming");
  refuses(() => c.verdict(verdict(1, [14, 15], 6)), "BAD_MESSAGE", "tokens"); // one token a verdict
  refuses(() => c.verdict({ ...verdict(1, [14], 5), accepted_nodes: [0], has_bonus: false }), "BAD_MESSAGE", "tokens");
  refuses(() => c.verdict(verdict(7, [14], 5)), "BAD_ORDER", "round"); // never sent
  refuses(() => c.verdict(verdict(1, [14], 5, { next_round: 9 })), "BAD_ORDER", "next_round");
  refuses(() => c.verdict(verdict(1, [14], 9)), "BAD_MESSAGE", "committed_len");
  refuses(() => c.verdict(verdict(1, [1000], 5)), "OUT_OF_RANGE", "tokens");
  c.verdict(verdict(1, [14], 5, { streaming: true })); // and a good one still passes
  refuses(() => c.stream(1), "BAD_ORDER", "round");
  const ar = new ClientChecks(WELCOME);
  ar.prompt([1, 2], "ar", 8);
  refuses(() => ar.stream(1), "BAD_ORDER", "round"); // mode ar takes no streams
});

test("a prompt that streams: round 0 goes on while streaming", () => {
  const c = new ClientChecks(WELCOME);
  c.prompt([10, 11, 12], "greedy", 16, undefined, 3);
  c.verdict(verdict(0, [13], 4, { streaming: true }));
  assert.equal(c.inFlight, 0);
  refuses(() => c.verdict(verdict(0, [14, 15], 6)), "BAD_MESSAGE", "tokens");
  c.verdict(verdict(0, [14], 5));
  assert.equal(c.inFlight, null);
});

// the sessions' server frames replayed into the client checks: every one passes, and the round in
// flight is the one the server verifies next
for (const name of ["a stream round started at once", "a waiting stream is the fallback for a miss",
                    "a matching pending tree ends the stream", "a prompt that streams", "a greedy round",
                    "a conditional tree is verified with no round trip"]) {  // prettier-ignore
  test(`session replayed into the checks: ${name}`, () => {
    const s = sessions.find((x: { name: string }) => x.name === name);
    assert.ok(s, name);
    let c: ClientChecks | null = null;
    for (const step of s.steps) {
      if (step.from === "client") {
        const m = decodeMessage(hex(step.hex));
        if (m.type === "prompt") c!.prompt(m.tokens, m.mode, m.max_new_tokens, m.tree, m.stream ?? 0);
        else if (m.type === "tree") c!.tree(m.round, m);
        else if (m.type === "stream") c!.stream(m.round);
      }
      for (const f of step.sent_hex) {
        const m = decodeMessage(hex(f));
        if (m.type === "welcome") c = new ClientChecks(m);
        else if (m.type === "verdict") c!.verdict(m);
        else if (m.type === "stale") c!.stale(m.round);
      }
      if (step.from === "server_app" && "verify_next" in step) assert.equal(c!.inFlight, step.verify_next, JSON.stringify(step.decoded));
    }
  });
}

// ------------------------------------------------------------------------------------ auto's plan
test("costAt interpolates a cost map and is flat outside it", () => {
  const m = { 0: 4, 1: 5, 8: 12 };
  assert.equal(costAt(m, 0), 4);
  assert.equal(costAt(m, 4), 8);
  assert.equal(costAt(m, 64), 12);
});

test("auto streams after a miss only where that is faster (latency) or cheaper within 1.25x of ar (cost)", () => {
  const base = { forward: { 0: 10, 1: 11, 8: 14 }, marginal: { 0: 10, 1: 10.5, 8: 12 }, nodes: 8, draftMs: 5, rttMs: 20, hitRate: 0.5 };
  // a tree yielding 3 tokens: (14 + 0.5 * 25) / 3 = 8.8 ms a token against 10 streaming: speculate
  assert.equal(choosePlan(DEFAULT_PLAN, { ...base, tokens: 3 }), "speculate");
  // 1.5 tokens a tree: 17.7 ms a token: stream
  assert.equal(choosePlan(DEFAULT_PLAN, { ...base, tokens: 1.5 }), "stream");
  const cost = { ...DEFAULT_PLAN, objective: "cost" as const };
  // cost: 3 tokens a tree costs the verifier 4 ms a token against 10 streaming, and is no slower: speculate
  assert.equal(choosePlan(cost, { ...base, tokens: 3 }), "speculate");
  // 1.1 tokens: 10.9 ms of the verifier a token, and slower than ar by more than 1.25x: stream
  assert.equal(choosePlan(cost, { ...base, tokens: 1.1 }), "stream");
});

test("splitAhead: the first-child path as the condition, the nodes below it as the tree", () => {
  const t = { base: 5, cond: [], tokens: [20, 21, 22, 23, 24], parents: [-1, 0, 0, 1, 3] };
  assert.deepEqual(splitAhead(t, 1), { cond: [20], tree: { base: 5, cond: [20], tokens: [21, 22, 23, 24], parents: [-1, -1, 0, 2] } });
  assert.deepEqual(splitAhead(t, 2), { cond: [20, 21], tree: { base: 5, cond: [20, 21], tokens: [23, 24], parents: [-1, 0] } });
  assert.equal(splitAhead(t, 4), null); // nothing below the path
  assert.equal(splitAhead({ base: 5, cond: [], tokens: [], parents: [] }, 1), null);
});
