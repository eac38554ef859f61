// The browser page of the edge (web/index.html): the draft model of an ONNX export runs in this tab on
// onnxruntime-web (WASM), and the verifier is reached over a WebSocket from the page. Settings come from
// config.json beside the page ({"server": "ws://…/v1/session", "model": "model/"}) and the query string:
//   ?prompt=TEXT  &raw=1  &prompt_ids=1,2,3  &max=N  &mode=greedy|match|ar  &temperature=T  &seed=S
//   &autorun=1  &server=WS_URL  &model=URL  &tree=1,1,3,1 (the expansion tree drafted each round)
//   &prespec=1 (pre-speculate each round's likeliest outcome)
//   &background=0 (wait for the draft model before the first round; by default the page connects, starts at
//   once with the target's own tokens and drafts from the round after the model is loaded)
// For tests and tools the page keeps its state in `window.treespec` (ready, done, tokens, text, stats,
// error, fetched, cached, loadMs: ms until the draft model was loaded, firstTokenMs: ms from the run's start
// to its first token, firstTokenPageMs: ms from the page's navigation to that token).
import * as ort from "onnxruntime-web/wasm";
import { Edge } from "./edge.js";
import type { OrtLike } from "./onnx_drafter.js";
import type { VerdictInfo } from "./client.js";
import { webReader } from "./web.js";

interface PageState {
  ready: boolean;
  done: boolean;
  tokens: number[];
  text: string;
  stats: Record<string, number | string>;
  error: string | null;
  fetched: string[];
  cached: string[];
  loadMs: number;
  firstTokenMs: number;
  firstTokenPageMs: number;
}

const state: PageState = {
  ready: false, done: false, tokens: [], text: "", stats: {}, error: null, fetched: [], cached: [], loadMs: 0,
  firstTokenMs: 0, firstTokenPageMs: 0,
};  // prettier-ignore
(globalThis as unknown as { treespec: PageState }).treespec = state;

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const query = new URLSearchParams(location.search);

function fail(e: unknown): void {
  state.error = e instanceof Error ? e.message : String(e);
  const s = $("status");
  s.textContent = state.error;
  s.className = "error";
  state.done = true;
  $("out").dataset.done = "1";
}

async function config(): Promise<{ server: string; model: string }> {
  let doc: { server?: string; model?: string } = {};
  const r = await fetch("config.json", { cache: "no-cache" });
  if (r.ok) doc = (await r.json()) as typeof doc;
  const server = query.get("server") ?? doc.server;
  if (!server) throw new Error("no verifier URL: give ?server=ws://HOST:PORT/v1/session or a config.json");
  return { server, model: query.get("model") ?? doc.model ?? "model/" };
}

async function load(): Promise<Edge> {
  const t0 = performance.now();
  const { server, model } = await config();
  ort.env.wasm.wasmPaths = new URL("ort/", location.href).href; // from this origin, never a CDN
  ort.env.wasm.numThreads = 1; // the edge drafts on one core (threads would need cross-origin isolation)
  const reader = webReader(model);
  const tree = query.get("tree")?.split(",").map(Number);
  if (tree && !tree.every((k) => Number.isInteger(k) && k >= 1)) throw new Error(`?tree=${query.get("tree")}: give positive integers`);
  const where = new URL(model, location.href).href;
  const background = query.get("background") !== "0";
  const edge = await Edge.open(server, reader, ort as unknown as OrtLike, { where, tree, background });
  const verifier = `verifier ${edge.client.welcome.model_id} at ${server}`;
  const loaded = () => {
    state.fetched = reader.fetched;
    state.cached = reader.cached;
    state.loadMs = performance.now() - t0;
    const from = reader.cached.length && !reader.fetched.some((f) => f !== "manifest.json") ? "the browser's cache" : "the network";
    $("status").textContent =
      `draft model ${edge.manifest.source} loaded from ${from} in ${(state.loadMs / 1000).toFixed(1)} s; ${verifier}`;
  };  // prettier-ignore
  if (edge.drafting) loaded();
  else {
    $("status").textContent = `${verifier}; loading the draft model ${edge.manifest.source} (the target answers meanwhile)`;
    edge.ready.then(loaded, fail);
  }
  return edge;
}

