// The session client: hello, then generations whose rounds are drafted by prompt lookup and
// verified by the server (greedy or match). Token ids in, token ids out: the caller tokenizes the
// prompt and decodes the output with the tokenizer of the model the verifier names (welcome.model_id).
import { DEFAULT_LOOKUP, fitTree, lookupTree, type LookupOptions } from "./lookup.js";
import { ClientChecks } from "./checks.js";
import {
  encodeMessage, FEATURE_COST, FEATURE_DIRECT, FEATURE_RESUME, FEATURE_STREAM, FEATURE_WELCOME_FEATURES, type Message, PROTOCOL_VERSION, ProtocolError,
  type Tree,
} from "./protocol.js";  // prettier-ignore
import { openSocket, type Socket } from "./socket.js";
import { backoff, ConnectionLost, type ConnectOptions, DEFAULT_RESUME, GenerationError, type ResumeOptions, sleep, TRY_AGAIN_LATER } from "./errors.js";
import { Inbox } from "./inbox.js";
import { type AutoPlan, choosePlan, costAt, DEFAULT_PLAN, measuredSlower, type Objective, Realized } from "./auto_plan.js";

export {
  type AutoPlan,
  choosePlan,
  costAt,
  DEFAULT_PLAN,
  measuredSlower,
  type Objective,
  type Pricing,
  Realized,
  SPECULATIVE_KINDS,
} from "./auto_plan.js";

type Welcome = Extract<Message, { type: "welcome" }>;
type Verdict = Extract<Message, { type: "verdict" }>;

export { ConnectionLost, type ConnectOptions, DEFAULT_RESUME, GenerationError, type ResumeOptions } from "./errors.js";

const sameTokens = (a: readonly number[], b: readonly number[]) => a.length === b.length && a.every((x, i) => x === b[i]);

/** Drafts the next round's tree from the committed tokens (a model drafter, or prompt lookup). */
export type TreeSource = (committed: readonly number[]) => Tree | Promise<Tree>;

/** The features this client names in hello.features (PROTOCOL.md section 10). */
export const CLIENT_FEATURES = [FEATURE_WELCOME_FEATURES, FEATURE_STREAM, FEATURE_COST, FEATURE_RESUME, FEATURE_DIRECT];

export interface GenerateOptions {
  // auto (the default): greedy (match at temperature > 0) planned each round: speculate, keep a stream
  // waiting behind each tree in flight, stream after a miss where that is faster (or cheaper)
  mode?: "auto" | "greedy" | "match" | "ar";
  objective?: Objective; // auto: latency (default) or cost
  plan?: Partial<AutoPlan>;
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
  // pre-speculation: while a tree is verified, draft the tree for its likeliest outcome and send it
  // conditional on that outcome (PROTOCOL.md section 5); when the outcome holds, the server goes on
  // without waiting for the edge (no round trip, no drafting on the critical path)
  prespec?: (committed: readonly number[], tree: Tree) => Promise<Conditional | null>;
}

/** A tree drafted after `cond`, the predicted outcome of the tree in flight. */
export interface Conditional {
  cond: number[];
  tree: Tree;
}

/**
 * Whether a session at `from` may move to the verifier's own address `to` (welcome.direct): another
 * address, and never from wss:// to ws:// (the hello there would carry the API key in the clear).
 */
export function mayMove(from: string, to: string): boolean {
  return to !== from && !(from.startsWith("wss://") && !to.startsWith("wss://"));
}

/** What a verdict committed: `tokens`, the first `accepted` of them drafted tokens the target accepted. */
export interface VerdictInfo {
  round: number;
  tokens: number[];
  accepted: number; // tokens from the draft (at depths 1..accepted)
  bonus: boolean; // the last token is the target's own (a correction or the bonus)
  verifyMs: number;
  prespeculated: boolean; // the tree was pre-speculated: the server verified it without waiting for the edge
  cloudOnly: boolean; // the round had no drafted token (the draft model was still loading): the target's own
}

