// The session protocol's messages (PROTOCOL.md section 3): typed objects, a strict decoder that
// names the field at fault, and an encoder that writes the same bytes as the Python implementation.
import { decode as unpack, encode as pack, F64, FrameError, type Value } from "./msgpack.js";

export const PROTOCOL_VERSION = 1;
// the optional fields and frames a client names in hello.features (PROTOCOL.md section 10)
export const FEATURE_GAP_MS = "verdict.gap_ms";
export const FEATURE_PENDING_BYTES = "limits.max_pending_bytes";
export const FEATURE_WELCOME_FEATURES = "welcome.features"; // welcome.features: what the server honours
export const FEATURE_STREAM = "round.stream"; // stream frames and prompt.stream
export const FEATURE_COST = "verdict.cost_ms"; // verdict.forward_ms and verdict.marginal_ms
export const FEATURE_RESUME = "session.resume"; // welcome.resume, and hello.resume after a drop
// welcome.direct: the address of the verifier holding the session (the client may move it there)
export const FEATURE_DIRECT = "session.direct";
export const MAX_RESUME_TOKEN = 128;
export const MAX_DIRECT_URL = 512;
/** The upgrade's header naming the resume token (a fleet's router sends the resume to its holder). */
export const SESSION_HEADER = "X-Session-Id";
export const MODES = ["greedy", "match", "mss", "rrs", "ar"] as const;
export type Mode = (typeof MODES)[number];
const MAX_U31 = 2 ** 31 - 1;
const MAX_U63 = 2n ** 63n - 1n;
const MAX_STR = 4096;
const MAX_LIST = 256;
const MAX_NODES = 4096;
const MAX_TOKENS = 1 << 17;
const MAX_Q_NNZ = 1 << 20;

export class ProtocolError extends Error {
  constructor(
    public code: string,
    message: string,
    public field: string | null,
    public fatal: boolean,
    public round: number | null = null,
  ) {
    super(`${code}${field ? ` [${field}]` : ""}: ${message}`);
  }
}

export interface Limits {
  max_nodes: number; max_depth: number; max_pending: number; max_bytes: number; max_context: number;
  max_draws?: number; max_row_draws?: number; max_q_ids?: number; max_q_row?: number;
  max_pending_bytes?: number;  // only when hello.features names limits.max_pending_bytes
}
export interface Tree {
  base: number; cond: number[]; tokens: number[]; parents: number[];
  draws?: { node: number[]; drafter: number[]; qrow: number[]; q_ptr: number[]; q_ids: number[]; q_wm1: number[] };
}
export type Message =
  | { type: "hello"; version: number; vocab_fingerprint: string; api_key?: string; client?: string;
      features?: string[]; resume?: string }
  | { type: "welcome"; version: number; session_id: string; model_id: string; vocab_size: number;
      vocab_fingerprint: string; eos_ids: number[]; allowed_modes: Mode[]; limits: Limits;
      verify_cost_ms: Record<string, number>; features?: string[]; resume?: string; direct?: string }
  | { type: "prompt"; tokens: number[]; mode: Mode; temperature: number; top_k: number; top_p: number;
      seed: bigint | number; max_new_tokens: number; stop_ids: number[]; continue: boolean; tree?: Tree;
      stream?: number }
  | ({ type: "tree"; round: number } & Tree)
  | { type: "stream"; round: number; k: number }
  | { type: "verdict"; round: number; tokens: number[]; accepted_nodes: number[]; has_bonus: boolean;
      committed_len: number; verify_ms: number; done: boolean; next_round?: number; reason?: string;
      gap_ms?: number; streaming?: boolean; forward_ms?: Record<string, number>; marginal_ms?: Record<string, number> }
  | { type: "stale"; round: number; reason: string }
  | { type: "error"; code: string; message: string; fatal: boolean; field?: string; round?: number }
  | { type: "cancel" }
  | { type: "close"; reason?: string };

