// The session client: hello, then generations whose rounds are drafted by prompt lookup and
// verified by the server (greedy or match). Token ids in, token ids out: the caller tokenizes the
// prompt and decodes the output with the tokenizer of the model the verifier names (welcome.model_id).
import { DEFAULT_LOOKUP, fitTree, lookupTree, type LookupOptions } from "./lookup.js";
import { decodeMessage, encodeMessage, type Message, PROTOCOL_VERSION, ProtocolError, type Tree } from "./protocol.js";
import { openSocket, type Socket } from "./socket.js";

type Welcome = Extract<Message, { type: "welcome" }>;
type Verdict = Extract<Message, { type: "verdict" }>;

export class GenerationError extends Error {
  constructor(message: string, public code?: string, public field?: string) {
    super(message);
  }
}

/** Drafts the next round's tree from the committed tokens (a model drafter, or prompt lookup). */
export type TreeSource = (committed: readonly number[]) => Tree | Promise<Tree>;

export interface GenerateOptions {
  mode?: "greedy" | "match" | "ar";
  draft?: TreeSource; // default: prompt lookup (`lookup`)
  signal?: AbortSignal; // abort: the server is told to cancel; the generation ends with signal.reason
  maxNewTokens?: number;
  temperature?: number; // match: > 0
  topK?: number;
  topP?: number;
  seed?: number | bigint;
  stopIds?: number[];
  lookup?: Partial<LookupOptions>;
  onVerdict?: (v: VerdictInfo) => void; // each verdict, as it arrives (the live marks of a page)
}

/** What a verdict committed: `tokens`, the first `accepted` of them drafted tokens the target accepted. */
export interface VerdictInfo {
  round: number;
  tokens: number[];
  accepted: number; // tokens from the draft (at depths 1..accepted)
  bonus: boolean; // the last token is the target's own (a correction or the bonus)
  verifyMs: number;
}

export interface Stats {
  rounds: number; // verdicts of tree rounds (round 0 not counted)
  tokens: number;
  tau: number; // tokens per verdict, bonus included
  draftedNodes: number;
  draftMs: number; // median ms of drafting a round's tree (on the critical path)
  msPerToken: number; // wall ms from the prompt to the last verdict, per generated token
}