export interface Stats {
  rounds: number; // verdicts of tree rounds (round 0 not counted)
  tokens: number;
  tau: number; // tokens per verdict, bonus included
  draftedNodes: number;
  draftMs: number; // median ms of drafting a round's tree (on the critical path)
  msPerToken: number; // wall ms from the prompt to the last verdict, per generated token
  resumes: number; // dropped connections resumed during the generation
  hits: number; // verdicts after which the server went on with a pre-speculated tree at once
  hitRate: number; // hits / tree verdicts (0 without pre-speculation)
  lateHits: number; // outcomes predicted whose tree reached the server after its verdict (verified on arrival)
  cloudRounds: number; // verdicts of rounds sent without a drafted token (an empty tree, or a prompt without one)
  mode: string; // the mode verified on the wire (auto runs greedy or match)
  streams: number; // stream rounds sent (auto: a fallback waiting behind a tree, or chosen after a miss)
  streamed: number; // tokens the target streamed (verdicts of stream rounds)
  aheadTrees: number; // trees sent while the target streamed, below the committed sequence (re-rooted by the verifier)
  planStream: number; // auto's choices after a miss: stream ...
  planSpeculate: number; // ... or draft a tree
}

const newStats = (mode: string): Stats => ({
  rounds: 0, tokens: 0, tau: 0, draftedNodes: 0, draftMs: 0, msPerToken: 0, resumes: 0, hits: 0, hitRate: 0, lateHits: 0,
  cloudRounds: 0, mode, streams: 0, streamed: 0, aheadTrees: 0, planStream: 0, planSpeculate: 0,
});  // prettier-ignore