// ------------------------------------------------------------------------------------ arrays
type DType = "<i4" | "<u4" | "<u2" | "u1";
const SIZE: Record<DType, number> = { "<i4": 4, "<u4": 4, "<u2": 2, u1: 1 };

export function packArray(xs: readonly number[], dt: DType = "<i4"): Uint8Array {
  const b = new Uint8Array(xs.length * SIZE[dt]);
  const v = new DataView(b.buffer);
  xs.forEach((x, i) => {
    if (dt === "<i4") v.setInt32(4 * i, x, true);
    else if (dt === "<u4") v.setUint32(4 * i, x, true);
    else if (dt === "<u2") v.setUint16(2 * i, x, true);
    else v.setUint8(i, x);
  });
  return b;
}

export function unpackArray(b: Uint8Array, dt: DType): number[] {
  const v = new DataView(b.buffer, b.byteOffset, b.byteLength);
  const n = b.length / SIZE[dt];
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    out.push(dt === "<i4" ? v.getInt32(4 * i, true) : dt === "<u4" ? v.getUint32(4 * i, true)
      : dt === "<u2" ? v.getUint16(2 * i, true) : v.getUint8(i));  // prettier-ignore
  }
  return out;
}

// ------------------------------------------------------------------------------------ reading
class Reader {
  private used = new Set<string>();
  constructor(private m: { [k: string]: Value }, private prefix: string) {}
  name(k: string): string {
    return this.prefix ? `${this.prefix}.${k}` : k;
  }
  bad(k: string, msg: string, code = "BAD_MESSAGE"): ProtocolError {
    return new ProtocolError(code, msg, this.name(k), true);
  }
  has(k: string): boolean {
    return k in this.m && this.m[k] !== null;
  }
  raw(k: string, optional = false): Value | undefined {
    this.used.add(k);
    if (!(k in this.m) || this.m[k] === null) {
      if (optional) return undefined;
      throw this.bad(k, "missing");
    }
    return this.m[k];
  }
  integer(k: string, lo: number | bigint = 0, hi: number | bigint = MAX_U31, optional = false): number | bigint | undefined {
    const v = this.raw(k, optional);
    if (v === undefined) return undefined;
    if (typeof v === "boolean" || !(typeof v === "bigint" || (typeof v === "number" && Number.isInteger(v)))) {
      throw this.bad(k, `must be an integer`);
    }
    if (BigInt(v) < BigInt(lo) || BigInt(v) > BigInt(hi)) throw this.bad(k, `must be in [${lo}, ${hi}], got ${v}`);
    return v;
  }
  int(k: string, lo = 0, hi = MAX_U31): number {
    return Number(this.integer(k, lo, hi));
  }
  number(k: string, lo: number, hi: number): number | undefined {
    const v = this.raw(k, true);
    if (v === undefined) return undefined;
    const x = v instanceof F64 ? v.v : v;
    if (typeof x === "boolean" || (typeof x !== "number" && typeof x !== "bigint")) throw this.bad(k, "must be a number");
    const n = Number(x);
    if (!Number.isFinite(n) || n < lo || n > hi) throw this.bad(k, `must be a finite number in [${lo}, ${hi}]`);
    return n;
  }
  flag(k: string, optional = false): boolean | undefined {
    const v = this.raw(k, optional);
    if (v === undefined) return undefined;
    if (typeof v !== "boolean") throw this.bad(k, "must be a boolean");
    return v;
  }
  text(k: string, optional = false): string | undefined {
    const v = this.raw(k, optional);
    if (v === undefined) return undefined;
    if (typeof v !== "string") throw this.bad(k, "must be a string");
    if (v.length > MAX_STR) throw this.bad(k, `longer than ${MAX_STR} characters`, "LIMIT_EXCEEDED");
    return v;
  }
  array(k: string, dt: DType, maxLen: number, optional = false): number[] {
    const v = this.raw(k, optional);
    if (v === undefined) return [];
    if (!(v instanceof Uint8Array)) throw this.bad(k, `must be raw little-endian ${dt} bytes (msgpack bin)`);
    if (v.length % SIZE[dt]) throw this.bad(k, `byte length ${v.length} is not a multiple of ${SIZE[dt]}`);
    if (v.length / SIZE[dt] > maxLen) throw this.bad(k, `over the limit of ${maxLen}`, "LIMIT_EXCEEDED");
    return unpackArray(v, dt);
  }
  strList(k: string, optional = false): string[] | undefined {
    const v = this.raw(k, optional);
    if (v === undefined) return undefined;
    if (!Array.isArray(v) || !v.every((x) => typeof x === "string")) throw this.bad(k, "must be a list of strings");
    if (v.length > MAX_LIST) throw this.bad(k, `over ${MAX_LIST} entries`, "LIMIT_EXCEEDED");
    return v as string[];
  }
  sub(k: string): Reader {
    const v = this.raw(k);
    if (v === null || typeof v !== "object" || Array.isArray(v) || v instanceof Uint8Array || v instanceof F64) {
      throw new ProtocolError("BAD_MESSAGE", "expected a map", this.name(k), true);
    }
    return new Reader(v as { [k: string]: Value }, this.name(k));
  }
  finish(): void {
    const extra = Object.keys(this.m).filter((k) => !this.used.has(k)).sort();
    if (extra.length) throw this.bad(extra[0], "unknown field");
  }
}

