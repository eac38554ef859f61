// Mode auto's plan: whether, after a miss, letting the target stream beats speculating (the Python
// edge's speculation.auto), priced from the verdict's cost maps. The session client
// (client.ts) asks it after each miss and re-exports every name here.

export type Objective = "latency" | "cost";

/** Mode auto's plan (the Python edge's speculation.auto.Plan). */
export interface AutoPlan {
  objective: Objective; // latency: the user's ms per token; cost: the verifier's, no slower than ar by more than maxSlowdown
  maxSlowdown: number;
  chunk: number; // tokens a stream chosen after a miss asks for before the edge plans again
  margin: number; // streaming replaces speculation only when this much faster (or cheaper)
  // while speculation has measured slower than the stream (Realized), a tree goes ahead of the
  // stream only every this many tokens, to measure it again (default 32)
  exploreSlow?: number;
}
export const DEFAULT_PLAN: AutoPlan = { objective: "latency", maxSlowdown: 1.25, chunk: 8, margin: 0.05, exploreSlow: 32 };

/** The kinds of round besides "stream" (the Python edge's auto.SPECULATIVE_KINDS). */
export const SPECULATIVE_KINDS = ["chain", "tree", "prespec"];

interface Rate {
  keep: number;
  tokens: number;
  ms: number;
  seen: number;
}

/**
 * The user's measured ms per token by kind of round (the Python edge's auto.Realized): the wall
 * time from one verdict to the next over the tokens it brought, decayed (about the last 20 stream
 * steps, 7 trees). The check on the plan's prices: where a kind of speculation has cost the user
 * more per token than the stream, auto streams instead. Kept per client, across generations.
 */
export class Realized {
  private rates = new Map<string, Rate>();
  constructor(readonly minSeen = 4) {}

  observe(kind: string, tokens: number, ms: number): void {
    let r = this.rates.get(kind);
    if (!r) {
      r = { keep: kind === "stream" ? 0.95 : 0.85, tokens: 0, ms: 0, seen: 0 };
      this.rates.set(kind, r);
    }
    r.tokens = r.keep * r.tokens + tokens;
    r.ms = r.keep * r.ms + Math.max(ms, 0);
    r.seen++;
  }

  /** The pooled ms per token of `kinds` (null: none measured) and the verdicts it rests on. */
  msPerToken(kinds: string[]): [number | null, number] {
    let tokens = 0, ms = 0, seen = 0;  // prettier-ignore
    for (const k of kinds) {
      const r = this.rates.get(k);
      if (r) [tokens, ms, seen] = [tokens + r.tokens, ms + r.ms, seen + r.seen];
    }
    return [tokens > 0 ? ms / tokens : null, seen];
  }

  /** Rounds of `kinds` cost the user more per token than the stream by more than `margin`. */
  slower(margin: number, kinds: string[] = SPECULATIVE_KINDS): boolean {
    const [spec, nSpec] = this.msPerToken(kinds);
    const [stream, nStream] = this.msPerToken(["stream"]);
    if (spec === null || stream === null || Math.min(nSpec, nStream) < this.minSeen) return false;
    return spec > (1 + margin) * stream;
  }
}

/** The plan's allowance applied to the measurement (latency: its margin; cost: its allowed slowdown). */
export function measuredSlower(plan: AutoPlan, r: Realized, kinds: string[] = SPECULATIVE_KINDS): boolean {
  return r.slower(plan.objective === "latency" ? plan.margin : plan.maxSlowdown - 1, kinds);
}

/** ms at `nodes` from a cost map (linear between its points, flat outside them). */
export function costAt(curve: Record<string, number>, nodes: number): number {
  const xs = Object.keys(curve).map(Number).sort((a, b) => a - b);
  if (!xs.length) return NaN;
  if (nodes <= xs[0]) return curve[String(xs[0])];
  for (let i = 1; i < xs.length; i++) {
    if (nodes <= xs[i]) {
      const [x0, x1] = [xs[i - 1], xs[i]];
      const [y0, y1] = [curve[String(x0)], curve[String(x1)]];
      return y0 + ((y1 - y0) * (nodes - x0)) / (x1 - x0);
    }
  }
  return curve[String(xs[xs.length - 1])];
}

/** What mode auto weighs after a miss (the Python edge's auto.price_speculation / price_stream). */
export interface Pricing {
  forward: Record<string, number>; // the verdict's forward_ms (0: a stream step)
  marginal: Record<string, number>; // its marginal_ms
  tokens: number; // expected tokens of a speculative round (accepted + bonus)
  nodes: number; // its tree's nodes
  draftMs: number; // drafting a tree after a miss
  rttMs: number;
  hitRate: number; // odds the next tree is already at the server (pre-speculation)
}

/** "stream" when letting the target stream beats speculating under the plan, else "speculate". */
export function choosePlan(plan: AutoPlan, p: Pricing): "stream" | "speculate" {
  const miss = (1 - Math.min(Math.max(p.hitRate, 0), 1)) * (p.draftMs + p.rttMs);
  const t = Math.max(p.tokens, 1e-9);
  const spec = { user: (costAt(p.forward, p.nodes) + miss) / t, cloud: costAt(p.marginal, p.nodes) / t };
  const stream = { user: costAt(p.forward, 0), cloud: costAt(p.marginal, 0) };
  const keep = 1 - plan.margin;
  if (plan.objective === "latency") return stream.user < keep * spec.user ? "stream" : "speculate";
  // cost: the least verifier ms per token among the options no slower than ar (the stream) by more than maxSlowdown
  if (spec.user <= plan.maxSlowdown * stream.user) return stream.cloud < keep * spec.cloud ? "stream" : "speculate";
  return "stream";
}
