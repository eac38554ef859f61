// A draft model exported by `edge-client export-onnx`, run by ONNX Runtime (onnxruntime-node in
// Node; the same code takes onnxruntime-web's module in a browser). It mirrors the Python
// OnnxDrafter (edge_client/drafters/onnx_drafter.py): one session run evaluates n new rows against a
// KV cache this class keeps ([rows, layers, kv_heads, head_dim], row-major), so the committed
// sequence is evaluated once across rounds and one tree level is one run.
//
// Graph inputs / outputs (edge_client/onnx/graph.py):
//   input_ids int64 [n], position_ids int64 [n], attention_mask float32 [n, P + n] (additive),
//   logit_rows int64 [k], past_key / past_value float32 [P, layers, kv_heads, head_dim]
//   -> logits float32 [k, vocab], present_key / present_value float32 [n, layers, kv_heads, head_dim]

import { type Coupling, coupledToken } from "./coupling.js";
import type { Tree } from "./protocol.js";

export const EXPORT_FORMAT = 2; // edge_client/onnx/export.py FORMAT (2: every file's checksum)
const MASKED = -3.4028234663852886e38; // float32's lowest: "do not attend"
const CHUNK = 256; // committed tokens per run when a sync evaluates a long tail

/** What an export folder's manifest.json says (the fields this client reads). */
export interface Manifest {
  format: number;
  source: string;
  vocab_size: number;
  fingerprint: string;
  int8: boolean;
  int8_layout: string | null;
  num_layers: number;
  num_kv_heads: number;
  head_dim: number;
  bos_id: number | null;
  eos_ids: number[];
  chat_template: string | null;
  files: Record<string, number>;
  checksums: Record<string, string>; // file name -> "xxh3_64:<16 hex digits>" (keys the browser's cache)
  opset: number;
}

/** An export folder that is missing, damaged or not what was asked; the message says what to do. */
export class ExportError extends Error {}

/** How the drafter reads its folder: Node's fs by default, fetch() in a browser. */
export interface ExportReader {
  text(name: string): Promise<string>;
  size(name: string): Promise<number | null>; // null: missing
  bytes(name: string): Promise<Uint8Array>;
  path?(name: string): string; // a file path the runtime can open itself (Node)
}

/** The subset of onnxruntime-common the drafter uses (so node and web runtimes both fit). */
export interface OrtLike {
  Tensor: new (type: "float32" | "int64", data: Float32Array | BigInt64Array, dims: readonly number[]) => OrtTensor;
  InferenceSession: { create(model: string | Uint8Array, options?: Record<string, unknown>): Promise<OrtSession> };
}
export interface OrtTensor {
  readonly data: unknown;
  readonly dims: readonly number[];
}
export interface OrtSession {
  readonly inputNames: readonly string[];
  readonly outputNames: readonly string[];
  run(feeds: Record<string, OrtTensor>): Promise<Record<string, OrtTensor>>;
}

const NUMBER_FIELDS = ["format", "vocab_size", "num_layers", "num_kv_heads", "head_dim", "opset"] as const;