function mark(v: VerdictInfo, i: number, mode: string): string {
  if (mode === "ar" || v.cloudOnly) return "target";
  if (i < v.accepted) return i < 8 ? `d${i + 1}` : "deep";
  return "bonus";
}

async function run(edge: Edge): Promise<void> {
  const out = $("out");
  out.textContent = "";
  delete out.dataset.done;
  Object.assign(state, { done: false, tokens: [], text: "", error: null, firstTokenMs: 0, firstTokenPageMs: 0 });
  const mode = $<HTMLSelectElement>("mode").value as "greedy" | "match" | "ar";
  const ids = query.get("prompt_ids");
  const prompt = ids ? ids.split(",").map(Number) : $<HTMLTextAreaElement>("prompt").value;
  const show = edge.codec.stream();
  const abort = new AbortController();
  $("stop").onclick = () => abort.abort();
  ($("stop") as HTMLButtonElement).disabled = false;
  ($("run") as HTMLButtonElement).disabled = true;
  const t0 = performance.now();
  const onVerdict = (v: VerdictInfo) => {
    if (v.tokens.length && !state.firstTokenMs) {
      state.firstTokenMs = performance.now() - t0;
      state.firstTokenPageMs = performance.now(); // from the navigation (performance's time origin)
    }
    v.tokens.forEach((t, i) => {
      const span = document.createElement("span");
      span.textContent = show([t]);
      span.className = mark(v, i, mode);
      if (v.prespeculated) span.classList.add("hit");
      out.append(span);
    });
    state.tokens.push(...v.tokens);
  };
  try {
    const opts = {
      mode, onVerdict, signal: abort.signal, raw: query.get("raw") === "1",
      maxNewTokens: Number($<HTMLInputElement>("max").value),
      temperature: Number($<HTMLInputElement>("temperature").value),
      seed: BigInt($<HTMLInputElement>("seed").value),
      prespec: $<HTMLInputElement>("prespec").checked,
    };  // prettier-ignore
    for await (const _ of edge.generate(prompt, opts)) {
      // the spans are written per verdict (onVerdict); the text chunks are the same text
    }
  } catch (e) {
    if (!(e instanceof DOMException && e.name === "AbortError")) fail(e);
  } finally {
    ($("stop") as HTMLButtonElement).disabled = true;
    ($("run") as HTMLButtonElement).disabled = false;
  }
  const st = edge.last;
  state.text = edge.codec.decode(state.tokens);
  state.stats = { ...st };
  $("stats").textContent =
    `τ ${st.tau.toFixed(2)} tokens a round · ${st.rounds} rounds · ${st.tokens} tokens · ` +
    `${st.msPerToken.toFixed(0)} ms/token · drafting ${st.draftMs.toFixed(0)} ms a round (median) · ` +
    (st.cloudRounds ? `${st.cloudRounds} rounds of the target's own while the draft model loaded · ` : "") +
    `first token ${state.firstTokenMs.toFixed(0)} ms · ` +
    ($<HTMLInputElement>("prespec").checked ? `pre-speculation hit rate ${st.hitRate.toFixed(2)}` : "no pre-speculation");
  state.done = true;
  out.dataset.done = "1";
}

async function main(): Promise<void> {
  const p = query.get("prompt");
  if (p !== null) $<HTMLTextAreaElement>("prompt").value = p;
  for (const id of ["mode", "max", "temperature", "seed"]) {
    const v = query.get(id);
    if (v !== null) $<HTMLInputElement>(id).value = v;
  }
  if (query.get("prespec") !== null) $<HTMLInputElement>("prespec").checked = query.get("prespec") === "1";
  let edge: Edge;
  try {
    edge = await load();
  } catch (e) {
    fail(e);
    return;
  }
  state.ready = true;
  const button = $("run") as HTMLButtonElement;
  button.disabled = false;
  button.onclick = () => void run(edge);
  if (query.get("autorun") === "1") await run(edge);
}

void main();
