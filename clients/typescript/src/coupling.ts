// Coupled drafting for mode `match` (PROTOCOL.md section 7; the Python edge's trees.Coupling): the
// verifier samples the token at absolute position `pos` by inverse CDF of the target's distribution
// at a uniform keyed by the session's seed and `pos`. The edge chose the seed, so it draws with the
// same uniform from the draft's own distribution: wherever the two distributions are close, that is
// the very token the target samples, and it leads each node's children. Exactness never depends on
// it (the verifier samples from the target whatever the tree); only how many drafted tokens are
// accepted does.

const MASK = (1n << 64n) - 1n;
const GOLDEN = 0x9e3779b97f4a7c15n;
const BELOW_ONE = 1 - 2 ** -50; // the threshold stays strictly below the total: no zero-mass token
const MIN_SCALED_TEMPERATURE = 1e-30; // below it, logits / T is taken at its limit (mass on the maxima)

function mix64(x: bigint): bigint {
  x = ((x ^ (x >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK;
  x = ((x ^ (x >> 27n)) * 0x94d049bb133111ebn) & MASK;
  return x ^ (x >> 31n);
}

/** The uniform in [0, 1) that samples the token at absolute `pos` of a session seeded `seed`. */
export function keyedUniform(seed: bigint | number, pos: number): number {
  const s = BigInt.asUintN(64, BigInt(seed));
  const h = mix64((mix64(s) + (BigInt(pos) + 1n) * GOLDEN) & MASK);
  return Number(h >> 11n) * 2 ** -53;
}

/** The sampling settings of a `match` generation, as sent in its prompt. */
export interface Coupling {
  seed: bigint | number;
  temperature: number; // > 0
  topK?: number; // 0: all
  topP?: number; // 1: all
}

/** Tempered probabilities (float64, summing to 1) of a row of logits. */
function probabilities(logits: Float32Array, temperature: number): Float64Array {
  const n = logits.length;
  const p = new Float64Array(n);
  let m = -Infinity;
  for (let i = 0; i < n; i++) if (logits[i] > m) m = logits[i];
  if (temperature < MIN_SCALED_TEMPERATURE) {
    let ties = 0;
    for (let i = 0; i < n; i++) if (logits[i] === m) ties++;
    for (let i = 0; i < n; i++) p[i] = logits[i] === m ? 1 / ties : 0;
    return p;
  }
  const top = m / temperature;
  let sum = 0;
  for (let i = 0; i < n; i++) {
    p[i] = Math.exp(logits[i] / temperature - top);
    sum += p[i];
  }
  for (let i = 0; i < n; i++) p[i] /= sum;
  return p;
}

/** The ids kept by top-k then top-p (shared/sparse.py truncate), in id order; null: all. */
function kept(p: Float64Array, topK: number, topP: number): number[] | null {
  if (topK <= 0 && topP >= 1) return null;
  const ids: number[] = [];
  for (let i = 0; i < p.length; i++) if (p[i] > 0) ids.push(i);
  ids.sort((a, b) => p[b] - p[a] || a - b); // most likely first, ties by id (a stable sort)
  let keep = topK > 0 ? ids.slice(0, topK) : ids;
  if (topP < 1) {
    let total = 0;
    for (const i of keep) total += p[i];
    let cum = 0;
    let n = keep.length;
    for (let j = 0; j < keep.length; j++) {
      cum += p[keep[j]];
      if (cum / total >= topP) {
        n = j + 1;
        break;
      }
    }
    keep = keep.slice(0, n);
  }
  return keep.sort((a, b) => a - b);
}

/** The draft's token at absolute `pos`: inverse CDF (token-id order) at the keyed uniform there. */
export function coupledToken(logits: Float32Array, pos: number, c: Coupling): number {
  if (!(c.temperature > 0)) throw new RangeError("coupling needs temperature > 0 (temperature 0 is greedy)");
  const p = probabilities(logits, c.temperature);
  const ids = kept(p, c.topK ?? 0, c.topP ?? 1);
  const n = ids ? ids.length : p.length;
  const at = (j: number) => (ids ? p[ids[j]] : p[j]);
  let total = 0;
  for (let j = 0; j < n; j++) total += at(j);
  const threshold = Math.min(keyedUniform(c.seed, pos) * total, total * BELOW_ONE);
  let cum = 0;
  for (let j = 0; j < n; j++) {
    cum += at(j);
    if (cum > threshold) return ids ? ids[j] : j;
  }
  return ids ? ids[n - 1] : n - 1;
}