/** Read and check manifest.json and the sizes of the files it lists. */
export async function readManifest(reader: ExportReader, where: string): Promise<Manifest> {
  let raw: unknown;
  try {
    raw = JSON.parse(await reader.text("manifest.json"));
  } catch (e) {
    throw new ExportError(
      `${where} is not an ONNX export (no readable manifest.json: ${(e as Error).message}); make one with ` +
        "`edge-client export-onnx --draft ALIAS --out DIR`",
    );
  }
  const m = raw as Partial<Manifest>;
  if (m.format !== EXPORT_FORMAT) {
    throw new ExportError(`${where}: export format ${String(m.format)}, this client reads ${EXPORT_FORMAT}; re-export`);
  }
  for (const f of NUMBER_FIELDS) {
    if (!Number.isInteger(m[f]) || (m[f] as number) < 1) throw new ExportError(`${where}/manifest.json: bad or missing ${f}`);
  }
  if (typeof m.fingerprint !== "string" || !/^[0-9a-f]{64}$/.test(m.fingerprint)) {
    throw new ExportError(`${where}/manifest.json: bad or missing fingerprint`);
  }
  if (typeof m.files !== "object" || m.files === null || !("model.onnx" in m.files)) {
    throw new ExportError(`${where}/manifest.json: no files list with model.onnx`);
  }
  for (const [name, size] of Object.entries(m.files)) {
    const got = await reader.size(name);
    if (got !== size) {
      throw new ExportError(
        `${where}/${name}: ${got === null ? "missing" : `${got} bytes`}, the manifest says ${size} bytes ` +
          "(an interrupted copy?); re-export the folder",
      );
    }
  }
  const sums = (m.checksums ?? {}) as Record<string, unknown>;
  for (const name of Object.keys(m.files)) {
    if (typeof sums[name] !== "string") throw new ExportError(`${where}/manifest.json: no checksum for ${name}; re-export`);
  }
  return { eos_ids: [], bos_id: null, chat_template: null, int8_layout: null, source: "", ...m } as Manifest;
}

/** Node's file system as an ExportReader. */
export async function folderReader(folder: string): Promise<ExportReader> {
  const fs = await import("node:fs/promises");
  const path = await import("node:path");
  const at = (name: string) => path.join(folder, name);
  return {
    text: (name) => fs.readFile(at(name), "utf8"),
    size: async (name) => {
      try {
        return (await fs.stat(at(name))).size;
      } catch {
        return null;
      }
    },
    bytes: async (name) => new Uint8Array(await fs.readFile(at(name))),
    path: at,
  };
}

export interface DrafterOptions {
  maxContext?: number; // committed tokens at most (default 4096)
  maxNodes?: number; // workspace (tree) nodes between syncs (default 256)
  threads?: number; // intra-op threads (default 1: the edge drafts on one core)
}

/** The draft model: `sync` to the committed sequence, `extend` with tree nodes, one run each. */
export class OnnxDrafter {
  readonly vocabSize: number;
  private k: Float32Array;
  private v: Float32Array;
  private readonly rowSize: number;
  private committed: number[] = [];
  private cached = 0; // committed rows in the KV buffer
  private endLogits: Float32Array | null = null;
  // the workspace: nodes added since the last sync (their rows follow the committed ones)
  private wsParents: number[] = [];
  private wsDepth: number[] = [];
  private anc: Uint8Array[] = []; // per node: ancestor-or-self flags over the workspace nodes
  runs = 0;
  runMs = 0;
  rows = 0; // rows evaluated (committed and workspace)

  private constructor(
    readonly manifest: Manifest,
    private readonly ort: OrtLike,
    private readonly session: OrtSession,
    readonly maxContext: number,
    readonly maxNodes: number,
  ) {
    this.vocabSize = manifest.vocab_size;
    this.rowSize = manifest.num_layers * manifest.num_kv_heads * manifest.head_dim;
    const rows = maxContext + maxNodes;
    this.k = new Float32Array(rows * this.rowSize);
    this.v = new Float32Array(rows * this.rowSize);
  }

  /** Load an export folder (checked against its manifest) with the given ONNX Runtime module. */
  static async load(reader: ExportReader, where: string, ort: OrtLike, o: DrafterOptions = {}, read?: Manifest): Promise<OnnxDrafter> {
    const manifest = read ?? (await readManifest(reader, where)); // `read`: the manifest, already read and checked
    const options = {
      executionProviders: ["cpu"],
      intraOpNumThreads: o.threads ?? 1,
      interOpNumThreads: 1,
      graphOptimizationLevel: "all",
    };
    let session: OrtSession;
    try {
      if (reader.path) {
        session = await ort.InferenceSession.create(reader.path("model.onnx"), options);
      } else {
        const external = Object.keys(manifest.files).filter((f) => f !== "model.onnx" && f.startsWith("model.onnx"));
        const model = await reader.bytes("model.onnx");
        const externalData = await Promise.all(external.map(async (f) => ({ path: f, data: await reader.bytes(f) })));
        session = await ort.InferenceSession.create(model, { ...options, externalData });
      }
    } catch (e) {
      const hint = manifest.int8
        ? ` (an int8 export of layout ${manifest.int8_layout}: this runtime may lack its operators; export fp32 or ` +
          "with --int8-method dynamic)"
        : "";
      throw new ExportError(`${where}: ONNX Runtime cannot load model.onnx: ${(e as Error).message}${hint}`);
    }
    if (session.outputNames.slice(0, 3).join(",") !== "logits,present_key,present_value") {
      throw new ExportError(`${where}/model.onnx: unexpected outputs ${session.outputNames.join(",")}; re-export`);
    }
    return new OnnxDrafter(manifest, ort, session, o.maxContext ?? 4096, o.maxNodes ?? 256);
  }

