// The edge in a browser: an export folder read over HTTP from the page's own origin, each file
// fetched once and kept in the browser's Cache Storage (so the next visit loads the draft model
// without the network), for OnnxDrafter.load / Edge.open with onnxruntime-web's module.
//
//   import * as ort from "onnxruntime-web";
//   ort.env.wasm.wasmPaths = "/edge/ort/";     // the runtime's .wasm served from your origin, never a CDN
//   const edge = await Edge.open("wss://verifier.example/v1/session", webReader("/edge/model/"), ort);
import { ExportError, type ExportReader } from "./onnx_drafter.js";

export interface WebReaderOptions {
  cache?: string | null; // the Cache Storage name (default "treespec-models"; null: no cache)
  fetch?: typeof fetch;
}

/** An ExportReader over `base` (a URL ending in "/"), with what it fetched and what came from the cache. */
export interface WebReader extends ExportReader {
  readonly fetched: string[]; // files read over the network
  readonly cached: string[]; // files read from the browser's cache
}

/**
 * Read an export folder served at `base`. manifest.json is always asked of the server (no-cache);
 * every other file is kept in Cache Storage under its URL and the manifest's checksum of it, so a
 * file that changed (a re-export, retrained weights of the same sizes) is fetched again, and the
 * copies kept under its URL's earlier checksums are dropped. A file the manifest gives no checksum
 * is never cached.
 */
export function webReader(base: string, o: WebReaderOptions = {}): WebReader {
  const root = new URL(base, globalThis.location?.href);
  const get = o.fetch ?? globalThis.fetch.bind(globalThis);
  const cacheName = o.cache === undefined ? "treespec-models" : o.cache;
  const storage = cacheName !== null && typeof caches !== "undefined" ? caches.open(cacheName) : null;
  const fetched: string[] = [];
  const cached: string[] = [];
  let sizes: Record<string, number> = {};
  let checksums: Record<string, string> = {};
  const url = (name: string) => new URL(encodeURIComponent(name), root).href;
  // null: not cached (no checksum for it in the manifest)
  const key = (name: string) => {
    const sum = checksums[name];
    return typeof sum === "string" && sum ? `${url(name)}?checksum=${encodeURIComponent(sum)}` : null;
  };

  async function fromCache(name: string): Promise<Response | undefined> {
    const k = key(name);
    if (!storage || k === null) return undefined;
    return (await storage).match(k);
  }

  async function keep(name: string, data: Uint8Array<ArrayBuffer>): Promise<void> {
    const k = key(name);
    if (!storage || k === null) return;
    const cache = await storage;
    for (const old of await cache.keys()) {
      if (old.url !== k && old.url.split("?")[0] === url(name)) await cache.delete(old); // an earlier export's
    }
    const copy = new Response(data, { headers: { "content-type": "application/octet-stream" } });
    await cache.put(k, copy);
  }

  async function fetchOk(name: string, init?: RequestInit): Promise<Response> {
    let r: Response;
    try {
      r = await get(url(name), init);
    } catch (e) {
      throw new ExportError(`cannot fetch ${url(name)}: ${(e as Error).message}`);
    }
    if (!r.ok) throw new ExportError(`${url(name)}: HTTP ${r.status} (is the export folder served there?)`);
    return r;
  }

  async function bytes(name: string): Promise<Uint8Array> {
    const hit = await fromCache(name);
    if (hit) {
      cached.push(name);
      return new Uint8Array(await hit.arrayBuffer());
    }
    const r = await fetchOk(name);
    const data = new Uint8Array(await r.arrayBuffer());
    fetched.push(name);
    await keep(name, data).catch(() => undefined); // a full quota only costs a refetch
    return data;
  }

  return {
    fetched,
    cached,
    async text(name) {
      if (name !== "manifest.json") return new TextDecoder().decode(await bytes(name));
      const r = await fetchOk(name, { cache: "no-cache" });
      const body = await r.text();
      fetched.push(name);
      try {
        const m = JSON.parse(body) as { files?: Record<string, number>; checksums?: Record<string, string> };
        sizes = m.files ?? {};
        checksums = m.checksums ?? {};
      } catch {
        // readManifest names what is wrong with it
      }
      return body;
    },
    async size(name) {
      if (await fromCache(name)) return sizes[name] ?? null;
      let r: Response;
      try {
        r = await get(url(name), { method: "HEAD", cache: "no-cache" });
      } catch (e) {
        throw new ExportError(`cannot fetch ${url(name)}: ${(e as Error).message}`);
      }
      if (r.status === 404) return null;
      if (!r.ok) throw new ExportError(`${url(name)}: HTTP ${r.status}`);
      const n = r.headers.get("content-length");
      return n === null ? null : Number(n);
    },
    bytes,
  };
}
