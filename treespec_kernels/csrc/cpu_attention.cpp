// CPU kernels of the float32 target: batch-invariant tree attention, and the RMSNorm that feeds it.
//
// Batch-invariant tree attention.
//
// Every query row of a forward (a tree node, a prefill row or a lone decode step) attends to the
// keys it may see, and the result must not depend on what else is in the forward: a tree node's
// output has to equal, bit for bit, the output of decoding its root-to-node path one token at a
// time. A GEMM-based attention (SDPA, bmm) cannot promise that: its sums over keys and over the
// head dimension are blocked by the shapes of the call and by where masked keys sit.
//
// Here every reduction has an order fixed by the key's *position* in the sequence:
//   * a score is one chain of multiply-adds over the head dimension, d = 0, 1, ... (each key is
//     one vector lane, lanes never mix);
//   * a row's visible keys are compacted into position order (the committed prefix, then its
//     ancestors among the new rows), so the i-th visible key is the key at position i, exactly
//     as in a sequence decoded token by token;
//   * the softmax max is order-free; the exponentials are summed lane-wise over tiles of 16
//     positions, then lanes 0..15 in order; the weighted sum of values is one chain of
//     multiply-adds over positions 0, 1, ....
// Rows are register-blocked (ROWS at a time share every key and value load), which is what
// makes this about as fast as SDPA on the shapes of tree verification.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int W = 16;    // lanes per vector
constexpr int ROWS = 6;  // query rows per work item

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) {
  const vf one = {x};
  return __builtin_shuffle(one, vi{});  // lane 0 everywhere (vf{} + x would round -0.0 and cost an add)
}
// One rounding per step when the target has FMA (the build asks for contraction); either way
// the same expression is used for every key, so the order and rounding are the same everywhere.
inline vf madd(vf a, vf b, vf acc) { return a * b + acc; }

// exp(x) for x <= 0 (softmax arguments), within ~2 ulp; x below -87.3 (and -inf) gives 0.
inline vf exp_nonpos(vf x) {
  const vf lo = splat(-87.3365478515625f);
  const vi under = x < lo;
  x = under ? lo : x;
  const vf shift = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(1.44269502162933349609375f) + shift) - shift;
  vf r = x - n * splat(0.693145751953125f);
  r = r - n * splat(1.428606765330187045e-06f);
  vf p = splat(1.0f / 5040.0f);
  p = p * r + splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(vf));
  const vf out = p * scale;
  return under ? splat(0.0f) : out;
}

inline float lanes_sum(vf v) {
  float s = v[0];
  for (int j = 1; j < W; ++j) s += v[j];
  return s;
}

inline float lanes_max(vf v) {
  float m = v[0];
  for (int j = 1; j < W; ++j) m = std::max(m, v[j]);
  return m;
}

struct Problem {
  const float* q;         // [kv_heads, rows, hd]
  const float* kt;        // [kv_heads, slots / 16, hd, 16]: keys transposed within 16-slot tiles
  const float* v;         // [kv_heads, slots, hd]
  const int64_t* slots;   // [cached + n]: pool slot of each position
  float* out;             // [kv_heads, rows, hd]
  int64_t rows, n, cached, hd, nslots;
  float scale;
};

// Positions visible to new row i, in position order: [0, cached) then cached + j for allowed j.
struct RowKeys {
  std::vector<int64_t> tail;  // the allowed new rows j, increasing
  int64_t count = 0;          // cached + tail.size()
  int64_t identity = 0;       // leading keys whose compacted index equals their logical index
  int64_t last = 0;           // 1 + the largest logical index seen
};