  get committedLength(): number {
    return this.committed.length;
  }

  /** Measured ms of evaluating one row (0 before any run). */
  get msPerRow(): number {
    return this.rows ? this.runMs / this.rows : 0;
  }

  get numNodes(): number {
    return this.wsParents.length;
  }

  /** Make the state equal to `committed` (dropping the workspace); the next-token logits after it. */
  async sync(committed: readonly number[]): Promise<Float32Array> {
    if (committed.length === 0) throw new Error("sync needs at least one committed token");
    if (committed.length > this.maxContext) {
      throw new Error(`${committed.length} committed tokens exceed the drafter's context of ${this.maxContext}`);
    }
    this.checkIds(committed);
    let keep = 0;
    const old = this.committed;
    while (keep < old.length && keep < committed.length && old[keep] === committed[keep]) keep++;
    let logits = keep === old.length && keep === committed.length ? this.endLogits : null;
    if (logits === null && keep === committed.length) keep--; // a strict prefix: re-evaluate its last token
    this.dropWorkspace();
    this.cached = Math.min(this.cached, keep);
    for (let a = keep; a < committed.length; a += CHUNK) {
      const chunk = committed.slice(a, Math.min(a + CHUNK, committed.length));
      const n = chunk.length;
      const past = this.cached;
      const mask = new Float32Array(n * (past + n));
      for (let i = 0; i < n; i++) for (let j = i + 1; j < n; j++) mask[i * (past + n) + past + j] = MASKED;
      const positions = Array.from({ length: n }, (_, i) => past + i);
      const out = await this.run(chunk, positions, mask, [n - 1], past);
      this.cached += n;
      logits = out[0];
    }
    this.committed = [...committed];
    this.endLogits = logits;
    return logits!;
  }

  /** Add workspace nodes (parents: -1 = after the committed end, or an earlier node id) and
   * evaluate them in one run; the next-token logits after each. */
  async extend(parents: readonly number[], tokens: readonly number[]): Promise<Float32Array[]> {
    if (this.committed.length === 0) throw new Error("call sync(committed) before extend()");
    if (parents.length !== tokens.length) throw new Error("parents and tokens differ in length");
    this.checkIds(tokens);
    const first = this.numNodes;
    const n = tokens.length;
    if (first + n > this.maxNodes) throw new Error(`the workspace holds at most ${this.maxNodes} nodes`);
    for (let i = 0; i < n; i++) {
      const p = parents[i];
      if (!(Number.isInteger(p) && p >= -1 && p < first + i)) throw new Error(`parents[${i}] = ${p}: not -1 or an earlier node`);
      const row = new Uint8Array(this.maxNodes);
      if (p >= 0) row.set(this.anc[p].subarray(0, p + 1));
      row[first + i] = 1;
      this.anc.push(row);
      this.wsParents.push(p);
      this.wsDepth.push(p < 0 ? 1 : this.wsDepth[p] + 1);
    }
    const past = this.cached + first;
    const total = past + n;
    const mask = new Float32Array(n * total);
    for (let i = 0; i < n; i++) {
      const a = this.anc[first + i];
      for (let j = 0; j < first + n; j++) if (!a[j]) mask[i * total + this.cached + j] = MASKED;
    }
    const positions = Array.from({ length: n }, (_, i) => this.committed.length - 1 + this.wsDepth[first + i]);
    return this.run(tokens, positions, mask, Array.from({ length: n }, (_, i) => i), past);
  }

