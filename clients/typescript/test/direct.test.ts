// A session moved to its verifier's own address (welcome.direct): the client opens it, names the
// session's resume token in its hello and carries on there, the first socket open and idle; an
// address it cannot reach, or a session of its own there, keeps the session where it is.
import assert from "node:assert/strict";
import { test } from "node:test";
import { WebSocketServer, type WebSocket } from "ws";
import { mayMove, TreespecClient } from "../src/client.js";
import { decodeMessage, encodeMessage, type Message, PROTOCOL_VERSION } from "../src/protocol.js";

const FP = "ab".repeat(32);

type Hello = Extract<Message, { type: "hello" }>;

const welcome = (session: string, direct?: string): Message => ({
  type: "welcome", version: PROTOCOL_VERSION, session_id: session, model_id: "tiny", vocab_size: 1000,
  vocab_fingerprint: FP, eos_ids: [0], allowed_modes: ["greedy", "ar"],
  limits: { max_nodes: 8, max_depth: 4, max_pending: 2, max_bytes: 4096, max_context: 64 },
  verify_cost_ms: { "1": 3 }, resume: "r.tok", ...(direct ? { direct } : {}),
});  // prettier-ignore

/**
 * One server for both addresses: a hello on /v1/session is welcomed with the offer `direct`
 * (its path /own), a hello on /own with the session `ownSession` names.
 */
async function verifier(ownSession: string, direct?: (port: number) => string) {
  const wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
  await new Promise<void>((r) => wss.once("listening", () => r()));
  const port = (wss.address() as { port: number }).port;
  const hellos: { path: string; hello: Hello; ws: WebSocket }[] = [];
  wss.on("connection", (ws, req) => {
    ws.on("message", (data: Buffer) => {
      const msg = decodeMessage(new Uint8Array(data));
      if (msg.type !== "hello") return;
      const path = req.url ?? "";
      hellos.push({ path, hello: msg, ws });
      const offer = direct ? direct(port) : `ws://127.0.0.1:${port}/own`;
      ws.send(encodeMessage(path === "/own" ? welcome(ownSession, offer) : welcome("7", offer)));
    });
  });
  return { url: `ws://127.0.0.1:${port}/v1/session`, hellos, close: () => wss.close() };
}

test("the session moves to the offered address by its resume token; the first socket stays open", async () => {
  const v = await verifier("7");
  try {
    const c = await TreespecClient.connect(v.url, FP, undefined, { resume: false });
    assert.equal(c.moves, 1);
    assert.deepEqual(v.hellos.map((h) => h.path), ["/v1/session", "/own"]);
    assert.equal(v.hellos[1].hello.resume, "r.tok");
    assert.ok(v.hellos[1].hello.features?.includes("session.direct"));
    assert.equal(v.hellos[0].ws.readyState, 1); // open, idle
    c.close();
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(v.hellos[0].ws.readyState, 3); // closed with the session
  } finally {
    v.close();
  }
});

test("a session of its own at the address, or an address that refuses, keeps the session where it is", async () => {
  const other = await verifier("8"); // the offer was gone: welcomed as another session
  const refused = await verifier("7", () => "ws://127.0.0.1:9/own"); // nothing listens there
  try {
    for (const v of [other, refused]) {
      const c = await TreespecClient.connect(v.url, FP, undefined, { resume: false });
      assert.equal(c.moves, 0);
      assert.equal(c.welcome.session_id, "7");
      assert.equal(v.hellos[0].ws.readyState, 1); // the first socket carries the session
      c.close();
    }
    assert.deepEqual(other.hellos.map((h) => h.path), ["/v1/session", "/own"]);
    assert.equal(refused.hellos.length, 1);
  } finally {
    other.close();
    refused.close();
  }
});

test("a session over wss:// never moves to a ws:// address", () => {
  assert.equal(mayMove("wss://fleet/v1/session", "ws://10.0.0.2:9000/v1/session"), false);
  assert.equal(mayMove("wss://fleet/v1/session", "wss://10.0.0.2:9000/v1/session"), true);
  assert.equal(mayMove("ws://fleet/v1/session", "ws://10.0.0.2:9000/v1/session"), true);
  assert.equal(mayMove("ws://fleet/v1/session", "ws://fleet/v1/session"), false);
});
