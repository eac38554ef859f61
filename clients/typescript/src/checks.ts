// The session protocol's client side (the checks of shared/client_protocol.py): every verdict is
// checked against what the client sent before anything of it is committed (a verifier that breaks
// the protocol must not leave a token in the output), and the round the server is verifying is
// tracked: the prompt's, a tree sent with none in flight that matches, a verdict's next_round, a
// stream round while its verdicts say `streaming`, or the latest outstanding tree that matches the
// committed sequence (still on its way: the server verifies it on arrival). In greedy and match a
// tree the committed sequence has grown past along one of its own paths counts as its re-rooted
// subtree (`reroot`, PROTOCOL.md section 5): the server verifies that, and its verdict's
// accepted_nodes index it.
import { type Message, ProtocolError, type Tree } from "./protocol.js";

type Welcome = Extract<Message, { type: "welcome" }>;
type Verdict = Extract<Message, { type: "verdict" }>;

/** Whether `tree` (its base and cond) matches the committed sequence (PROTOCOL.md section 5). */
export function treeMatches(tree: Pick<Tree, "base" | "cond">, committed: readonly number[]): boolean {
  if (tree.base + tree.cond.length !== committed.length) return false;
  return tree.cond.every((t, i) => committed[tree.base + i] === t);
}

type Shape = Pick<Tree, "base" | "cond" | "tokens" | "parents" | "draws">;

/**
 * The node at which the committed tokens past the tree's assumption (base + cond) leave off, walking
 * from row 0 (each the first child in node order with that token; -1: none are past it, the tree
 * matches as sent), or null when the committed sequence contradicts the tree (shared.tree.reroot_path).
 */
export function rerootPath(tree: Shape, committed: readonly number[]): number | null {
  const n = committed.length;
  const k = tree.base + tree.cond.length;
  if (tree.base > n || k > n) return null;
  if (!tree.cond.every((t, i) => committed[tree.base + i] === t)) return null;
  let node = -1;
  for (let j = k; j < n; j++) {
    const child = tree.parents.findIndex((p, i) => p === node && tree.tokens[i] === committed[j]);
    if (child < 0) return null;
    node = child;
  }
  return node;
}

/**
 * A deterministic tree re-rooted where the committed sequence has grown along one of its paths
 * (PROTOCOL.md section 5, shared.tree.reroot): the nodes below that path's end in their order, that
 * node's children as the new depth-1 nodes, cond extended by the path's tokens, base unchanged (every
 * node keeps its absolute position); `index`: each node's index in `tree`. The tree itself when it
 * matches as sent; null when the sequence contradicts it, the path ends at a leaf, or the tree is
 * stochastic (draws) and does not match as sent.
 */
export function reroot<T extends Shape>(tree: T, committed: readonly number[]): { tree: T | Tree; index: number[] } | null {
  const node = rerootPath(tree, committed);
  if (node === null) return null;
  if (node === -1) return { tree, index: tree.tokens.map((_, i) => i) };
  if (tree.draws !== undefined) return null; // stochastic trees are never re-rooted
  const index: number[] = [];
  const renumber = new Map<number, number>([[node, -1]]);
  tree.parents.forEach((p, i) => {
    if (renumber.has(p)) {
      // parents precede their children: one pass finds the subtree
      renumber.set(i, index.length);
      index.push(i);
    }
  });
  if (!index.length) return null;
  const sub: Tree = {
    base: tree.base,
    cond: committed.slice(tree.base),
    tokens: index.map((i) => tree.tokens[i]),
    parents: index.map((i) => renumber.get(tree.parents[i])!),
  };
  return { tree: sub, index };
}

/** Whether a mode's trees are re-rooted (the deterministic ones). */
export const rerooting = (mode: string) => mode === "greedy" || mode === "match";

const bad = (code: string, msg: string, field: string) => new ProtocolError(code, msg, field, false);

export class ClientChecks {
  committed: number[] = [];
  mode = "greedy";
  /** Rounds sent (trees and streams), not yet answered. */
  readonly outstanding = new Set<number>();
  /** The round the server is verifying, as far as the client knows (null: none). */
  inFlight: number | null = null;
  /** The stream round whose verdicts are coming, one a token. */
  streaming: number | null = null;
  lastRound = 0;
  private lastVerdictRound = 0;
  private trees = new Map<number, Tree>();
  private streams = new Set<number>(); // the outstanding rounds that are streams (0: the prompt's)
  private awaitingPrompt = false;
  private promptTree: Tree | null = null;
  private maxNew = 0;
  private generated = 0;
  private cancelling = false;
  generating = false;

  constructor(readonly welcome: Welcome) {}