  private dropWorkspace(): void {
    this.wsParents = [];
    this.wsDepth = [];
    this.anc = [];
  }

  private checkIds(ids: readonly number[]): void {
    for (const t of ids) {
      if (!Number.isInteger(t) || t < 0 || t >= this.vocabSize) throw new Error(`token id ${t} is outside the vocabulary`);
    }
  }

  private async run(
    tokens: readonly number[],
    positions: readonly number[],
    mask: Float32Array,
    logitRows: readonly number[],
    past: number,
  ): Promise<Float32Array[]> {
    const { ort, rowSize } = this;
    const n = tokens.length;
    const m = this.manifest;
    const kvDims = (rows: number) => [rows, m.num_layers, m.num_kv_heads, m.head_dim];
    const i64 = (xs: readonly number[]) => BigInt64Array.from(xs, (x) => BigInt(x));
    const t0 = performance.now();
    const out = await this.session.run({
      input_ids: new ort.Tensor("int64", i64(tokens), [n]),
      position_ids: new ort.Tensor("int64", i64(positions), [n]),
      attention_mask: new ort.Tensor("float32", mask, [n, past + n]),
      logit_rows: new ort.Tensor("int64", i64(logitRows), [logitRows.length]),
      past_key: new ort.Tensor("float32", this.k.subarray(0, past * rowSize), kvDims(past)),
      past_value: new ort.Tensor("float32", this.v.subarray(0, past * rowSize), kvDims(past)),
    });
    this.runMs += performance.now() - t0;
    this.runs++;
    this.rows += n;
    this.k.set(out.present_key.data as Float32Array, past * rowSize);
    this.v.set(out.present_value.data as Float32Array, past * rowSize);
    const logits = out.logits.data as Float32Array;
    const V = this.vocabSize;
    return logitRows.map((_, r) => logits.slice(r * V, (r + 1) * V));
  }
}

/** The k indices of the largest values, largest first (ties: the lower index first). */
export function topK(row: Float32Array, k: number): number[] {
  const best: number[] = [];
  for (let i = 0; i < row.length; i++) {
    const v = row[i];
    if (best.length === k && v <= row[best[k - 1]]) continue;
    let at = best.length === k ? k - 1 : best.length;
    if (best.length < k) best.push(i);
    while (at > 0 && row[best[at - 1]] < v) {
      best[at] = best[at - 1];
      at--;
    }
    best[at] = i;
  }
  return best;
}

/** SpecInfer's expansion tree ⟨k1..km⟩ below `committed`, greedy (the draft's top-k_i tokens at
 * every node), one run per level; the last level is not evaluated (as the Python edge drafts it). */
export async function draftStatic(
  drafter: OnnxDrafter,
  committed: readonly number[],
  ks: readonly number[],
  coupling?: Coupling,
): Promise<Tree> {
  const tokens: number[] = [];
  const parents: number[] = [];
  let frontier: { node: number; logits: Float32Array }[] = [{ node: -1, logits: await drafter.sync(committed) }];
  for (let level = 0; level < ks.length; level++) {
    const fresh: number[] = [];
    for (const { node, logits } of frontier) {
      // match: the keyed token at this node's absolute position leads its children
      const children = coupling ? coupledChildren(logits, ks[level], committed.length + level, coupling) : topK(logits, ks[level]);
      for (const tok of children) {
        fresh.push(tokens.length);
        tokens.push(tok);
        parents.push(node);
      }
    }
    if (level === ks.length - 1) break;
    // after the sync the workspace is empty and gets the levels in tree order: its ids are the tree's
    const out = await drafter.extend(
      fresh.map((i) => parents[i]),
      fresh.map((i) => tokens[i]),
    );
    frontier = fresh.map((node, j) => ({ node, logits: out[j] }));
  }
  return { base: committed.length, cond: [], tokens, parents };
}