const median = (xs: number[]) => {
  if (!xs.length) return 0;
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

export class TreespecClient {
  welcome!: Welcome;
  committed: number[] = [];
  private inbox = new Inbox();
  private round = 0;
  private sentAt = 0;
  /** The network's share of a round, learned from verdicts (wall time - the server's verify_ms). */
  rttMs = 0;
  /** mode auto: the user's measured ms per token by kind of round, across generations */
  readonly realized = new Realized();
  last: Stats = newStats("greedy");
  /** Whether hello names CLIENT_FEATURES (off after a server of an earlier release refused them). */
  private features = true;

  private ws!: Socket;
  /** A session moved to its verifier's own address (welcome.direct): the connection it was opened on, open and idle. */
  private lease: Socket | null = null;
  /** Sessions moved to their verifier's own address. */
  moves = 0;
  private generation = 0; // sockets opened so far
  private current = 0; // the one in use (its events count)
  private urls: string[] = [];
  private urlIndex = 0;
  private fingerprint = "";
  private apiKey?: string;
  private resume: ResumeOptions | null = null;

  private constructor() {}

  private send(m: Message): void {
    if (!this.ws.open) throw new ConnectionLost("the connection to the verifier is closed");
    this.ws.send(encodeMessage(m));
  }

  /**
   * Open a session: `fingerprint` is the sha256 of the vocabulary (PROTOCOL.md section 8). `url` may
   * list replicas: a dropped connection is resumed on the next (round robin). With `resume`, a
   * verifier at its session cap (close 1013) is tried again with the resume backoff.
   */
  static async connect(url: string | string[], fingerprint: string, apiKey?: string, o: ConnectOptions = {}): Promise<TreespecClient> {
    const c = new TreespecClient();
    c.urls = typeof url === "string" ? [url] : [...url];
    if (!c.urls.length) throw new GenerationError("no verifier URL given");
    c.fingerprint = fingerprint;
    c.apiKey = apiKey;
    c.resume = o.resume === false ? null : { ...DEFAULT_RESUME, ...o.resume };
    // with resume, a verifier that says "try again later" (1013) is tried again after the backoff
    for (let tries = 1; ; tries++) {
      try {
        await c.open(c.urls[0]);
        return c;
      } catch (e) {
        const later = e instanceof ConnectionLost && e.closeCode === TRY_AGAIN_LATER;
        if (!later || !c.resume || tries >= c.resume.attempts) throw e;
        await sleep(backoff(c.resume, tries));
      }
    }
  }

  /**
   * A new socket and session on `url`: hello, welcome, the vocabulary checked. `resume`: the token of
   * the dropped session this one resumes (its verifier may still hold that session's KV cache).
   */
  private async open(url: string, resume?: string, moving = false): Promise<void> {
    if (!moving) this.dropLease();
    const gen = (this.current = ++this.generation); // a dead socket's late events are ignored
    this.inbox.reset();
    try {
      this.ws = await openSocket(url, this.apiKey, {
        message: (data) => gen === this.current && this.inbox.received(data),
        close: (code, reason) =>
          gen === this.current && this.inbox.push(new ConnectionLost(`the verifier closed the connection (${code}): ${reason}`, code)),
        error: (message) => gen === this.current && this.inbox.push(new ConnectionLost(`the connection to the verifier failed: ${message}`)),
      }, resume);  // prettier-ignore
    } catch (e) {
      throw new ConnectionLost((e as Error).message);
    }
    const key = this.apiKey && !this.ws.keyInHeader ? { api_key: this.apiKey } : {}; // a browser sends no headers
    const features = this.features ? { features: [...CLIENT_FEATURES], ...(resume ? { resume } : {}) } : {};
    this.send({ type: "hello", version: PROTOCOL_VERSION, vocab_fingerprint: this.fingerprint, client: "treespec-ts/0.1", ...key, ...features });
    let w: Message;
    try {
      w = await this.inbox.next();
    } catch (e) {
      if (!(e instanceof GenerationError && e.field === "features" && this.features)) throw e;
      // a server of an earlier release refuses hello.features: connect again without them
      this.features = false;
      this.ws.close(1000);
      return this.open(url, resume);
    }
    if (w.type !== "welcome") throw new GenerationError(`expected welcome, got ${w.type}`);
    if (w.vocab_fingerprint && w.vocab_fingerprint !== this.fingerprint) {
      throw new GenerationError(`the vocabulary is not the target's (${w.model_id})`, "VOCAB_MISMATCH", "vocab_fingerprint");
    }
    if (this.welcome && w.model_id !== this.welcome.model_id) {
      throw new GenerationError(`the verifier came back with another model (${w.model_id}, was ${this.welcome.model_id}): ` +
        "its tokens would not continue this output");  // prettier-ignore
    }
    this.welcome = w;
    this.round = 0;
    if (!moving && w.direct && w.resume && mayMove(url, w.direct)) await this.move(w);
  }

  /**
   * Take the session to the verifier's own address (welcome.direct, a fleet replica's): a hello there
   * naming its resume token carries it on over that socket, past the fleet's proxy; the first socket
   * stays open, idle, until the session ends. Any failure keeps the session where it is.
   */
  private async move(w: Welcome): Promise<void> {
    const first = this.ws, firstGen = this.current;
    try {
      await this.open(w.direct!, w.resume, true);
      if (this.welcome.session_id === w.session_id) {
        this.lease = first;
        this.moves++;
        return;
      }
      this.ws.close(1000); // a session of its own there: the offer was gone
    } catch {
      // (unreachable from here, or refused): the first socket carries the session
    }
    if (this.ws !== first && this.ws.open) this.ws.close(1000);
    this.ws = first;
    this.current = firstGen;
    this.inbox.reset();
    this.welcome = w;
  }

  private dropLease(): void {
    this.lease?.close(1000);
    this.lease = null;
  }

  /** The connection dropped: connect again (the next URL each attempt, with backoff). */
  private async reconnect(): Promise<void> {
    const r = this.resume!;
    const token = this.welcome?.resume; // the dropped session's, for the verifier that kept it
    let last: Error | null = null;
    for (let i = 0; i < r.attempts; i++) {
      if (i > 0) await sleep(backoff(r, i));
      this.urlIndex = (this.urlIndex + 1) % this.urls.length;
      try {
        await this.open(this.urls[this.urlIndex], token);
        return;
      } catch (e) {
        if (!(e instanceof ConnectionLost)) throw e;
        last = e;
      }
    }
    throw new ConnectionLost(`cannot reconnect to the verifier after ${r.attempts} attempts: ${last?.message}`);
  }

  /**
   * Generate from `prompt` (token ids); yields each verdict's new tokens as they are committed. A
   * dropped connection is resumed (ConnectOptions.resume): a new session whose prompt is every
   * committed token, so the output goes on exactly (the keyed sampler depends on seed and position),
   * with no token lost or repeated.
   */
  async *generate(prompt: number[], o: GenerateOptions = {}): AsyncGenerator<number[]> {
    const asked = o.mode ?? "auto";
    const auto = asked === "auto";
    const plan: AutoPlan = { ...DEFAULT_PLAN, ...o.plan, ...(o.objective ? { objective: o.objective } : {}) };
    if (plan.objective !== "latency" && plan.objective !== "cost") {
      throw new GenerationError(`objective must be latency or cost, got ${String(plan.objective)}`);
    }
    const mode = asked === "auto" ? this.autoMode(o.temperature ?? 0) : asked;
    const look: LookupOptions = { ...DEFAULT_LOOKUP, ...o.lookup };
    const source: TreeSource = o.draft ?? ((ctx) => lookupTree(ctx, { ...look, depth: Math.min(look.depth, this.welcome.limits.max_depth) }));
    const drafting: number[] = [];
    let lastNodes = 1; // nodes of the last tree drafted below the committed sequence
    const draft = async (ctx: number[]) => {
      const t = performance.now();
      const tree = fitTree(await source(ctx), this.welcome.limits.max_nodes, this.welcome.limits.max_depth);
      drafting.push(performance.now() - t);
      lastNodes = Math.max(1, tree.tokens.length);
      return tree;
    };
    const signal = o.signal;
    signal?.throwIfAborted();
    // the protocol's client checks of this session's frames (a new session after a drop: new checks)
    const ck: { c: ClientChecks } = { c: new ClientChecks(this.welcome) };
    let cancelled = false;
    const cancel = () => {
      if (!cancelled) {
        cancelled = true;
        ck.c.cancel();
        if (this.ws.open) this.send({ type: "cancel" }); // the verdict of the round in flight comes back done
      }
    };
    const maxNew = o.maxNewTokens ?? 128;
    const t0 = performance.now();
    this.committed = [...prompt];
    const st: Stats = newStats(mode);
    this.last = st;
    let hitRound = -1; // the last pre-speculated round the server took
    const cloud = new Set<number>(); // rounds sent with no drafted token
    // mode auto: whether the verifier takes stream rounds, the latest verdict's cost maps, the tokens
    // a tree round yields (an average), and the committed length a tree ahead of a stream was drafted at
    let streams = false;
    const cost: { forward: Record<string, number> | null; marginal: Record<string, number> | null } = { forward: null, marginal: null };
    let treeTokens: number | null = null;
    let treeVerdicts = 0;
    let aheadAt = -1;
    const kindOf = new Map<number, string>(); // auto: the kind of each tree round sent (Realized)
    let lastVerdictAt: number | null = null; // auto: when the previous verdict came
    // conditional trees and streams the server can still hold (max_pending besides the round in flight)
    const room = () => this.welcome.limits.max_pending - [...ck.c.outstanding].filter((r) => r !== ck.c.inFlight).length;
    const sendTree = (t: Tree): number => {
      const round = ++this.round;
      this.send({ type: "tree", round, base: t.base, cond: t.cond, tokens: t.tokens, parents: t.parents });
      ck.c.tree(round, t);
      return round;
    };
    const sendStream = (k: number) => {
      const round = ++this.round;
      const kk = Math.max(1, Math.min(k, maxNew - st.tokens));
      this.send({ type: "stream", round, k: kk });
      ck.c.stream(round);
      st.streams++;
    };
    const speculate = async (tree: Tree) => {
      if (!o.prespec || cancelled || room() < 1) return;
      const c = await o.prespec(this.committed, tree);
      if (!c || !this.ws.open || cancelled || room() < 1) return;
      st.draftedNodes += c.tree.tokens.length;
      kindOf.set(sendTree({ base: this.committed.length, cond: c.cond, tokens: c.tree.tokens, parents: c.tree.parents }), "prespec");
    };
    // auto, objective latency: a stream waits behind the tree in flight, so a miss never idles the verifier
    const fallback = () => {
      if (!streams || plan.objective !== "latency" || cancelled || !this.ws.open) return;
      const c = ck.c;
      if (c.inFlight === null || c.isStream(c.inFlight) || c.waitingStream() !== null || room() < 1) return;
      sendStream(maxNew - st.tokens);
    };
    const withZero = (m: Record<string, number>) => ("0" in m || !Object.keys(m).length ? m : { "0": costAt(m, 1), ...m });
    // auto after a miss: stream when that is faster (latency) or cheaper (cost) than speculating
    const streamPays = (): boolean => {
      // the trees drafted after a miss measured slower than the stream: stream, whatever the prices
      if (measuredSlower(plan, this.realized, ["chain", "tree"])) return true;
      const fwd = withZero(cost.forward ?? this.welcome.verify_cost_ms);
      if (!Object.keys(fwd).length || treeTokens === null || !drafting.length) return false; // nothing measured yet
      const hitRate = o.prespec ? (treeVerdicts ? st.hits / treeVerdicts : 0.5) : 0;
      const p = { forward: fwd, marginal: withZero(cost.marginal ?? fwd), tokens: treeTokens, nodes: lastNodes,
                  draftMs: median(drafting), rttMs: this.rttMs, hitRate };  // prettier-ignore
      return choosePlan(plan, p) === "stream";
    };
    // while the target streams: a tree drafted below the committed sequence the edge knows, sent as
    // it is; the verifier re-roots it below the tokens streamed meanwhile where they follow one of
    // its paths (PROTOCOL.md section 5, checks.ts `reroot`) and verifies it instead of the next
    // stream step, so the stream hands over without a round trip (the Python edge's _draft_ahead)
    const ahead = async () => {
      const c = ck.c;
      if (!streams || cancelled || !this.ws.open || aheadAt === this.committed.length) return;
      if ([...c.outstanding].some((r) => !c.isStream(r)) || room() < 1) return; // a tree on its way may still take over
      // the stream goes on where it pays (asked again at its next token); where speculation has
      // measured slower, a tree goes only every exploreSlow tokens, to measure it again
      const slow = measuredSlower(plan, this.realized);
      if (slow ? this.committed.length - Math.max(aheadAt, 0) < (plan.exploreSlow ?? 32) : streamPays()) return;
      aheadAt = this.committed.length;
      const known = [...this.committed];
      const t = await draft(known);
      // a session resumed meanwhile numbers its rounds again: the tree is no use to it
      // (a tree of depth 1 cannot re-root below a streamed token: the server would answer it stale)
      if (ck.c !== c || !t.parents.some((p) => p >= 0) || !c.generating || !this.ws.open || cancelled || room() < 1) return;
      if (!sameTokens(this.committed.slice(0, known.length), known)) return;
      st.draftedNodes += t.tokens.length;
      st.aheadTrees++;
      kindOf.set(sendTree({ base: known.length, cond: [], tokens: t.tokens, parents: t.parents }), "chain");
    };
    const start = async () => {
      // the prompt, or after a drop every committed token as a new session's prompt
      cloud.clear(); // a new session numbers its rounds again
      ck.c = new ClientChecks(this.welcome);
      if (cancelled) ck.c.cancel();
      streams = auto && mode !== "ar" && (this.welcome.features ?? []).includes(FEATURE_STREAM);
      cost.forward = cost.marginal = null;
      aheadAt = -1;
      kindOf.clear();
      lastVerdictAt = null; // the prompt's first verdict (its prefill) is not timed
      let first = mode === "ar" ? undefined : await draft(this.committed);
      if (first && !first.tokens.length) {
        first = undefined; // the server answers a prompt without a tree with the target's first token
        cloud.add(0);
      }
      st.draftedNodes += first?.tokens.length ?? 0;
      this.send({
        type: "prompt", tokens: this.committed, mode, temperature: mode === "greedy" ? 0 : o.temperature ?? 0,
        top_k: o.topK ?? 0, top_p: o.topP ?? 1, seed: o.seed ?? 0, max_new_tokens: maxNew - st.tokens,
        stop_ids: o.stopIds ?? [], continue: false, ...(first ? { tree: first } : {}),
      });  // prettier-ignore
      ck.c.prompt(this.committed, mode, maxNew - st.tokens, first);
      if (first) await speculate(first);
      fallback();
    };
    // nothing in flight (a miss with no stream waiting, a stream that ended, a tree refused): the next round
    const afterMiss = async () => {
      if (streams && streamPays()) {
        st.planStream++;
        if (this.ws.open) sendStream(plan.chunk);
        return;
      }
      if (streams) st.planSpeculate++;
      const t = await draft(this.committed);
      st.draftedNodes += t.tokens.length;
      if (!t.tokens.length) cloud.add(this.round + 1);
      if (!this.ws.open) return;
      kindOf.set(sendTree(t), "chain");
      this.sentAt = performance.now();
      await speculate(t);
      fallback();
    };
    const checked = <T>(f: () => T): T => {
      try {
        return f();
      } catch (e) {
        if (e instanceof ProtocolError) throw new GenerationError(`the verifier broke the protocol: ${e.message}`, e.code, e.field ?? undefined);
        throw e;
      }
    };
    await start();
    let verdicts = 0;
    let stalls = 0; // drops in a row with no new token
    let droppedAt = -1;
    signal?.addEventListener("abort", cancel, { once: true });
    if (signal?.aborted) cancel(); // aborted while the first tree was drafted
    try {
      for (;;) {
        let m: Message;
        try {
          m = await this.inbox.next();
        } catch (e) {
          if (!(e instanceof ConnectionLost) || !this.resume || cancelled) throw e;
          if (st.tokens >= maxNew) return;
          stalls = st.tokens === droppedAt ? stalls + 1 : 1;
          droppedAt = st.tokens;
          if (stalls > this.resume.attempts) {
            throw new ConnectionLost(`the verifier dropped the connection ${stalls} times in a row with no new token ` +
              `(${st.tokens} committed): giving up; last: ${e.message}`);  // prettier-ignore
          }
          if (stalls > 1) await sleep(backoff(this.resume, stalls - 1));
          await this.reconnect();
          st.resumes++;
          await start();
          continue;
        }
        if (m.type === "stale") {
          const wasInFlight = ck.c.inFlight === m.round;
          const round = m.round;
          checked(() => ck.c.stale(round));
          // auto: the tree taken for the one in flight (on its way when the verdict came) was refused after all
          if (auto && wasInFlight && ck.c.generating && !cancelled && mode !== "ar") await afterMiss();
          continue;
        }
        if (m.type === "error") {
          const refused = auto && !m.fatal && m.code === "TOO_MANY_PENDING" && m.round !== undefined && m.round !== ck.c.inFlight
            && ck.c.outstanding.has(m.round);  // prettier-ignore
          if (refused) {
            // auto: a conditional tree or a waiting stream the server had no room for is dropped, like a stale one
            ck.c.error(m.code, m.round);
            continue;
          }
          throw new GenerationError(`verifier refused: ${m.code} (${m.field}): ${m.message}`, m.code, m.field);
        }
        if (m.type !== "verdict") throw new ProtocolError("BAD_ORDER", `unexpected ${m.type}`, "type", true);
        const v = m as Verdict;
        const wasStream = ck.c.isStream(v.round);
        const hadTree = !wasStream && (v.round > 0 || !cloud.has(0));
        checked(() => ck.c.verdict(v)); // before anything of it is committed
        this.committed.push(...v.tokens);
        if (v.committed_len !== this.committed.length) {
          throw new GenerationError(`committed_len ${v.committed_len} but ${this.committed.length} tokens held`);
        }
        if (v.forward_ms) {
          cost.forward = v.forward_ms;
          cost.marginal = v.marginal_ms ?? v.forward_ms;
        }
        verdicts++;
        if (streams) {
          const now = performance.now();
          if (lastVerdictAt !== null) this.realized.observe(wasStream ? "stream" : kindOf.get(v.round) ?? "tree", v.tokens.length, now - lastVerdictAt);
          lastVerdictAt = now;
        }
        if (wasStream) st.streamed += v.tokens.length;
        else if (v.round > 0) {
          st.rounds++;
          const net = Math.max(0, performance.now() - this.sentAt - v.verify_ms);
          this.rttMs = st.rounds === 1 ? net : 0.8 * this.rttMs + 0.2 * net;
        }
        if (hadTree && mode !== "ar") {
          treeVerdicts++;
          treeTokens = treeTokens === null ? v.tokens.length : 0.8 * treeTokens + 0.2 * v.tokens.length;
        }
        if (cloud.has(v.round) && !wasStream) st.cloudRounds++;
        st.tokens += v.tokens.length;
        st.tau = st.tokens / verdicts;
        st.msPerToken = (performance.now() - t0) / Math.max(1, st.tokens);
        st.draftMs = median(drafting);
        o.onVerdict?.({ round: v.round, tokens: [...v.tokens], accepted: v.accepted_nodes.length, bonus: v.has_bonus,
                        verifyMs: v.verify_ms, prespeculated: v.round === hitRound,
                        cloudOnly: cloud.has(v.round) && !wasStream });  // prettier-ignore
        if (v.tokens.length) yield v.tokens;
        if (v.done) {
          if (cancelled && v.reason === "cancelled") throw signal?.reason ?? new DOMException("cancelled", "AbortError");
          return;
        }
        if (auto) {
          if (mode === "ar" || cancelled) continue;
          const nxt = ck.c.inFlight;
          if (nxt !== null && ck.c.isStream(nxt)) {
            await ahead(); // the target streams (a fallback started after a miss, or one going on)
          } else if (nxt !== null) {
            // a tree in flight: pre-speculated for this outcome, or sent ahead of the stream that just
            // ended for it (re-rooted below the tokens it streamed)
            if (v.next_round === nxt) {
              st.hits++;
              hitRound = nxt;
            } else st.lateHits++;
            st.hitRate = st.hits / verdicts;
            this.sentAt = performance.now();
            const t = ck.c.verifying(); // the tree the server verifies, rooted at the committed sequence
            if (t) await speculate(t);
            fallback();
          } else await afterMiss();
          continue;
        }
        const taken = mode === "ar" ? null : ck.c.verifying();
        const nxt = ck.c.inFlight;
        if (nxt !== null && taken !== null) {
          // the outcome was predicted (or, in greedy and match, a longer one along the tree's own
          // path: the server re-roots it): the server goes on with the pre-speculated tree (at once,
          // or as soon as it arrives when it came after the verdict was sent); draft the one after it
          if (v.next_round === nxt) {
            st.hits++;
            hitRound = nxt;
          } else st.lateHits++;
          st.hitRate = st.hits / verdicts;
          this.sentAt = performance.now();
          await speculate(taken);
        } else if (mode !== "ar" && !cancelled) {
          // a miss (a pending tree is answered stale): draft from what was committed
          const t = await draft(this.committed);
          st.draftedNodes += t.tokens.length;
          if (!t.tokens.length) cloud.add(this.round + 1);
          // a socket that just closed: its close event is next in the inbox, and resumes
          if (this.ws.open) sendTree(t);
          this.sentAt = performance.now();
          st.hitRate = st.hits / verdicts;
          if (this.ws.open) await speculate(t);
        }
      }
    } finally {
      signal?.removeEventListener("abort", cancel);
    }
  }

  /** The mode auto verifies in: greedy at temperature 0, match above, ar where the key allows neither. */
  private autoMode(temperature: number): "greedy" | "match" | "ar" {
    const want = temperature > 0 ? "match" : "greedy";
    return this.welcome.allowed_modes.includes(want) ? want : "ar";
  }

  close(): void {
    if (this.ws.open) {
      this.send({ type: "close" });
      this.ws.close(1000);
    }
    this.dropLease();
  }
}