function readTree(r: Reader): Tree {
  const t: Tree = {
    base: r.int("base", 0, MAX_U31),
    cond: r.array("cond", "<i4", MAX_TOKENS, true),
    tokens: r.array("tokens", "<i4", MAX_NODES),
    parents: r.array("parents", "<i4", MAX_NODES),
  };
  if (r.has("draws")) {
    const d = r.sub("draws");
    t.draws = {
      q_ptr: d.array("q_ptr", "<u4", MAX_Q_NNZ + 1),
      q_ids: d.array("q_ids", "<i4", MAX_Q_NNZ),
      q_wm1: d.array("q_wm1", "<u2", MAX_Q_NNZ),
      node: d.array("node", "<i4", MAX_Q_NNZ),
      drafter: d.array("drafter", "u1", MAX_Q_NNZ),
      qrow: d.array("qrow", "<i4", MAX_Q_NNZ),
    };
    d.finish();
  } else r.raw("draws", true);
  return t;
}

/** Decode one frame (PROTOCOL.md section 2), or throw ProtocolError naming the field. */
export function decodeMessage(frame: Uint8Array, maxBytes = 1 << 20): Message {
  if (frame.length > maxBytes) {
    throw new ProtocolError("TOO_LARGE", `frame of ${frame.length} bytes is over ${maxBytes}`, "frame", true);
  }
  let m: { [k: string]: Value };
  try {
    m = unpack(frame, maxBytes);
  } catch (e) {
    if (e instanceof FrameError) throw new ProtocolError("BAD_FRAME", `not a valid msgpack frame: ${e.message}`, "frame", true);
    throw e;
  }
  const r = new Reader(m, "");
  const type = r.raw("type");
  if (typeof type !== "string" || !DECODERS[type]) {
    throw new ProtocolError("UNKNOWN_TYPE", `unknown message type ${String(type)}`, "type", true);
  }
  const msg = DECODERS[type](r);
  r.finish();
  return msg;
}

// What a usable welcome holds, the same rule as the Python side's (SessionLimits.RANGES in
// shared/messages.py, shared/verify_cost.py); the protocol's vectors check that both refuse alike.
const LIMIT_RANGES = {
  max_nodes: [1, MAX_U31], max_depth: [1, MAX_U31], max_pending: [0, MAX_U31],
  max_bytes: [4096, MAX_U31], max_context: [1, MAX_U31],
} as const satisfies Record<string, readonly [number, number]>;  // prettier-ignore
/** The slowest forward a cost curve may state, in ms. */
export const MAX_VERIFY_MS = 1e9;

