import assert from "node:assert/strict";
import { test } from "node:test";
import { continuations, fitTree, lookupTree } from "../src/lookup.js";

test("the continuation after the last n-gram's latest earlier occurrence", () => {
  const ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3];
  assert.deepEqual(continuations(ctx, { maxNgram: 3, minNgram: 1, depth: 4, width: 1 }), [[4, 5, 9, 1]]);
  assert.deepEqual(continuations([7, 8], { maxNgram: 3, minNgram: 1, depth: 4, width: 1 }), []);
});

test("several occurrences merge into a tree with shared prefixes and distinct siblings", () => {
  const ctx = [5, 1, 2, 8, 5, 1, 3, 5, 1];
  const t = lookupTree(ctx, { maxNgram: 2, minNgram: 1, depth: 3, width: 3 });
  assert.equal(t.base, ctx.length);
  for (let i = 0; i < t.tokens.length; i++) assert.ok(t.parents[i] < i);
  const sib = new Set(t.tokens.map((tok, i) => `${t.parents[i]}:${tok}`));
  assert.equal(sib.size, t.tokens.length);
  assert.deepEqual(t.tokens.slice(0, 2), [3, 5]); // the latest occurrence first: 5 1 -> 3 5 1
});

test("fitTree keeps whole paths within the limits", () => {
  const t = { base: 4, cond: [], tokens: [1, 2, 3, 4, 5], parents: [-1, 0, 1, 2, -1] };
  const f = fitTree(t, 3, 2);
  assert.deepEqual(f.tokens, [1, 2, 5]);
  assert.deepEqual(f.parents, [-1, 0, -1]);
});
