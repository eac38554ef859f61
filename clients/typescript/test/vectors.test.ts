// The TypeScript codec against the protocol's test vectors (tests/vectors, PROTOCOL.md section 11).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { decodeMessage, encodeMessage, ProtocolError } from "../src/protocol.js";

const dir = fileURLToPath(new URL("../../../../tests/vectors/", import.meta.url));
const frames = JSON.parse(readFileSync(dir + "frames.json", "utf8"));
const sessions = JSON.parse(readFileSync(dir + "sessions.json", "utf8"));
const hex = (s: string) => Uint8Array.from(Buffer.from(s, "hex"));
const toHex = (b: Uint8Array) => Buffer.from(b).toString("hex");
const MAX_BYTES = 4096; // the vectors' session limits

for (const v of frames) {
  test(`frame: ${v.name}`, () => {
    if (v.valid) {
      const msg = decodeMessage(hex(v.hex), MAX_BYTES);
      assert.equal(msg.type, v.decoded.type);
      assert.equal(toHex(encodeMessage(msg)), v.hex); // the same bytes as the Python encoder
    } else {
      assert.throws(
        () => decodeMessage(hex(v.hex), MAX_BYTES),
        (e: unknown) => {
          assert.ok(e instanceof ProtocolError, String(e));
          assert.deepEqual({ code: e.code, field: e.field, fatal: e.fatal }, v.error);
          return true;
        },
      );
    }
  });
}

for (const s of sessions) {
  test(`session: ${s.name}`, () => {
    for (const step of s.steps) {
      // our encoder writes the client's frames byte for byte, and we read every server frame
      const msg = decodeMessage(hex(step.hex));
      assert.equal(toHex(encodeMessage(msg)), step.hex);
      for (const f of step.sent_hex) assert.equal(toHex(encodeMessage(decodeMessage(hex(f)))), f);
    }
  });
}

test("enough vectors", () => {
  assert.ok(frames.length >= 35 && sessions.length >= 8);
});
