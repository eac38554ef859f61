// webReader's Cache Storage, without a browser: a fake `caches` and a fake server. A file is kept
// under the manifest's checksum of it, so a re-export with the same vocabulary and the same file
// sizes (retrained weights) is fetched again, never served stale, and the stale copy is dropped.
import assert from "node:assert/strict";
import { test } from "node:test";
import { webReader } from "../src/web.js";

class FakeCache {
  readonly entries = new Map<string, Uint8Array<ArrayBuffer>>();
  async match(key: string): Promise<Response | undefined> {
    const data = this.entries.get(key);
    return data === undefined ? undefined : new Response(data);
  }
  async put(key: string, r: Response): Promise<void> {
    this.entries.set(key, new Uint8Array(await r.arrayBuffer()));
  }
  async keys(): Promise<Request[]> {
    return [...this.entries.keys()].map((k) => new Request(k));
  }
  async delete(r: Request): Promise<boolean> {
    return this.entries.delete(r.url);
  }
}

const BASE = "http://127.0.0.1:8080/edge/model/";
const FINGERPRINT = "ab".repeat(32);

function server(files: Record<string, Uint8Array<ArrayBuffer>>, checksums: Record<string, string>): typeof fetch {
  const manifest = JSON.stringify({
    format: 2,
    fingerprint: FINGERPRINT,
    files: Object.fromEntries(Object.entries(files).map(([n, d]) => [n, d.length])),
    checksums,
  });
  return (async (input: string | URL | Request) => {
    const name = decodeURIComponent(String(input).slice(BASE.length));
    if (name === "manifest.json") return new Response(manifest);
    const data = files[name];
    if (data === undefined) return new Response("", { status: 404 });
    return new Response(data, { headers: { "content-length": String(data.length) } });
  }) as typeof fetch;
}

test("a file changed with the same size and vocabulary is fetched again, not served from the cache", async () => {
  const cache = new FakeCache();
  const g = globalThis as { caches?: unknown };
  g.caches = { open: async () => cache };
  try {
    const v1 = new Uint8Array([1, 2, 3, 4]);
    const v2 = new Uint8Array([9, 9, 9, 9]); // retrained: same size, same vocabulary fingerprint
    const first = webReader(BASE, { fetch: server({ "model.onnx.data": v1 }, { "model.onnx.data": "xxh3_64:01" }) });
    await first.text("manifest.json");
    assert.deepEqual(await first.bytes("model.onnx.data"), v1);
    assert.deepEqual(first.fetched, ["manifest.json", "model.onnx.data"]);

    const again = webReader(BASE, { fetch: server({ "model.onnx.data": v1 }, { "model.onnx.data": "xxh3_64:01" }) });
    await again.text("manifest.json");
    assert.deepEqual(await again.bytes("model.onnx.data"), v1);
    assert.deepEqual(again.cached, ["model.onnx.data"]); // unchanged: from the cache

    const retrained = webReader(BASE, { fetch: server({ "model.onnx.data": v2 }, { "model.onnx.data": "xxh3_64:02" }) });
    await retrained.text("manifest.json");
    assert.equal(await retrained.size("model.onnx.data"), 4);
    assert.deepEqual(await retrained.bytes("model.onnx.data"), v2);
    assert.deepEqual(retrained.cached, []);
    assert.deepEqual(retrained.fetched, ["manifest.json", "model.onnx.data"]);
    assert.deepEqual([...cache.entries.keys()], [`${BASE}model.onnx.data?checksum=xxh3_64%3A02`]); // the stale copy is gone

    const unsummed = webReader(BASE, { fetch: server({ "tokens.json": v1 }, {}) });
    await unsummed.text("manifest.json");
    await unsummed.bytes("tokens.json");
    await unsummed.bytes("tokens.json");
    assert.deepEqual(unsummed.cached, []); // no checksum: never cached
    assert.equal(cache.entries.size, 1);
  } finally {
    delete g.caches;
  }
});