template <int NV>
void run_item(const Problem& pb, const std::vector<RowKeys>& keys, int64_t head, int64_t r0,
              std::vector<float>& scratch) {
  const int64_t hd = pb.hd;
  const int64_t nr = std::min<int64_t>(ROWS, pb.rows - r0);
  // Padding rows repeat the last real row; their results are dropped.
  const RowKeys* rk[ROWS];
  int64_t rowid[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    rowid[r] = r0 + std::min<int64_t>(r, nr - 1);
    rk[r] = &keys[rowid[r] % pb.n];
  }
  int64_t span = 0, shared = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < ROWS; ++r) {
    span = std::max(span, rk[r]->last);
    shared = std::min(shared, rk[r]->identity);
  }
  const int64_t tiles = (span + W - 1) / W;
  const int64_t width = tiles * W;
  scratch.resize(static_cast<size_t>(ROWS * width + ROWS * hd + hd * W));
  float* S = scratch.data();                 // [ROWS, width] scores, then weights
  float* qs = S + ROWS * width;               // [ROWS, hd] scaled queries
  float* tile = qs + ROWS * hd;               // [hd, W] gathered keys when a tile is not one run

  for (int r = 0; r < ROWS; ++r) {
    const float* qr = pb.q + (head * pb.rows + rowid[r]) * hd;
    for (int64_t d = 0; d < hd; ++d) qs[r * hd + d] = qr[d] * pb.scale;
  }

  // Scores: each key is a lane; one multiply-add chain over d per (row, key).
  const float* kt_head = pb.kt + head * pb.nslots * hd;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t base = t * W;
    const int64_t valid = std::min<int64_t>(W, span - base);
    const int64_t s0 = pb.slots[base];
    bool run = s0 % W == 0;
    for (int64_t j = 1; run && j < valid; ++j) run = pb.slots[base + j] == s0 + j;
    const float* ptr;
    if (run) {
      ptr = kt_head + s0 * hd;  // tile s0 / W starts at (s0 / W) * hd * W
    } else {
      std::fill(tile, tile + hd * W, 0.0f);
      for (int64_t j = 0; j < valid; ++j) {
        const int64_t s = pb.slots[base + j];
        const float* src = kt_head + (s / W) * hd * W + s % W;
        for (int64_t d = 0; d < hd; ++d) tile[d * W + j] = src[d * W];
      }
      ptr = tile;
    }
    vf acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = splat(0.0f);
    for (int64_t d = 0; d < hd; ++d) {
      const vf kv = load(ptr + d * W);
      for (int r = 0; r < ROWS; ++r) acc[r] = madd(splat(qs[r * hd + d]), kv, acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) store(S + r * width + base, acc[r]);
  }

  // Compact each row's visible keys into position order, then softmax weights (unnormalised).
  float denom[ROWS];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < ROWS; ++r) {
    float* s = S + r * width;
    const RowKeys& k = *rk[r];
    int64_t w = pb.cached;
    for (int64_t j : k.tail) s[w++] = s[pb.cached + j];
    const int64_t padded = (k.count + W - 1) / W * W;
    for (int64_t i = k.count; i < padded; ++i) s[i] = neg_inf;
    vf m = splat(neg_inf);
    for (int64_t i = 0; i < padded; i += W) {
      const vf x = load(s + i);
      m = x > m ? x : m;
    }
    const vf mx = splat(lanes_max(m));
    vf sum = splat(0.0f);
    for (int64_t i = 0; i < padded; i += W) {
      const vf e = exp_nonpos(load(s + i) - mx);
      store(s + i, e);
      sum = sum + e;
    }
    denom[r] = lanes_sum(sum);
  }

  // Weighted values: one multiply-add chain over positions per (row, dim). Positions every
  // row sees at its own index run for all rows at once, the rest row by row.
  const float* v_head = pb.v + head * pb.nslots * hd;
  vf o[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) o[r][c] = splat(0.0f);
  for (int64_t i = 0; i < shared; ++i) {
    const float* vp = v_head + pb.slots[i] * hd;
    vf vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load(vp + c * W);
    for (int r = 0; r < ROWS; ++r) {
      const vf e = splat(S[r * width + i]);
      for (int c = 0; c < NV; ++c) o[r][c] = madd(e, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    const RowKeys& k = *rk[r];
    const float* s = S + r * width;
    for (int64_t i = shared; i < k.count; ++i) {
      const int64_t logical = i < pb.cached ? i : pb.cached + k.tail[i - pb.cached];
      const float* vp = v_head + pb.slots[logical] * hd;
      const vf e = splat(s[i]);
      for (int c = 0; c < NV; ++c) o[r][c] = madd(e, load(vp + c * W), o[r][c]);
    }
    float* dst = pb.out + (head * pb.rows + rowid[r]) * hd;
    const vf l = splat(denom[r]);
    for (int c = 0; c < NV; ++c) store(dst + c * W, o[r][c] / l);
  }
}

}  // namespace