/** A cost map: node counts (decimal strings, >= 1; >= 0 with `streams`, 0 pricing a stream step) to
 * forward ms (finite, > 0, <= 1e9): welcome.verify_cost_ms, verdict.forward_ms / marginal_ms. */
function readCostCurve(r: Reader, key = "verify_cost_ms", optional = false, streams = false): Record<string, number> | undefined {
  const cost = r.raw(key, optional);
  if (cost === undefined) return undefined;
  if (typeof cost !== "object" || cost === null || Array.isArray(cost) || cost instanceof Uint8Array
      || cost instanceof F64 || Object.keys(cost).length > MAX_LIST) {
    throw r.bad(key, "must be a map of node count (string) to milliseconds");
  }  // prettier-ignore
  const out: Record<string, number> = {};
  const lo = streams ? 0 : 1;
  for (const [k, v] of Object.entries(cost as Record<string, Value>)) {
    const x = v instanceof F64 ? v.v : v;
    if (!/^[0-9]{1,10}$/.test(k) || typeof x === "boolean" || (typeof x !== "number" && typeof x !== "bigint")) {
      throw r.bad(key, "must map decimal node counts to numbers");
    }
    const n = Number(k);
    const ms = Number(x);
    if (n < lo || n > MAX_U31) throw r.bad(key, `node count ${k} is not an integer in [${lo}, ${MAX_U31}]`);
    if (!Number.isFinite(ms) || ms <= 0 || ms > MAX_VERIFY_MS) {
      throw r.bad(key, `${k} nodes: ${ms} ms is not a forward time (finite, > 0 and <= 1e9)`);
    }
    out[String(n)] = ms;
  }
  return out;
}

/** A cost map's entries in increasing node count, as floats (the Python encoder's order). */
function costToWire(cost: Record<string, number>): { [k: string]: Value } {
  const out: { [k: string]: Value } = {};
  for (const k of Object.keys(cost).sort((a, b) => Number(a) - Number(b))) out[k] = new F64(cost[k]);
  return out;
}

