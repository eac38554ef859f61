// A model-free drafter: prompt lookup. The continuation that followed the latest earlier occurrence
// of the context's last n-gram (n from maxNgram down to minNgram) is the guess; with width > 1 the
// continuations of several occurrences are merged into a tree (a trie: identical prefixes shared).
import type { Tree } from "./protocol.js";

export interface LookupOptions {
  maxNgram: number; // longest suffix to look for
  minNgram: number;
  depth: number; // tokens per guessed continuation
  width: number; // occurrences merged into the tree (1: a chain)
}

export const DEFAULT_LOOKUP: LookupOptions = { maxNgram: 4, minNgram: 1, depth: 8, width: 3 };

/** Guessed continuations of `ctx`, most recent occurrence first, each at most `depth` tokens. */
export function continuations(ctx: readonly number[], o: LookupOptions = DEFAULT_LOOKUP): number[][] {
  const out: number[][] = [];
  const seen = new Set<string>();
  for (let n = Math.min(o.maxNgram, ctx.length - 1); n >= o.minNgram && out.length < o.width; n--) {
    const tail = ctx.slice(ctx.length - n);
    for (let i = ctx.length - n - 1; i >= 0 && out.length < o.width; i--) {
      let hit = true;
      for (let j = 0; j < n && hit; j++) hit = ctx[i + j] === tail[j];
      if (!hit) continue;
      const cont = ctx.slice(i + n, i + n + o.depth);
      const key = cont.join(",");
      if (cont.length && !seen.has(key)) {
        seen.add(key);
        out.push(cont);
      }
    }
  }
  return out;
}

/** A deterministic tree (distinct siblings) holding the continuations, at committed length `base`. */
export function lookupTree(ctx: readonly number[], o: LookupOptions = DEFAULT_LOOKUP): Tree {
  const tokens: number[] = [];
  const parents: number[] = [];
  const child = new Map<string, number>(); // "parent:token" -> node
  for (const cont of continuations(ctx, o)) {
    let parent = -1;
    for (const t of cont) {
      const key = `${parent}:${t}`;
      let node = child.get(key);
      if (node === undefined) {
        node = tokens.length;
        tokens.push(t);
        parents.push(parent);
        child.set(key, node);
      }
      parent = node;
    }
  }
  return { base: ctx.length, cond: [], tokens, parents };
}

/** Cut a tree to at most `maxNodes` nodes and `maxDepth` levels (nodes are in topological order). */
export function fitTree(t: Tree, maxNodes: number, maxDepth: number): Tree {
  const depth: number[] = [];
  const keep: number[] = [];
  const index = new Map<number, number>();
  t.tokens.forEach((_, i) => {
    const p = t.parents[i];
    depth[i] = p < 0 ? 1 : depth[p] + 1;
    if (keep.length < maxNodes && depth[i] <= maxDepth && (p < 0 || index.has(p))) {
      index.set(i, keep.length);
      keep.push(i);
    }
  });
  return {
    base: t.base,
    cond: t.cond,
    tokens: keep.map((i) => t.tokens[i]),
    parents: keep.map((i) => (t.parents[i] < 0 ? -1 : index.get(t.parents[i])!)),
  };
}
