// The first connection to a verifier at its session cap (close 1013 "try again later"): with resume,
// the client tries again with the backoff; without, ConnectionLost carries the close code.
import assert from "node:assert/strict";
import { test } from "node:test";
import { WebSocketServer } from "ws";
import { ConnectionLost, TreespecClient } from "../src/client.js";
import { decodeMessage, encodeMessage, PROTOCOL_VERSION } from "../src/protocol.js";

const FP = "ab".repeat(32);

/** A verifier that refuses the first `refusals` hellos with 1013, then welcomes. */
async function verifier(refusals: number): Promise<{ url: string; hellos: () => number; close: () => void }> {
  const wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
  await new Promise<void>((r) => wss.once("listening", () => r()));
  let hellos = 0;
  wss.on("connection", (ws) => {
    ws.on("message", (data: Buffer) => {
      const msg = decodeMessage(new Uint8Array(data));
      if (msg.type !== "hello") return;
      hellos++;
      if (hellos <= refusals) {
        ws.close(1013, "try again later (1 s): the server is at its limit of 1 sessions");
        return;
      }
      ws.send(encodeMessage({
        type: "welcome", version: PROTOCOL_VERSION, session_id: "1", model_id: "tiny", vocab_size: 1000,
        vocab_fingerprint: FP, eos_ids: [0], allowed_modes: ["greedy", "ar"],
        limits: { max_nodes: 8, max_depth: 4, max_pending: 2, max_bytes: 4096, max_context: 64 },
        verify_cost_ms: { "1": 3 },
      }));  // prettier-ignore
    });
  });
  const port = (wss.address() as { port: number }).port;
  return { url: `ws://127.0.0.1:${port}/v1/session`, hellos: () => hellos, close: () => wss.close() };
}

test("with resume, a verifier at its cap is tried again until it welcomes", async () => {
  const v = await verifier(2);
  try {
    const c = await TreespecClient.connect(v.url, FP, undefined, { resume: { backoffMs: 10, maxBackoffMs: 20 } });
    assert.equal(v.hellos(), 3);
    c.close();
  } finally {
    v.close();
  }
});

test("without resume, the refusal is ConnectionLost with close code 1013", async () => {
  const v = await verifier(1);
  try {
    await assert.rejects(TreespecClient.connect(v.url, FP, undefined, { resume: false }), (e: unknown) => {
      assert.ok(e instanceof ConnectionLost, String(e));
      assert.equal(e.closeCode, 1013);
      return true;
    });
    assert.equal(v.hellos(), 1);
  } finally {
    v.close();
  }
});