// q: [kv_heads, rows, hd] with rows = group * n ordered group-major (row g * n + i is new row i
// of query head g of the group); kt: [kv_heads, slots / 16, hd, 16] and v: [kv_heads, slots, hd],
// the layer's whole pool (keys transposed within tiles of 16 slots); slots: [cached + n] int64;
// allowed: [n, n] bool (new row i may attend to new row j). Returns [kv_heads, rows, hd].
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor slots,
                             torch::Tensor allowed, int64_t cached, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kt.dtype() == torch::kFloat32 &&
                  v.dtype() == torch::kFloat32,
              "tree_attention: q, kt and v must be float32");
  TORCH_CHECK(q.dim() == 3 && kt.dim() == 4 && v.dim() == 3, "tree_attention: q, v must be 3-D, kt 4-D");
  TORCH_CHECK(q.is_contiguous() && kt.is_contiguous() && v.is_contiguous(),
              "tree_attention: q, kt and v must be contiguous");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous(),
              "tree_attention: slots must be contiguous 1-D int64");
  TORCH_CHECK(allowed.dtype() == torch::kBool && allowed.dim() == 2 && allowed.is_contiguous(),
              "tree_attention: allowed must be contiguous 2-D bool");
  const int64_t kvh = q.size(0), rows = q.size(1), hd = q.size(2), n = allowed.size(0);
  const int64_t nslots = v.size(1);
  TORCH_CHECK(kt.size(0) == kvh && v.size(0) == kvh && kt.size(2) == hd && v.size(2) == hd &&
                  kt.size(3) == W && kt.size(1) * W == nslots,
              "tree_attention: q, kt and v shapes disagree");
  TORCH_CHECK(allowed.size(1) == n && n > 0 && rows % n == 0, "tree_attention: allowed must be [n, n]");
  TORCH_CHECK(slots.size(0) == cached + n && cached >= 0, "tree_attention: slots must hold cached + n");
  TORCH_CHECK(hd % W == 0 && hd / W <= 8, "tree_attention: head_dim must be 16, 32, 48, ..., 128");

  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < cached + n; ++i)
    TORCH_CHECK(sl[i] >= 0 && sl[i] < nslots, "tree_attention: slot out of range");

  const uint8_t* al = reinterpret_cast<const uint8_t*>(allowed.data_ptr<bool>());
  std::vector<RowKeys> keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    RowKeys& k = keys[i];
    bool identity = true;
    k.identity = cached;
    for (int64_t j = 0; j < n; ++j) {
      if (!al[i * n + j]) {
        identity = false;
        continue;
      }
      k.tail.push_back(j);
      if (identity) k.identity = cached + j + 1;
    }
    k.count = cached + static_cast<int64_t>(k.tail.size());
    k.last = k.tail.empty() ? cached : cached + k.tail.back() + 1;
  }

  auto out = torch::empty_like(q);
  Problem pb{q.data_ptr<float>(), kt.data_ptr<float>(), v.data_ptr<float>(), sl, out.data_ptr<float>(),
             rows, n, cached, hd, nslots, static_cast<float>(scale)};
  const int64_t blocks = (rows + ROWS - 1) / ROWS;
  const int64_t items = kvh * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t head = it / blocks, r0 = (it % blocks) * ROWS;  // a head's keys stay in cache
      switch (hd / W) {
        case 1: run_item<1>(pb, keys, head, r0, scratch); break;
        case 2: run_item<2>(pb, keys, head, r0, scratch); break;
        case 3: run_item<3>(pb, keys, head, r0, scratch); break;
        case 4: run_item<4>(pb, keys, head, r0, scratch); break;
        case 5: run_item<5>(pb, keys, head, r0, scratch); break;
        case 6: run_item<6>(pb, keys, head, r0, scratch); break;
        case 7: run_item<7>(pb, keys, head, r0, scratch); break;
        default: run_item<8>(pb, keys, head, r0, scratch); break;
      }
    }
  });
  return out;
}

// kt: [kv_heads, slots / 16, hd, 16] (one layer of the pool's tiled keys); slots: [T] int64;
// k: [T, kv_heads, hd]. Stores row t's keys at slots[t]. A plain loop: for the few rows of a
// forward it costs a microsecond, where an advanced-index put starts a parallel region.
void write_tiled(torch::Tensor kt, torch::Tensor slots, torch::Tensor k) {
  TORCH_CHECK(kt.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32, "write_tiled: float32 only");
  TORCH_CHECK(kt.dim() == 4 && kt.is_contiguous() && kt.size(3) == W, "write_tiled: kt must be [h, s/16, d, 16]");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.dim() == 1, "write_tiled: slots must be 1-D int64");
  const int64_t kvh = kt.size(0), nblk = kt.size(1), hd = kt.size(2), rows = slots.size(0);
  TORCH_CHECK(k.dim() == 3 && k.size(0) == rows && k.size(1) == kvh && k.size(2) == hd,
              "write_tiled: k must be [len(slots), kv_heads, head_dim]");
  auto kc = k.contiguous();
  auto sc = slots.contiguous();
  const int64_t* sl = sc.data_ptr<int64_t>();
  const float* src = kc.data_ptr<float>();
  float* dst = kt.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < nblk * W, "write_tiled: slot out of range");
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t blk = sl[t] / W, lane = sl[t] % W;
    for (int64_t h = 0; h < kvh; ++h) {
      const float* row = src + (t * kvh + h) * hd;
      float* out = dst + ((h * nblk + blk) * hd) * W + lane;
      for (int64_t d = 0; d < hd; ++d) out[d * W] = row[d];
    }
  }
}