const DECODERS: Record<string, (r: Reader) => Message> = {
  hello: (r) => ({
    type: "hello",
    version: r.int("version", 0, 1 << 16),
    vocab_fingerprint: r.text("vocab_fingerprint")!,
    ...opt("api_key", r.text("api_key", true)),
    ...opt("client", r.text("client", true)),
    ...opt("features", r.strList("features", true)),
    ...opt("resume", (() => {
      const t = r.text("resume", true);
      if (t !== undefined && !(t.length > 0 && t.length <= MAX_RESUME_TOKEN)) {
        throw r.bad("resume", `a resume token is 1 to ${MAX_RESUME_TOKEN} characters`);
      }
      return t;
    })()),
  }),
  welcome: (r) => {
    const modes = r.raw("allowed_modes");
    if (!Array.isArray(modes) || modes.length > MAX_LIST || !modes.every((x) => MODES.includes(x as Mode))) {
      throw r.bad("allowed_modes", "must be a list of modes");
    }
    const costOut = readCostCurve(r)!;
    const features = r.strList("features", true);
    const l = r.sub("limits");
    const lim = (k: keyof typeof LIMIT_RANGES) => l.int(k, ...LIMIT_RANGES[k]);
    const limits: Limits = {
      max_nodes: lim("max_nodes"), max_depth: lim("max_depth"), max_pending: lim("max_pending"),
      max_bytes: lim("max_bytes"), max_context: lim("max_context"),
    };  // prettier-ignore
    for (const k of ["max_draws", "max_row_draws", "max_q_ids", "max_q_row", "max_pending_bytes"] as const) {
      const v = l.integer(k, 1, MAX_U31, true);
      if (v !== undefined) limits[k] = Number(v);
    }
    l.finish();
    return {
      type: "welcome", version: r.int("version", 0, 1 << 16), session_id: r.text("session_id")!,
      model_id: r.text("model_id")!, vocab_size: r.int("vocab_size", 1),
      vocab_fingerprint: r.text("vocab_fingerprint", true) ?? "", eos_ids: r.array("eos_ids", "<i4", MAX_LIST),
      allowed_modes: modes as Mode[], limits, verify_cost_ms: costOut, ...(features ? { features: [...features] } : {}),
      ...opt("resume", r.text("resume", true)),
      ...opt("direct", (() => {
        const u = r.text("direct", true);
        if (u !== undefined && !(u.length > 0 && u.length <= MAX_DIRECT_URL && /^wss?:\/\//.test(u)))
          throw r.bad("direct", `a ws:// or wss:// URL of at most ${MAX_DIRECT_URL} characters`);
        return u;
      })()),
    };  // prettier-ignore
  },
  prompt: (r) => {
    const mode = r.text("mode")!;
    if (!MODES.includes(mode as Mode)) throw r.bad("mode", `unknown mode ${mode}`);
    const tree = r.has("tree") ? (() => { const t = r.sub("tree"); const out = readTree(t); t.finish(); return out; })() : (r.raw("tree", true), undefined);  // prettier-ignore
    return {
      type: "prompt", tokens: r.array("tokens", "<i4", MAX_TOKENS), mode: mode as Mode,
      temperature: r.number("temperature", 0, 1e4) ?? 0, top_k: Number(r.integer("top_k", 0, MAX_U31, true) ?? 0),
      top_p: r.number("top_p", 1e-9, 1) ?? 1, seed: r.integer("seed", 0, MAX_U63, true) ?? 0,
      max_new_tokens: Number(r.integer("max_new_tokens", 1, MAX_U31, true) ?? 128),
      stop_ids: r.array("stop_ids", "<i4", MAX_LIST, true), continue: r.flag("continue", true) ?? false,
      ...(tree ? { tree } : {}), ...opt("stream", r.integer("stream", 1, MAX_U31, true)),
    };  // prettier-ignore
  },
  tree: (r) => ({ type: "tree", round: r.int("round", 1), ...readTree(r) }),
  stream: (r) => ({ type: "stream", round: r.int("round", 1), k: r.int("k", 1, MAX_U31) }),
  verdict: (r) => ({
    type: "verdict", round: r.int("round", 0), tokens: r.array("tokens", "<i4", MAX_TOKENS),
    accepted_nodes: r.array("accepted_nodes", "<i4", MAX_NODES), has_bonus: r.flag("has_bonus")!,
    committed_len: r.int("committed_len", 0), ...opt("next_round", r.integer("next_round", 1, MAX_U31, true)),
    verify_ms: r.number("verify_ms", 0, 1e9) ?? 0, done: r.flag("done")!, ...opt("reason", r.text("reason", true)),
    ...opt("gap_ms", r.number("gap_ms", 0, 1e9)), ...(r.flag("streaming", true) ? { streaming: true } : {}),
    ...opt("forward_ms", readCostCurve(r, "forward_ms", true, true)),
    ...opt("marginal_ms", readCostCurve(r, "marginal_ms", true, true)),
  }),  // prettier-ignore
  stale: (r) => ({ type: "stale", round: r.int("round", 1), reason: r.text("reason")! }),
  error: (r) => ({
    type: "error", code: r.text("code")!, message: r.text("message")!, ...opt("field", r.text("field", true)),
    fatal: r.flag("fatal")!, ...opt("round", r.integer("round", 0, MAX_U31, true)),
  }),  // prettier-ignore
  cancel: () => ({ type: "cancel" }),
  close: (r) => ({ type: "close", ...opt("reason", r.text("reason", true)) }),
};

function opt<K extends string>(k: K, v: unknown): Partial<Record<K, never>> {
  return v === undefined ? {} : ({ [k]: typeof v === "bigint" ? Number(v) : v } as Partial<Record<K, never>>);
}

// ------------------------------------------------------------------------------------ writing
function treeFields(t: Tree, d: { [k: string]: Value }): { [k: string]: Value } {
  d.base = t.base;
  d.cond = packArray(t.cond);
  d.tokens = packArray(t.tokens);
  d.parents = packArray(t.parents);
  if (t.draws) {
    d.draws = {
      node: packArray(t.draws.node), drafter: packArray(t.draws.drafter, "u1"), qrow: packArray(t.draws.qrow),
      q_ptr: packArray(t.draws.q_ptr, "<u4"), q_ids: packArray(t.draws.q_ids), q_wm1: packArray(t.draws.q_wm1, "<u2"),
    };  // prettier-ignore
  }
  return d;
}

/** One frame, fields in the order of PROTOCOL.md (the Python implementation's bytes). */
export function encodeMessage(m: Message): Uint8Array {
  const d: { [k: string]: Value } = { type: m.type };
  switch (m.type) {
    case "hello":
      Object.assign(d, { version: m.version, vocab_fingerprint: m.vocab_fingerprint });
      if (m.api_key !== undefined) d.api_key = m.api_key;
      if (m.client !== undefined) d.client = m.client;
      if (m.features !== undefined && m.features.length) d.features = [...m.features];
      if (m.resume !== undefined) d.resume = m.resume;
      break;
    case "welcome": {
      const limits: { [k: string]: Value } = { ...m.limits } as { [k: string]: Value };
      const cost = costToWire(m.verify_cost_ms);
      Object.assign(d, {
        version: m.version, session_id: m.session_id, model_id: m.model_id, vocab_size: m.vocab_size,
        vocab_fingerprint: m.vocab_fingerprint, eos_ids: packArray(m.eos_ids), allowed_modes: [...m.allowed_modes],
        limits, verify_cost_ms: cost,
      });  // prettier-ignore
      if (m.features !== undefined) d.features = [...m.features];
      if (m.resume !== undefined) d.resume = m.resume;
      if (m.direct !== undefined) d.direct = m.direct;
      break;
    }
    case "prompt":
      Object.assign(d, {
        tokens: packArray(m.tokens), mode: m.mode, temperature: new F64(m.temperature), top_k: m.top_k,
        top_p: new F64(m.top_p), seed: BigInt(m.seed), max_new_tokens: m.max_new_tokens,
        stop_ids: packArray(m.stop_ids), continue: m.continue,
      });  // prettier-ignore
      if (m.tree) d.tree = treeFields(m.tree, {});
      if (m.stream) d.stream = m.stream;
      break;
    case "stream":
      Object.assign(d, { round: m.round, k: m.k });
      break;
    case "tree":
      d.round = m.round;
      treeFields(m, d);
      break;
    case "verdict":
      Object.assign(d, {
        round: m.round, tokens: packArray(m.tokens), accepted_nodes: packArray(m.accepted_nodes),
        has_bonus: m.has_bonus, committed_len: m.committed_len, verify_ms: new F64(m.verify_ms), done: m.done,
      });  // prettier-ignore
      if (m.next_round !== undefined) d.next_round = m.next_round;
      if (m.reason !== undefined) d.reason = m.reason;
      if (m.gap_ms !== undefined) d.gap_ms = new F64(m.gap_ms);
      if (m.streaming) d.streaming = true;
      if (m.forward_ms !== undefined) d.forward_ms = costToWire(m.forward_ms);
      if (m.marginal_ms !== undefined) d.marginal_ms = costToWire(m.marginal_ms);
      break;
    case "stale":
      Object.assign(d, { round: m.round, reason: m.reason });
      break;
    case "error":
      Object.assign(d, { code: m.code, message: m.message, fatal: m.fatal });
      if (m.field !== undefined) d.field = m.field;
      if (m.round !== undefined) d.round = m.round;
      break;
    case "close":
      if (m.reason !== undefined) d.reason = m.reason;
      break;
  }
  return pack(d);
}