  /** A prompt sent: the generation starts from `committed`. */
  prompt(committed: readonly number[], mode: string, maxNewTokens: number, tree?: Tree, stream = 0): void {
    this.committed = [...committed];
    this.mode = mode;
    this.maxNew = maxNewTokens;
    this.generated = 0;
    this.awaitingPrompt = true;
    this.promptTree = tree ?? null;
    this.streams = new Set(stream ? [0] : []);
    this.outstanding.clear();
    this.trees.clear();
    this.streaming = null;
    this.cancelling = false;
    this.inFlight = 0;
    this.generating = true;
  }

  private order(round: number): void {
    if (!this.generating) throw bad("BAD_ORDER", "no generation is running", "state");
    if (this.mode === "ar") throw bad("BAD_ORDER", "mode ar takes no trees or streams", "round");
    if (round <= this.lastRound) throw bad("BAD_ORDER", `round ${round} is not after ${this.lastRound}`, "round");
    this.lastRound = round;
    this.outstanding.add(round);
  }

  /** A tree sent as round `round`. */
  tree(round: number, tree: Tree): void {
    this.order(round);
    this.trees.set(round, tree);
    if (this.inFlight === null && this.usable(tree) !== null) this.inFlight = round;
  }

  /**
   * What the server verifies for `tree` against the committed sequence: the tree when it matches; in
   * greedy and match also its re-rooted subtree (`reroot`); else null.
   */
  usable(tree: Tree): Tree | null {
    if (rerooting(this.mode)) return reroot(tree, this.committed)?.tree ?? null;
    return treeMatches(tree, this.committed) ? tree : null;
  }

  /** The tree the server verifies as the round in flight (re-rooted where it is), or null (none, or a stream). */
  verifying(): Tree | null {
    if (this.inFlight === null || this.streams.has(this.inFlight)) return null;
    if (this.inFlight === 0) return this.awaitingPrompt ? this.promptTree : null;
    const t = this.trees.get(this.inFlight);
    return t === undefined ? null : this.usable(t);
  }

  /** A stream round sent: in flight at once when nothing is, else it waits at the server for a miss. */
  stream(round: number): void {
    this.order(round);
    this.streams.add(round);
    if (this.inFlight === null) this.inFlight = round;
  }

  cancel(): void {
    this.cancelling = true;
  }

  /** Round `rnd` is a stream round (0: the prompt's, when it streams). */
  isStream(rnd: number | null): boolean {
    return rnd !== null && this.streams.has(rnd);
  }

  /** The outstanding stream round not yet started (the server's fallback for a miss). */
  waitingStream(): number | null {
    const waiting = [...this.streams].filter((r) => r !== 0 && this.outstanding.has(r) && r !== this.streaming && r !== this.inFlight);
    return waiting.length ? Math.max(...waiting) : null;
  }

  /** The tree sent as `round`, while it is outstanding. */
  treeOf(round: number): Tree | undefined {
    return this.trees.get(round);
  }

  /** The latest outstanding tree that matches the committed sequence (or, in greedy and match, re-roots on it). */
  matchingOutstanding(): number | null {
    const found = [...this.outstanding].filter((r) => this.trees.has(r) && this.usable(this.trees.get(r)!) !== null);
    return found.length ? Math.max(...found) : null;
  }

  private settle(rnd: number): void {
    this.outstanding.delete(rnd);
    this.trees.delete(rnd);
    this.streams.delete(rnd);
  }

  /** A stale frame: that round will never be verified. */
  stale(rnd: number): void {
    if (!this.outstanding.has(rnd)) throw bad("BAD_ORDER", `stale for round ${rnd} never sent`, "round");
    this.settle(rnd);
    if (this.inFlight === rnd) this.inFlight = null;
  }

  /** A non-fatal error about `rnd` (refused, or BUSY: the generation is over). */
  error(code: string, rnd: number | undefined): void {
    if (rnd === undefined) return;
    if (code === "BUSY") {
      this.generating = false;
      this.inFlight = null;
      return;
    }
    if (rnd === 0 && this.awaitingPrompt) {
      this.awaitingPrompt = false;
      this.generating = false;
    } else this.settle(rnd);
    if (this.inFlight === rnd) this.inFlight = null;
  }

