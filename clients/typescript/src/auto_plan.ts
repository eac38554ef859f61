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
}
export const DEFAULT_PLAN: AutoPlan = { objective: "latency", maxSlowdown: 1.25, chunk: 8, margin: 0.05 };

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