/**
 * The likeliest outcome of `tree` (drafted after `committed`, no cond): its first-child path, every
 * node accepted, then the draft's next token as the bonus (in match the coupled one).
 */
export async function likeliestOutcome(
  drafter: OnnxDrafter,
  committed: readonly number[],
  tree: Tree,
  coupling?: Coupling,
): Promise<number[]> {
  const path: number[] = [];
  let node = -1;
  for (;;) {
    const child = tree.parents.findIndex((p, i) => p === node && i > node);
    if (child < 0) break;
    path.push(tree.tokens[child]);
    node = child;
  }
  const ctx = [...committed, ...path];
  const logits = await drafter.sync(ctx);
  return [...path, coupling ? coupledToken(logits, ctx.length, coupling) : topK(logits, 1)[0]];
}

/** Pre-speculation's conditional tree: the static tree drafted after the likeliest outcome of `tree`. */
export async function draftConditional(
  drafter: OnnxDrafter,
  committed: readonly number[],
  tree: Tree,
  ks: readonly number[],
  coupling?: Coupling,
): Promise<{ cond: number[]; tree: Tree }> {
  const cond = await likeliestOutcome(drafter, committed, tree, coupling);
  const next = await draftStatic(drafter, [...committed, ...cond], ks, coupling);
  return { cond, tree: { ...next, base: committed.length, cond } };
}

/** The coupled token, then the draft's likeliest others: k children of a node in mode match. */
export function coupledChildren(logits: Float32Array, k: number, pos: number, c: Coupling): number[] {
  const first = coupledToken(logits, pos, c);
  return [first, ...topK(logits, k + 1).filter((t) => t !== first)].slice(0, k);
}

/** Log-probabilities (temperature 1) of the given ids after a row of logits. */
export function logProbs(row: Float32Array, ids: readonly number[]): number[] {
  let m = -Infinity;
  for (let i = 0; i < row.length; i++) if (row[i] > m) m = row[i];
  let sum = 0;
  for (let i = 0; i < row.length; i++) sum += Math.exp(row[i] - m);
  const lse = m + Math.log(sum);
  return ids.map((i) => row[i] - lse);
}

export interface DynamicTree {
  tree: Tree;
  pathProbs: number[]; // per node: the draft's probability of the path to it
  frontierProbs: number[]; // the best candidates left out, descending
}

/** A best-first tree of `budget` nodes by draft path probability (the Python edge's
 * trees.draft_dynamic, greedy): candidates are the `branch` likeliest children of every evaluated
 * node; each run evaluates a batch: the best candidate, then each next while it still beats the
 * best one's expected child (its path probability x the mean top-1 probability so far), at most
 * `width`; nodes at `maxDepth` are not expanded; the batch that fills the budget is not evaluated. */