  /** Check a verdict (ProtocolError if the server broke the protocol), then commit it and move the round in flight. */
  verdict(v: Verdict): void {
    if (!this.generating) throw bad("BAD_ORDER", "a verdict with no generation running", "state");
    let tree: Tree | null = null;
    const stream = this.streams.has(v.round) && (v.round === 0 || this.outstanding.has(v.round));
    if (v.streaming && (v.done || !stream)) {
      const why = v.done ? "a verdict that ends the generation" : `round ${v.round}, not a stream`;
      throw bad("BAD_MESSAGE", `streaming on ${why}`, "streaming");
    }
    if (stream && (v.accepted_nodes.length || (v.tokens.length !== 1 && !v.done))) {
      throw bad("BAD_MESSAGE", "a stream's verdict holds one token and no nodes", "tokens");
    }
    if (v.round !== 0 && v.round === this.streaming) {
      // the next token of the stream in progress
    } else if (v.round === 0) {
      if (!(this.awaitingPrompt || this.mode === "ar" || this.cancelling)) throw bad("BAD_ORDER", "unexpected round-0 verdict", "round");
      if (this.awaitingPrompt) tree = this.promptTree;
    } else {
      // a waiting stream starts after later trees (the fallback for a miss): rounds of trees are
      // verified in order, a stream whenever a miss needs it, and an earlier tree only as the round
      // the client knows in flight (one that stayed pending while a later one was verified, and
      // matches or re-roots on what that one committed: the server takes it then)
      const late = v.round <= this.lastVerdictRound && !stream && v.round !== this.inFlight;
      if (!this.outstanding.has(v.round) || late) throw bad("BAD_ORDER", `verdict for round ${v.round} not outstanding`, "round");
      const sent = this.trees.get(v.round);
      // the tree the server verified: the one sent, or its subtree re-rooted below the committed sequence
      tree = sent === undefined ? null : this.usable(sent);
      if (sent !== undefined && tree === null) {
        throw bad("BAD_ORDER", `verdict for round ${v.round}, whose tree does not match the committed sequence`, "round");
      }
    }
    this.checkTokens(v, tree);
    if (v.committed_len !== this.committed.length + v.tokens.length) {
      throw bad("BAD_MESSAGE", `committed_len ${v.committed_len} but the client holds ${this.committed.length + v.tokens.length} tokens`,
        "committed_len");  // prettier-ignore
    }
    if (v.next_round !== undefined && (!this.outstanding.has(v.next_round) || v.next_round === v.round)) {
      throw bad("BAD_ORDER", `next_round ${v.next_round} was never sent`, "next_round");
    }
    // consistent with what was sent: commit it
    this.streaming = v.streaming ? v.round : null;
    if (v.streaming) {
      // the round goes on
    } else if (v.round === 0) {
      this.awaitingPrompt = false;
      this.streams.delete(0);
    } else {
      this.settle(v.round);
      this.lastVerdictRound = Math.max(this.lastVerdictRound, v.round);
    }
    this.committed.push(...v.tokens);
    this.generated += v.tokens.length;
    if (v.done) {
      this.generating = false;
      this.inFlight = null;
    } else if (this.mode === "ar") this.inFlight = 0;
    else this.inFlight = v.streaming ? v.round : (v.next_round ?? this.matchingOutstanding());
  }

  private checkTokens(v: Verdict, tree: Tree | null): void {
    const w = this.welcome;
    const tokens = v.tokens;
    if (tokens.some((t) => t < 0 || t >= w.vocab_size)) {
      throw bad("OUT_OF_RANGE", `a token id outside the vocabulary [0, ${w.vocab_size}): ${tokens.slice(0, 16)}`, "tokens");
    }
    const room = this.maxNew - this.generated;
    if (tokens.length > room) {
      throw bad("LIMIT_EXCEEDED", `${tokens.length} tokens but max_new_tokens ${this.maxNew} leaves room for ${room}`, "tokens");
    }
    if (!v.done && (tokens.length === 0 || tokens.length === room)) {
      throw bad("BAD_MESSAGE", `a verdict with ${tokens.length === 0 ? "no token" : "max_new_tokens reached"} must be done`, "done");
    }
    if (this.committed.length + tokens.length > w.limits.max_context) {
      throw bad("LIMIT_EXCEEDED", `${tokens.length} tokens take the context over max_context ${w.limits.max_context}`, "tokens");
    }
    const acc = v.accepted_nodes;
    const n = tree === null ? 0 : tree.tokens.length;
    if (acc.some((i) => i < 0 || i >= n)) {
      throw bad("BAD_MESSAGE", `accepted nodes ${acc.slice(0, 16)} not in the tree of ${n} nodes`, "accepted_nodes");
    }
    if (tree !== null) {
      let parent = -1;
      for (const i of acc) {
        if (tree.parents[i] !== parent) throw bad("BAD_MESSAGE", "the accepted nodes are not a root-to-leaf path of the tree", "accepted_nodes");
        parent = i;
      }
      if (acc.some((i, j) => tokens[j] !== tree.tokens[i])) throw bad("BAD_MESSAGE", "the tokens are not the accepted nodes' tokens", "tokens");
    }
    if (!(acc.length <= tokens.length && tokens.length <= acc.length + 1)) {
      throw bad("BAD_MESSAGE", `${tokens.length} tokens for ${acc.length} accepted nodes (at most one bonus token)`, "tokens");
    }
    if (v.has_bonus !== (tokens.length === acc.length + 1)) throw bad("BAD_MESSAGE", "has_bonus disagrees with the tokens", "has_bonus");
  }
}