const median = (xs: number[]) => {
  if (!xs.length) return 0;
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

export class TreespecClient {
  welcome!: Welcome;
  committed: number[] = [];
  private inbox: (Message | Error)[] = [];
  private waiting: ((m: Message | Error) => void) | null = null;
  private round = 0;
  private sentAt = 0;
  /** The network's share of a round, learned from verdicts (wall time - the server's verify_ms). */
  rttMs = 0;
  last: Stats = { rounds: 0, tokens: 0, tau: 0, draftedNodes: 0, draftMs: 0, msPerToken: 0 };

  private ws!: Socket;

  private constructor() {}

  private received(data: Uint8Array | null): void {
    let m: Message | Error;
    try {
      m = data !== null ? decodeMessage(data) : new GenerationError("the verifier sent a text frame");
    } catch (e) {
      m = e as Error;
    }
    this.push(m);
  }

  private push(m: Message | Error): void {
    if (this.waiting) {
      const w = this.waiting;
      this.waiting = null;
      w(m);
    } else this.inbox.push(m);
  }

  private next(): Promise<Message> {
    const m = this.inbox.shift();
    const done = (x: Message | Error): Message => {
      if (x instanceof Error) throw x;
      if (x.type === "error" && x.fatal) throw new GenerationError(`verifier refused: ${x.code} (${x.field}): ${x.message}`, x.code, x.field);
      return x;
    };  // prettier-ignore
    if (m !== undefined) return Promise.resolve(m).then(done);
    return new Promise((resolve, reject) => {
      this.waiting = (x) => {
        try {
          resolve(done(x));
        } catch (e) {
          reject(e);
        }
      };
    });
  }

  private send(m: Message): void {
    this.ws.send(encodeMessage(m));
  }

  /** Open a session: `fingerprint` is the sha256 of the vocabulary (PROTOCOL.md section 8). */
  static async connect(url: string, fingerprint: string, apiKey?: string): Promise<TreespecClient> {
    const c = new TreespecClient();
    try {
      c.ws = await openSocket(url, apiKey, {
        message: (data) => c.received(data),
        close: (code, reason) => c.push(new GenerationError(`the verifier closed the connection (${code}): ${reason}`)),
        error: (message) => c.push(new GenerationError(`cannot reach the verifier: ${message}`)),
      });
    } catch (e) {
      throw new GenerationError((e as Error).message);
    }
    const key = apiKey && !c.ws.keyInHeader ? { api_key: apiKey } : {}; // a browser sends no headers
    c.send({ type: "hello", version: PROTOCOL_VERSION, vocab_fingerprint: fingerprint, client: "treespec-ts/0.1", ...key });
    const w = await c.next();
    if (w.type !== "welcome") throw new GenerationError(`expected welcome, got ${w.type}`);
    if (w.vocab_fingerprint && w.vocab_fingerprint !== fingerprint) {
      throw new GenerationError(`the vocabulary is not the target's (${w.model_id})`, "VOCAB_MISMATCH", "vocab_fingerprint");
    }
    c.welcome = w;
    return c;
  }

  /** Generate from `prompt` (token ids); yields each verdict's new tokens as they are committed. */
  async *generate(prompt: number[], o: GenerateOptions = {}): AsyncGenerator<number[]> {
    const mode = o.mode ?? "greedy";
    const lim = this.welcome.limits;
    const look: LookupOptions = { ...DEFAULT_LOOKUP, ...o.lookup };
    look.depth = Math.min(look.depth, lim.max_depth);
    const source: TreeSource = o.draft ?? ((ctx) => lookupTree(ctx, look));
    const drafting: number[] = [];
    const draft = async (ctx: number[]) => {
      const t = performance.now();
      const tree = fitTree(await source(ctx), lim.max_nodes, lim.max_depth);
      drafting.push(performance.now() - t);
      return tree;
    };
    const signal = o.signal;
    signal?.throwIfAborted();
    let cancelled = false;
    const cancel = () => {
      if (!cancelled) {
        cancelled = true;
        this.send({ type: "cancel" }); // the verdict of the round in flight comes back done
      }
    };
    const t0 = performance.now();
    this.committed = [...prompt];
    const first = mode === "ar" ? undefined : await draft(this.committed);
    this.send({
      type: "prompt", tokens: prompt, mode, temperature: mode === "greedy" ? 0 : o.temperature ?? 0,
      top_k: o.topK ?? 0, top_p: o.topP ?? 1, seed: o.seed ?? 0, max_new_tokens: o.maxNewTokens ?? 128,
      stop_ids: o.stopIds ?? [], continue: false, ...(first ? { tree: first } : {}),
    });  // prettier-ignore
    const st: Stats = { rounds: 0, tokens: 0, tau: 0, draftedNodes: first?.tokens.length ?? 0, draftMs: 0, msPerToken: 0 };
    this.last = st;
    let verdicts = 0;
    signal?.addEventListener("abort", cancel, { once: true });
    if (signal?.aborted) cancel(); // aborted while the first tree was drafted
    try {
      for (;;) {
        const m = await this.next();
        if (m.type === "stale") continue;
        if (m.type === "error") throw new GenerationError(`verifier refused: ${m.code} (${m.field}): ${m.message}`, m.code, m.field);
        if (m.type !== "verdict") throw new ProtocolError("BAD_ORDER", `unexpected ${m.type}`, "type", true);
        const v = m as Verdict;
        this.committed.push(...v.tokens);
        if (v.committed_len !== this.committed.length) {
          throw new GenerationError(`committed_len ${v.committed_len} but ${this.committed.length} tokens held`);
        }
        verdicts++;
        if (v.round > 0) {
          st.rounds++;
          const net = Math.max(0, performance.now() - this.sentAt - v.verify_ms);
          this.rttMs = st.rounds === 1 ? net : 0.8 * this.rttMs + 0.2 * net;
        }
        st.tokens += v.tokens.length;
        st.tau = st.tokens / verdicts;
        st.msPerToken = (performance.now() - t0) / Math.max(1, st.tokens);
        st.draftMs = median(drafting);
        o.onVerdict?.({ round: v.round, tokens: [...v.tokens], accepted: v.accepted_nodes.length, bonus: v.has_bonus,
                        verifyMs: v.verify_ms });  // prettier-ignore
        if (v.tokens.length) yield v.tokens;
        if (v.done) {
          if (cancelled && v.reason === "cancelled") throw signal?.reason ?? new DOMException("cancelled", "AbortError");
          return;
        }
        if (mode !== "ar" && !cancelled) {
          const t = await draft(this.committed);
          st.draftedNodes += t.tokens.length;
          this.send({ type: "tree", round: ++this.round, ...t });
          this.sentAt = performance.now();
        }
      }
    } finally {
      signal?.removeEventListener("abort", cancel);
    }
  }

  close(): void {
    if (this.ws.open) {
      this.send({ type: "close" });
      this.ws.close(1000);
    }
  }
}