// The rotary embedding of one layer's new queries and keys, and the pool's store of the keys and
// values, in one pass: what Rotary.apply and PagedKVCache.write do as about a dozen ops a layer.
// qkv: [T, (heads + 2 kv_heads) hd] float32, the projection's output (queries, keys, values);
// cos, sin: [T, hd] (sin with its first half negated); slots: [T] int64, the pool slot of each
// row; k, v: [kv_heads, pool slots, hd] and kt: [kv_heads, pool slots / 16, hd, 16], one layer of
// the pool. Returns the rotated queries [T, heads, hd]. Each value is rounded as torch rounds
// addcmul(x * cos, swap(x), sin): the product x cos, then one fused multiply-add, so the bits are
// the unfused path's.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor k, torch::Tensor v, torch::Tensor kt, int64_t heads) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32 &&
                  k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 && kt.dtype() == torch::kFloat32,
              "rope_store: float32 only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.is_contiguous() && v.is_contiguous(),
              "rope_store: k and v must be contiguous [kv_heads, slots, hd]");
  const int64_t kvh = k.size(0), nslots = k.size(1), hd = k.size(2), rows = qkv.size(0);
  TORCH_CHECK(kt.dim() == 4 && kt.is_contiguous() && kt.size(0) == kvh && kt.size(1) * W == nslots &&
                  kt.size(2) == hd && kt.size(3) == W,
              "rope_store: kt must be [kv_heads, slots / 16, hd, 16]");
  TORCH_CHECK(hd % 2 == 0 && heads > 0, "rope_store: head_dim must be even, heads positive");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kvh) * hd && qkv.stride(1) == 1,
              "rope_store: qkv must be [rows, (heads + 2 kv_heads) head_dim] with unit column stride");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == hd && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rope_store: cos and sin must be contiguous [rows, head_dim]");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == rows && slots.is_contiguous(),
              "rope_store: slots must be contiguous [rows] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < nslots, "rope_store: slot out of range");
  auto q = torch::empty({rows, heads, hd}, qkv.options());
  const int64_t half = hd / 2, ld = qkv.stride(0);
  const float* src = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *ktp = kt.data_ptr<float>();
  std::vector<float> rk(hd);
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = src + t * ld;
    const float *c = cp + t * hd, *s = sp + t * hd;
    auto rotate = [&](const float* in, float* out) {
      for (int64_t d = 0; d < hd; ++d) {
        const float xc = in[d] * c[d];
        out[d] = std::fma(in[d < half ? d + half : d - half], s[d], xc);
      }
    };
    for (int64_t h = 0; h < heads; ++h) rotate(x + h * hd, qp + (t * heads + h) * hd);
    const int64_t slot = sl[t], blk = slot / W, lane = slot % W;
    for (int64_t h = 0; h < kvh; ++h) {
      rotate(x + (heads + h) * hd, rk.data());
      std::memcpy(kp + (h * nslots + slot) * hd, rk.data(), hd * sizeof(float));
      float* tile = ktp + ((h * (nslots / W) + blk) * hd) * W + lane;
      for (int64_t d = 0; d < hd; ++d) tile[d * W] = rk[d];
      std::memcpy(vp + (h * nslots + slot) * hd, x + (heads + kvh + h) * hd, hd * sizeof(float));
    }
  }
  return q;
}

// RMSNorm of each row of x [T, H] (float32, contiguous): y = (x * r) * w with r = 1 / sqrt(mean(x^2)
// + eps). The squares are summed in double (exactly, lane by lane in a fixed order) and r is
// rounded once to float32, so a row's result depends on that row alone. One call does what
// F.rms_norm does in five or six passes, each a separate op (about 40-80 us a call for a few
// rows, a few us here).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [rows, hidden]");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h && w.is_contiguous(), "rms_norm: weight must be [hidden]");
  const float* xp = x.data_ptr<float>();
  auto y = torch::empty_like(x);
  float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * h;
      double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= h; i += 8)
        for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(row[i + j]) * row[i + j];
      for (; i < h; ++i) lanes[0] += static_cast<double>(row[i]) * row[i];
      double ss = lanes[0];
      for (int j = 1; j < 8; ++j) ss += lanes[j];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(h) + eps));
      float* out = yp + t * h;
      for (int64_t k = 0; k < h; ++k) out[k] = (row[k] * r) * wp[k];
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "Row-invariant float32 RMSNorm (CPU)");
  m.def("tree_attention", &tree_attention, "Batch-invariant float32 tree attention (CPU)");
  m.def("write_tiled", &write_tiled, "Store rows of keys into a layer's tiled-key pool (CPU)");
  m.def("rope_store", &rope_store, "Rotary embedding of new queries and keys, and their keys and values stored (CPU)");
}
