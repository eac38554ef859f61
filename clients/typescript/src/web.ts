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
 * every other file is kept in Cache Storage under its URL, the manifest's fingerprint and its size,
 * so a re-exported folder is fetched again.
 */
export function webReader(base: string, o: WebReaderOptions = {}): WebReader {
  const root = new URL(base, globalThis.location?.href);
  const get = o.fetch ?? globalThis.fetch.bind(globalThis);
  const cacheName = o.cache === undefined ? "treespec-models" : o.cache;
  const storage = cacheName !== null && typeof caches !== "undefined" ? caches.open(cacheName) : null;
  const fetched: string[] = [];
  const cached: string[] = [];
  let sizes: Record<string, number> = {};
  let version = "";
  const url = (name: string) => new URL(encodeURIComponent(name), root).href;
  const key = (name: string) => `${url(name)}?v=${version}-${sizes[name] ?? 0}`;

  async function fromCache(name: string): Promise<Response | undefined> {
    if (!storage || !version) return undefined;
    return (await storage).match(key(name));
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
    if (storage && version) {
      const copy = new Response(data, { headers: { "content-type": "application/octet-stream" } });
      await (await storage).put(key(name), copy).catch(() => undefined); // a full quota only costs a refetch
    }
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
        const m = JSON.parse(body) as { files?: Record<string, number>; fingerprint?: string };
        sizes = m.files ?? {};
        version = String(m.fingerprint ?? "").slice(0, 16);
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