export async function draftDynamic(
  drafter: OnnxDrafter,
  committed: readonly number[],
  budget: number,
  o: { width?: number; branch?: number; maxDepth?: number } = {},
): Promise<DynamicTree> {
  const width = o.width ?? 16;
  const branch = o.branch ?? 4;
  const maxDepth = o.maxDepth ?? 16;
  const tokens: number[] = [];
  const parents: number[] = [];
  const depth: number[] = [];
  const rank: number[] = []; // path log-probability per node
  const top1: number[] = [];
  // candidates: [-path logp, order, parent, token]; a sorted array is plenty for trees of <= 256 nodes
  const heap: [number, number, number, number][] = [];
  let order = 0;
  const push = (node: number, logits: Float32Array) => {
    const ids = topK(logits, branch);
    const lps = logProbs(logits, ids);
    top1.push(Math.exp(lps[0]));
    const base = node >= 0 ? rank[node] : 0;
    ids.forEach((tok, i) => heap.push([-(base + lps[i]), order++, node, tok]));
    heap.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  };
  push(-1, await drafter.sync(committed));
  const wsOf = new Map<number, number>(); // tree node -> workspace node (evaluated nodes only)
  let wsNext = 0;
  while (heap.length && tokens.length < budget) {
    const logM = Math.log(Math.max(top1.reduce((a, b) => a + b, 0) / top1.length, 1e-9));
    const most = Math.min(width, budget - tokens.length);
    const batch: number[] = [];
    let bar = -Infinity;
    while (heap.length && batch.length < most && -heap[0][0] >= bar) {
      const [neg, , parent, tok] = heap.shift()!;
      batch.push(tokens.length);
      tokens.push(tok);
      parents.push(parent);
      depth.push(parent < 0 ? 1 : depth[parent] + 1);
      rank.push(-neg);
      if (batch.length === 1) bar = -neg + logM;
    }
    const full = tokens.length >= budget;
    const expand = batch.filter((n) => !full && depth[n] < maxDepth);
    if (!expand.length) continue;
    // the workspace holds exactly the evaluated nodes, in evaluation order: map tree ids to it
    const out = await drafter.extend(
      expand.map((n) => (parents[n] < 0 ? -1 : wsOf.get(parents[n])!)),
      expand.map((n) => tokens[n]),
    );
    expand.forEach((n, j) => {
      wsOf.set(n, wsNext++);
      if (depth[n] < maxDepth) push(n, out[j]);
    });
  }
  return {
    tree: { base: committed.length, cond: [], tokens, parents },
    pathProbs: rank.map(Math.exp),
    frontierProbs: heap.slice(0, 64).map((h) => Math.exp(-h[0])),
  };
}

/** Forward ms for n nodes from the verifier's advertised curve (welcome.verify_cost_ms): linear
 * between the measured sizes, flat below the smallest, capped at the largest. */
export function verifyMs(cost: Record<string, number>, n: number): number {
  const xs = Object.keys(cost).map(Number).sort((a, b) => a - b);
  if (!xs.length) throw new Error("verify_cost_ms is empty: the server measured no forward sizes");
  if (n <= xs[0]) return cost[String(xs[0])];
  for (let i = 1; i < xs.length; i++) {
    if (n <= xs[i]) {
      const [x0, x1] = [xs[i - 1], xs[i]];
      const [y0, y1] = [cost[String(x0)], cost[String(x1)]];
      return y0 + ((y1 - y0) * (n - x0)) / (x1 - x0);
    }
  }
  return cost[String(xs[xs.length - 1])];
}

/** The node budget that maximises expected tokens per ms of a round (the Python edge's
 * speculation.estimates.choose_budget): tokens = 1 + the N largest gains, round = RTT + drafting
 * (ms a node) + the verifier's forward of N rows. */
export function chooseBudget(
  cost: Record<string, number>,
  gains: readonly number[],
  o: { rttMs?: number; draftMsPerNode?: number; maxNodes?: number } = {},
): number {
  const g = gains.map((x) => Math.min(1, Math.max(0, x))).sort((a, b) => b - a);
  let limit = Math.min(g.length, Math.max(0, ...Object.keys(cost).map(Number)));
  if (o.maxNodes !== undefined) limit = Math.min(limit, o.maxNodes);
  if (limit < 1) return 1;
  let best = 1;
  let bestRate = -1;
  let tokens = 1;
  for (let n = 1; n <= limit; n++) {
    tokens += g[n - 1];
    const round = (o.rttMs ?? 0) + (o.draftMsPerNode ?? 0) * n + verifyMs(cost, n);
    const rate = tokens / Math.max(round, 1e-9);
    if (rate > bestRate) [best, bestRate] = [n, rate];
  }
  return best;
}

/** Gains to size the next dynamic tree by: before any tree a geometric prior (alpha^d), then the
 * last tree's path probabilities and the best candidates it left out. */
export function nextGains(last: DynamicTree | null, cap: number, alpha = 0.8): number[] {
  if (last === null) return Array.from({ length: cap }, (_, d) => alpha ** (d + 1));
  return [...last.pathProbs, ...last.frontierProbs].slice(0, Math.max(cap, 1));
}
