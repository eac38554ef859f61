// Stream rounds in the TypeScript client (PROTOCOL.md `stream`): the new frames as the vectors state
// them, the client checks of streaming verdicts (shared/client_protocol.py), the sessions' server
// frames replayed into the checks, and mode auto's pricing.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { ClientChecks, reroot, rerootPath } from "../src/checks.js";
import { choosePlan, costAt, DEFAULT_PLAN, measuredSlower, Realized } from "../src/client.js";
import { decodeMessage, encodeMessage, type Message, ProtocolError, type Tree } from "../src/protocol.js";

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

// the sessions' server frames replayed into the client checks: every one passes, the round in
// flight is the one the server verifies next, and where the server verifies a tree re-rooted below
// the committed sequence (verify_tree) the client computes the same tree
const REROOTING = [
  "a tree sent during a stream is re-rooted below the streamed token",
  "a conditional tree for a shorter outcome is re-rooted after a longer accept",
  "a pending tree stays pending while it may re-root; another goes stale at a leaf",
  "a tree that arrives after the stream ended is re-rooted at once",
  "a tree of depth 1 sent during a stream is stale at once",
];
for (const name of ["a stream round started at once", "a waiting stream is the fallback for a miss",
                    "a matching pending tree ends the stream", "a prompt that streams", "a greedy round",
                    "a conditional tree is verified with no round trip", ...REROOTING]) {  // prettier-ignore
  test(`session replayed into the checks: ${name}`, () => {
    const s = sessions.find((x: { name: string }) => x.name === name);
    assert.ok(s, name);
    let c: ClientChecks | null = null;
    let rerooted = 0;
    for (const step of s.steps) {
      if (step.from === "client") {
        const m = decodeMessage(hex(step.hex));
        if (m.type === "prompt") c!.prompt(m.tokens, m.mode, m.max_new_tokens, m.tree, m.stream ?? 0);
        else if (m.type === "tree") c!.tree(m.round, m);
        else if (m.type === "stream") c!.stream(m.round);
        // a round the server verifies on arrival is the one in flight
        if ((m.type === "tree" || m.type === "stream") && step.events.includes("VerifyTree")) assert.equal(c!.inFlight, m.round);
      }
      for (const f of step.sent_hex) {
        const m = decodeMessage(hex(f));
        if (m.type === "welcome") c = new ClientChecks(m);
        else if (m.type === "verdict") c!.verdict(m);
        else if (m.type === "stale") c!.stale(m.round);
      }
      if (step.from === "server_app" && "verify_next" in step) assert.equal(c!.inFlight, step.verify_next, JSON.stringify(step.decoded));
      if ("verify_tree" in step) {
        const t: Tree | null = c!.verifying();
        assert.ok(t !== null, "a tree in flight");
        assert.deepEqual({ base: t.base, cond: t.cond, tokens: t.tokens, parents: t.parents }, step.verify_tree);
        rerooted++;
      }
    }
    if (REROOTING.slice(0, 4).includes(name)) assert.ok(rerooted > 0, "the session re-roots a tree");
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

test("the user's clock overrules the prices only past the margin and on enough verdicts", () => {
  const r = new Realized();
  for (let i = 0; i < 3; i++) {
    r.observe("stream", 1, 50);
    r.observe("chain", 1, 90);
  }
  assert.equal(r.slower(0.05), false); // three verdicts a side: not enough
  r.observe("stream", 1, 50);
  r.observe("chain", 2, 180);
  assert.equal(r.slower(0.05), true); // 90 ms a token against 50
  assert.equal(r.slower(0.05, ["prespec"]), false); // nothing of that kind measured
  for (let i = 0; i < 20; i++) r.observe("prespec", 3, 120); // 40 ms a token
  assert.equal(r.slower(0.05, ["prespec"]), false);
  assert.equal(measuredSlower(DEFAULT_PLAN, r, ["chain", "tree"]), true);
  // cost allows 1.25x: 90 against 50 is still too slow; within 1.25x it is not
  assert.equal(measuredSlower({ ...DEFAULT_PLAN, objective: "cost" }, r, ["chain"]), true);
  const q = new Realized();
  for (let i = 0; i < 10; i++) {
    q.observe("stream", 1, 50);
    q.observe("chain", 1, 60);
  }
  assert.equal(measuredSlower(DEFAULT_PLAN, q), true);
  assert.equal(measuredSlower({ ...DEFAULT_PLAN, objective: "cost" }, q), false);
});

// ------------------------------------------------------------------------------------ re-rooting
//        row 0 (S = [1, 2, 3])
//       /        \
//     4 (0)      9 (1)
//    /    \         \
//  5 (2)  6 (3)     7 (4)
//  |
//  8 (5)
const TREE = { base: 3, cond: [] as number[], tokens: [4, 9, 5, 6, 7, 8], parents: [-1, -1, 0, 0, 1, 2] };

test("reroot keeps the subtree below the committed tokens with their positions (shared.tree.reroot)", () => {
  const same = reroot(TREE, [1, 2, 3]);
  assert.ok(same !== null && same.tree === TREE);
  assert.deepEqual(same.index, [0, 1, 2, 3, 4, 5]);
  assert.deepEqual(reroot(TREE, [1, 2, 3, 4]), { tree: { base: 3, cond: [4], tokens: [5, 6, 8], parents: [-1, -1, 0] }, index: [2, 3, 5] });
  assert.deepEqual(reroot(TREE, [1, 2, 3, 4, 5]), { tree: { base: 3, cond: [4, 5], tokens: [8], parents: [-1] }, index: [5] });
  assert.equal(rerootPath(TREE, [1, 2, 3, 4, 5]), 2);
  assert.equal(reroot(TREE, [1, 2, 3, 4, 6]), null); // the path ends at a leaf: nothing to verify
  assert.equal(reroot(TREE, [1, 2, 3, 7]), null); // no node spells the token
  assert.equal(reroot(TREE, [1, 2]), null); // S is shorter than the tree's assumption
  const assumed = { base: 2, cond: [3], tokens: [4, 5], parents: [-1, 0] };
  assert.equal(reroot(assumed, [1, 2, 7, 4]), null); // the sequence contradicts its cond
  assert.deepEqual(reroot(assumed, [1, 2, 3, 4])?.tree, { base: 2, cond: [3, 4], tokens: [5], parents: [-1] });
  // two children with the same token: the first in node order is the path
  const twins = { base: 1, cond: [], tokens: [7, 7, 8, 9], parents: [-1, -1, 1, 0] };
  assert.deepEqual(reroot(twins, [0, 7])?.index, [3]);
  // a stochastic tree is never re-rooted (it is still itself where it matches as sent)
  const draws = { node: [0], drafter: [0], qrow: [0], q_ptr: [0, 1], q_ids: [4], q_wm1: [65535] };
  const stochastic = { base: 3, cond: [], tokens: [4, 5], parents: [-1, 0], draws };
  assert.equal(reroot(stochastic, [1, 2, 3, 4]), null);
  assert.equal(reroot(stochastic, [1, 2, 3])?.tree, stochastic);
});

/** A generation on [1, 2] whose prompt's verdict committed 3 (S = [1, 2, 3]). */
function at3(mode = "greedy"): ClientChecks {
  const c = new ClientChecks(WELCOME);
  c.prompt([1, 2], mode, 16);
  c.verdict(verdict(0, [3], 3));
  return c;
}

test("a tree sent during a stream is in flight re-rooted below the streamed token, and its verdict indexes the subtree", () => {
  const c = at3();
  c.stream(1);
  c.tree(2, TREE); // drafted below S = [1, 2, 3] while the target decodes the token after 3
  assert.equal(c.inFlight, 1);
  assert.equal(c.matchingOutstanding(), 2); // it matches as sent (the stream is in flight)
  c.verdict(verdict(1, [4], 4, { next_round: 2 }));
  assert.equal(c.inFlight, 2);
  assert.deepEqual(c.verifying(), { base: 3, cond: [4], tokens: [5, 6, 8], parents: [-1, -1, 0] });
  // the accepted nodes index the re-rooted tree: 5 -> 8 is [0, 2], then the bonus
  c.verdict({ ...verdict(2, [5, 8, 11], 7), accepted_nodes: [0, 2] });
  assert.deepEqual(c.committed, [1, 2, 3, 4, 5, 8, 11]);
  assert.equal(c.inFlight, null);
});

test("the checks refuse accepted nodes of the tree as sent where the server re-rooted it", () => {
  const sent = () => {
    const c = at3();
    c.stream(1);
    c.tree(2, TREE);
    c.verdict(verdict(1, [4], 4, { next_round: 2 }));
    return c;
  };
  // [2, 5] are 5 -> 8 in the tree as sent: out of the re-rooted tree of 3 nodes
  refuses(() => sent().verdict({ ...verdict(2, [5, 8, 11], 7), accepted_nodes: [2, 5] }), "BAD_MESSAGE", "accepted_nodes");
  // [1] is 6 in the subtree, but not the token 5
  refuses(() => sent().verdict({ ...verdict(2, [5, 11], 6), accepted_nodes: [1] }), "BAD_MESSAGE", "tokens");
  // [2] (8) is not a child of row 0 in the subtree
  refuses(() => sent().verdict({ ...verdict(2, [8, 11], 6), accepted_nodes: [2] }), "BAD_MESSAGE", "accepted_nodes");
  // a tree the sequence contradicts cannot be the round verified
  const c = at3();
  c.stream(1);
  c.tree(2, TREE);
  c.verdict(verdict(1, [7], 4));
  assert.equal(c.inFlight, null);
  refuses(() => c.verdict(verdict(2, [5], 5)), "BAD_ORDER", "round");
});

test("a conditional tree for a shorter outcome is re-rooted after a longer accept", () => {
  const c = at3();
  c.tree(1, { base: 3, cond: [], tokens: [4, 5, 6], parents: [-1, 0, 1] });
  c.tree(2, { base: 3, cond: [4, 5], tokens: [6, 7, 8], parents: [-1, 0, 1] }); // for "4 accepted, bonus 5"
  c.verdict({ ...verdict(1, [4, 5, 6, 7], 7), accepted_nodes: [0, 1, 2] });
  assert.equal(c.inFlight, 2); // matchingOutstanding: it re-roots below 6 7
  assert.deepEqual(c.verifying(), { base: 3, cond: [4, 5, 6, 7], tokens: [8], parents: [-1] });
  c.verdict({ ...verdict(2, [8, 9], 9), accepted_nodes: [0] });
  assert.equal(c.committed.length, 9);
});

test("a tree sent with nothing in flight is in flight at once where it re-roots on the committed sequence", () => {
  const c = at3();
  c.stream(1);
  c.verdict(verdict(1, [9], 4)); // the stream ended (k reached): nothing in flight, S = [1, 2, 3, 9]
  assert.equal(c.inFlight, null);
  c.tree(2, TREE); // drafted below [1, 2, 3]: it re-roots below 9, the node 7
  assert.equal(c.inFlight, 2);
  assert.deepEqual(c.verifying(), { base: 3, cond: [9], tokens: [7], parents: [-1] });
  c.verdict({ ...verdict(2, [7, 12], 6), accepted_nodes: [0] });
  c.tree(3, TREE); // S has grown past the leaf 7: nothing to verify
  assert.equal(c.inFlight, null);
  assert.equal(c.matchingOutstanding(), null);
});

test("an earlier tree that stayed pending while a later one was verified is verified after it, re-rooted", () => {
  const c = at3();
  c.stream(1);
  c.tree(2, { base: 3, cond: [], tokens: [4, 5, 6, 7], parents: [-1, 0, 1, 2] });
  c.tree(3, { base: 3, cond: [], tokens: [4, 5], parents: [-1, 0] });
  c.verdict(verdict(1, [4], 4, { next_round: 3 })); // the server takes the latest; tree 2 may still re-root
  c.verdict({ ...verdict(3, [5, 6], 6), accepted_nodes: [0], next_round: 2 });
  assert.equal(c.inFlight, 2);
  assert.deepEqual(c.verifying(), { base: 3, cond: [4, 5, 6], tokens: [7], parents: [-1] });
  c.verdict({ ...verdict(2, [7, 8], 8), accepted_nodes: [0] });
  assert.deepEqual(c.committed, [1, 2, 3, 4, 5, 6, 7, 8]);
  // but not a verdict for an earlier round the client does not know in flight
  const d = at3();
  d.tree(1, { base: 3, cond: [], tokens: [4], parents: [-1] });
  d.tree(2, { base: 3, cond: [4, 5], tokens: [6], parents: [-1] });
  d.tree(3, { base: 3, cond: [4], tokens: [5], parents: [-1] });
  d.verdict({ ...verdict(1, [4], 4), accepted_nodes: [0], has_bonus: false, next_round: 3 });
  d.verdict({ ...verdict(3, [9], 5), next_round: undefined });
  refuses(() => d.verdict(verdict(2, [6], 6)), "BAD_ORDER", "round");
});

test("only greedy and match re-root: a tree that does not match as sent is never in flight in other modes", () => {
  for (const [mode, want] of [["greedy", 2], ["match", 2], ["mss", null], ["rrs", null]] as const) {
    const c = at3(mode);
    c.stream(1);
    c.tree(2, TREE);
    c.verdict(verdict(1, [4], 4));
    assert.equal(c.inFlight, want, mode);
    assert.equal(c.matchingOutstanding(), want, mode);
  }
});
