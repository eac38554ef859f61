// Projections straight from a GGUF's quantized blocks (Q8_0, Q5_0, Q4_K, Q6_K), batch-invariant
// by construction.
//
// y[r, j] = sum_k x[r, k] * W[j, k], with W kept as the GGUF stores it: row j of the [out, in]
// matrix is in / block_size blocks of bytes. Nothing is dequantized to a float matrix.
//
// The rule (docs/architecture.md §4, "Quantized weights"), the same for one row and for many:
//
// 1. Each activation row is quantized on its own, per 32-value block: d = max|x| / 127,
//    q = round-half-even(x * (1 / d)) (0 when the block is all zero), the block's sum of q kept.
//    A row's int8 values never depend on the other rows.
// 2. Per weight block, the integer dot product of the weight's integers and the row's int8 values
//    is exact (int32), so no order of summation inside a block can change it: the compiler may
//    vectorize it any way it likes, for any instruction set.
// 3. The float part is a fixed chain per (row, output): for each block in order, one product of
//    the scales and one add to the accumulator (separate multiply and add: this file is compiled
//    with -ffp-contract=off, so the chain is the same IEEE operations on every machine and the
//    plain-torch reference in quant_matmul.py reproduces it bit for bit).
//
// So a tree row's projection equals the same row computed alone, whatever the number of rows,
// the thread count or the SIMD width. Per block type (j's block b, row r's block b with scale dx
// and sum sx; w's integers as stored):
//
//   Q8_0, Q5_0   acc += (dw * dx) * float(isum)                      (Q5_0's integers are q - 16)
//   Q4_K         acc += dx * (d * float(sc * isum) - dmin * float(m * sx))  per 32-value sub-block
//   Q6_K         acc += (d * dx) * float(sc0 * isum0 + sc1 * isum1)   two 16-value scales per block
//
// `dequantize_rows` turns whole rows back into floats exactly as gguf-py's `dequantize` does (the
// embedding lookup of a quantized token table).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum QType : int64_t { Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14 };

constexpr int QB = 32;  // activation block (and the inner integer dot's length)

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

int64_t block_values(int64_t t) { return (t == Q4_K || t == Q6_K) ? 256 : 32; }

int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q8_0: return 34;
    case Q5_0: return 22;
    case Q4_K: return 144;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "unsupported quantization type ", t, " (one of Q8_0=8, Q5_0=6, Q4_K=12, Q6_K=14)");
  return 0;
}

inline int32_t dot(const int8_t* a, const int8_t* b, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += int32_t(a[i]) * int32_t(b[i]);
  return s;
}

// The two integer dot products of a 32-value block, over values 0..15 and 16..31 (exact: the
// same integers whatever computes them). AVX2: |w| (unsigned) times x with w's sign, pairs summed
// in 16 bits (at most 2 * 128 * 127, no saturation), then in 32 bits.
inline void dot32_halves(const int8_t* w, const int8_t* x, int32_t* lo, int32_t* hi) {
#if defined(__AVX2__)
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
  const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  __m128i l = _mm256_castsi256_si128(p32), h = _mm256_extracti128_si256(p32, 1);
  l = _mm_add_epi32(l, _mm_shuffle_epi32(l, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  l = _mm_add_epi32(l, _mm_shuffle_epi32(l, 0xB1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  *lo = _mm_cvtsi128_si32(l);
  *hi = _mm_cvtsi128_si32(h);
#else
  *lo = dot(w, x, 16);
  *hi = dot(w + 16, x + 16, 16);
#endif
}

inline int32_t dot32(const int8_t* w, const int8_t* x) {
  int32_t lo, hi;
  dot32_halves(w, x, &lo, &hi);
  return lo + hi;
}

// Q4_K's eight 6-bit scales and mins, packed in 12 bytes.
inline void q4k_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int k = 0; k < 4; ++k) {
    sc[k] = s[k] & 0x3F;
    mn[k] = s[4 + k] & 0x3F;
    sc[4 + k] = (s[8 + k] & 0x0F) | ((s[k] >> 2) & 0x30);
    mn[4 + k] = (s[8 + k] >> 4) | ((s[4 + k] >> 2) & 0x30);
  }
}

// One weight row's integers (as stored, see the table above) into q[in].
void decode_row(int64_t t, const uint8_t* row, int64_t in, int8_t* q) {
  const int64_t bv = block_values(t), bb = block_bytes(t);
  for (int64_t b = 0; b < in / bv; ++b) {
    const uint8_t* blk = row + b * bb;
    int8_t* out = q + b * bv;
    if (t == Q8_0) {
      std::memcpy(out, blk + 2, 32);
    } else if (t == Q5_0) {
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      const uint8_t* qs = blk + 6;
      for (int i = 0; i < 16; ++i) {
        out[i] = int8_t(((qs[i] & 0x0F) | (((qh >> i) & 1) << 4)) - 16);
        out[i + 16] = int8_t(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
      }
    } else if (t == Q4_K) {
      const uint8_t* qs = blk + 16;
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 32; ++i) {
          out[64 * g + i] = int8_t(qs[32 * g + i] & 0x0F);
          out[64 * g + 32 + i] = int8_t(qs[32 * g + i] >> 4);
        }
    } else {  // Q6_K: ql[128], qh[64], scales[16], d
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 32; ++i) {
          const uint8_t l0 = ql[64 * h + i], l1 = ql[64 * h + 32 + i], hb = qh[32 * h + i];
          out[128 * h + i] = int8_t(((l0 & 0x0F) | ((hb & 3) << 4)) - 32);
          out[128 * h + 32 + i] = int8_t(((l1 & 0x0F) | (((hb >> 2) & 3) << 4)) - 32);
          out[128 * h + 64 + i] = int8_t(((l0 >> 4) | (((hb >> 4) & 3) << 4)) - 32);
          out[128 * h + 96 + i] = int8_t(((l1 >> 4) | (((hb >> 6) & 3) << 4)) - 32);
        }
    }
  }
}

// One weight row's per-block numbers, read once per row and used for every activation row: per
// 32-value block b, the float scale d (Q8_0, Q5_0: the block's; K types: the super-block's),
// dmin (Q4_K) and two integers (Q4_K: the sub-block's scale and min; Q6_K: its two 16-value scales).
struct RowScales {
  std::vector<float> d, dmin;
  std::vector<int32_t> s0, s1;
  explicit RowScales(int64_t nb) : d(nb), dmin(nb), s0(nb), s1(nb) {}

  void read(int64_t t, const uint8_t* row, int64_t in) {
    const int64_t bb = block_bytes(t);
    if (t == Q8_0 || t == Q5_0) {
      for (int64_t b = 0; b < in / QB; ++b) d[b] = half_to_float(row + b * bb);
      return;
    }
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * bb;
      if (t == Q4_K) {
        int32_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const float dd = half_to_float(blk), dm = half_to_float(blk + 2);
        for (int s = 0; s < 8; ++s) {
          d[sb * 8 + s] = dd;
          dmin[sb * 8 + s] = dm;
          s0[sb * 8 + s] = sc[s];
          s1[sb * 8 + s] = mn[s];
        }
      } else {
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        const float dd = half_to_float(blk + 208);
        for (int s = 0; s < 8; ++s) {
          d[sb * 8 + s] = dd;
          s0[sb * 8 + s] = scales[2 * s];
          s1[sb * 8 + s] = scales[2 * s + 1];
        }
      }
    }
  }
};

// The dot product of one weight row (decoded integers `wq`, scales `w`) with activation row r:
// the chain of the file's header, block by block in order.
float row_dot(int64_t t, int64_t nb, const int8_t* wq, const RowScales& w, const int8_t* xq,
              const float* dx, const int32_t* sx) {
  float acc = 0.0f;
  if (t == Q8_0 || t == Q5_0) {
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t isum = dot32(wq + b * QB, xq + b * QB);
      const float scale = w.d[b] * dx[b];
      acc = acc + scale * float(isum);
    }
  } else if (t == Q4_K) {
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t isum = dot32(wq + b * QB, xq + b * QB);
      const float a = float(w.s0[b] * isum), c = float(w.s1[b] * sx[b]);
      const float da = w.d[b] * a, mc = w.dmin[b] * c;
      const float inner = da - mc;
      acc = acc + dx[b] * inner;
    }
  } else {  // Q6_K
    for (int64_t b = 0; b < nb; ++b) {
      int32_t i0, i1;
      dot32_halves(wq + b * QB, xq + b * QB, &i0, &i1);
      const int32_t ii = w.s0[b] * i0 + w.s1[b] * i1;
      const float scale = w.d[b] * dx[b];
      acc = acc + scale * float(ii);
    }
  }
  return acc;
}

#if defined(__AVX2__)
// Four activation rows at once (AVX2): the weight block is loaded once, the four rows' integer
// dots are reduced together, and the four float chains run side by side in the lanes of one
// vector. Each lane does exactly the scalar chain of `row_dot` (the same IEEE multiplies and adds,
// separate, in the same order), so a row's result is the same in this path and in the scalar
// one: which rows share a group never changes a value. xq4: the four rows; dxT, sxT: [nb, rows]
// (block-major), `r` the first row's index.
void row_dot4(int64_t t, int64_t nb, const int8_t* wq, const RowScales& w, const int8_t* const* xq4,
              const float* dxT, const int32_t* sxT, int64_t rows, int64_t r, float* out4) {
  __m128 acc = _mm_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QB));
    const __m256i wa = _mm256_abs_epi8(wv);
    __m256i p[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq4[k] + b * QB));
      p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv)), ones);
    }
    // low 128 bits: each row's sum over values 0..15; high: over 16..31
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    const __m128 dx = _mm_loadu_ps(dxT + b * rows + r);
    if (t == Q8_0 || t == Q5_0) {
      const __m128 isum = _mm_cvtepi32_ps(_mm_add_epi32(lo, hi));
      const __m128 scale = _mm_mul_ps(_mm_set1_ps(w.d[b]), dx);
      acc = _mm_add_ps(acc, _mm_mul_ps(scale, isum));
    } else if (t == Q4_K) {
      const __m128i isum = _mm_add_epi32(lo, hi);
      const __m128i sx = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sxT + b * rows + r));
      const __m128 a = _mm_cvtepi32_ps(_mm_mullo_epi32(_mm_set1_epi32(w.s0[b]), isum));
      const __m128 c = _mm_cvtepi32_ps(_mm_mullo_epi32(_mm_set1_epi32(w.s1[b]), sx));
      const __m128 inner = _mm_sub_ps(_mm_mul_ps(_mm_set1_ps(w.d[b]), a), _mm_mul_ps(_mm_set1_ps(w.dmin[b]), c));
      acc = _mm_add_ps(acc, _mm_mul_ps(dx, inner));
    } else {  // Q6_K
      const __m128i ii = _mm_add_epi32(_mm_mullo_epi32(_mm_set1_epi32(w.s0[b]), lo),
                                       _mm_mullo_epi32(_mm_set1_epi32(w.s1[b]), hi));
      const __m128 scale = _mm_mul_ps(_mm_set1_ps(w.d[b]), dx);
      acc = _mm_add_ps(acc, _mm_mul_ps(scale, _mm_cvtepi32_ps(ii)));
    }
  }
  _mm_storeu_ps(out4, acc);
}
#endif

#if defined(__AVX2__)
// Sum of the eight int32 lanes in each 128-bit half: (values 0..15, values 16..31) of a block.
inline void hsum_halves(__m256i p32, int32_t* lo, int32_t* hi) {
  __m128i l = _mm256_castsi256_si128(p32), h = _mm256_extracti128_si256(p32, 1);
  l = _mm_add_epi32(l, _mm_shuffle_epi32(l, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  l = _mm_add_epi32(l, _mm_shuffle_epi32(l, 0xB1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  *lo = _mm_cvtsi128_si32(l);
  *hi = _mm_cvtsi128_si32(h);
}

// Signed weights w (in a register) against 32 activations: the two half sums (exact).
inline void dot_signed(__m256i w, const int8_t* x, int32_t* lo, int32_t* hi) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
  hsum_halves(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)), lo, hi);
}

// Unsigned weights u (0..15, in a register) against 32 activations (exact; pairs at most 2 * 15 * 127).
inline int32_t dot_unsigned(__m256i u, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
  int32_t lo, hi;
  hsum_halves(p32, &lo, &hi);
  return lo + hi;
}

// One activation row straight from the blocks (AVX2), for the rows outside the four-row groups
// (a decode step's one row): the same integers and the same float chain as decode_row + row_dot,
// without decoding the weight row first.
float row_dot_blocks(int64_t t, const uint8_t* row, int64_t in, const int8_t* xq, const float* dx,
                     const int32_t* sx) {
  const int64_t bb = block_bytes(t), nb = in / QB;
  float acc = 0.0f;
  if (t == Q8_0 || t == Q5_0) {
    alignas(32) int8_t buf[32];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      const int8_t* w = reinterpret_cast<const int8_t*>(blk + 2);
      if (t == Q5_0) {
        decode_row(t, blk, QB, buf);
        w = buf;
      }
      int32_t lo, hi;
      dot_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), xq + b * QB, &lo, &hi);
      const int32_t isum = lo + hi;
      const float scale = half_to_float(blk) * dx[b];
      acc = acc + scale * float(isum);
    }
    return acc;
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
  for (int64_t sb = 0; sb < in / 256; ++sb) {
    const uint8_t* blk = row + sb * bb;
    if (t == Q4_K) {
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      int32_t sc[8], mn[8];
      q4k_scales(blk + 4, sc, mn);
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * g));
        const __m256i nib[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
        for (int k = 0; k < 2; ++k) {
          const int s = 2 * g + k;
          const int64_t b = sb * 8 + s;
          const int32_t isum = dot_unsigned(nib[k], xq + b * QB);
          const float a = float(sc[s] * isum), c = float(mn[s] * sx[b]);
          const float da = d * a, mc = dmin * c;
          const float inner = da - mc;
          acc = acc + dx[b] * inner;
        }
      }
    } else {  // Q6_K
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_to_float(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i high[4] = {
            _mm256_and_si256(hb, m2), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2),
            _mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), _mm256_and_si256(_mm256_srli_epi16(hb, 6), m2)};
        const __m256i low[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int c = 0; c < 4; ++c) {
          const __m256i q = _mm256_or_si256(low[c], _mm256_slli_epi16(high[c], 4));
          const int s = 4 * h + c;
          const int64_t b = sb * 8 + s;
          int32_t i0, i1;
          dot_signed(_mm256_sub_epi8(q, k32), xq + b * QB, &i0, &i1);
          const int32_t ii = int32_t(scales[2 * s]) * i0 + int32_t(scales[2 * s + 1]) * i1;
          const float scale = d * dx[b];
          acc = acc + scale * float(ii);
        }
      }
    }
  }
  return acc;
}
#endif

void check_weight(const torch::Tensor& w, int64_t t, int64_t in) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "the weight must be a contiguous [out, bytes per row] uint8 CPU tensor");
  const int64_t bv = block_values(t);
  TORCH_CHECK(in > 0 && in % bv == 0, "in_features (", in, ") must be a positive multiple of ", bv,
              " for quantization type ", t);
  TORCH_CHECK(w.size(1) == in / bv * block_bytes(t), "a weight row of ", in, " values of type ", t,
              " holds ", in / bv * block_bytes(t), " bytes, got ", w.size(1));
}

}  // namespace

// x: [rows, in] float32 -> (xq [rows, in] int8, dx [rows, in / 32] float32, sx [rows, in / 32] int32)
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x_) {
  TORCH_CHECK(x_.device().is_cpu() && x_.scalar_type() == torch::kFloat32 && x_.dim() == 2,
              "x must be a [rows, in] float32 CPU tensor");
  const torch::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % QB == 0, "in_features (", in, ") must be a multiple of ", QB);
  const int64_t nb = in / QB;
  auto xq = torch::empty({rows, in}, torch::kInt8);
  auto dx = torch::empty({rows, nb}, torch::kFloat32);
  auto sx = torch::empty({rows, nb}, torch::kInt32);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int32_t* sp = sx.data_ptr<int32_t>();
  at::parallel_for(0, rows * nb, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* v = xp + i * QB;
      float amax = 0.0f;
      for (int k = 0; k < QB; ++k) amax = std::fmax(amax, std::fabs(v[k]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t s = 0;
      for (int k = 0; k < QB; ++k) {
        const float q = std::nearbyint(v[k] * id);  // round half to even, as torch.round
        const int8_t qi = int8_t(std::fmax(-127.0f, std::fmin(127.0f, q)));
        qp[i * QB + k] = qi;
        s += qi;
      }
      dp[i] = d;
      sp[i] = s;
    }
  });
  return {xq, dx, sx};
}

// x: [rows, in] float32, w: [out, bytes per row] uint8 blocks of type t -> [rows, out] float32
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  check_weight(w, t, in);
  auto q = quantize_rows(x);
  const int8_t* xq = q[0].data_ptr<int8_t>();
  const float* dx = q[1].data_ptr<float>();
  const int32_t* sx = q[2].data_ptr<int32_t>();
  auto y = torch::empty({rows, out}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), nb = in / QB;
  // the scales and sums block-major, for the four-row path's vector loads
  const torch::Tensor dxt = q[1].t().contiguous(), sxt = q[2].t().contiguous();
  const float* dxT = dxt.data_ptr<float>();
  const int32_t* sxT = sxt.data_ptr<int32_t>();
  (void)dxT;
  (void)sxT;
  at::parallel_for(0, out, 16, [&](int64_t lo, int64_t hi) {
    std::vector<int8_t> wq(in);
    RowScales scales(nb);
    for (int64_t j = lo; j < hi; ++j) {
      const uint8_t* row = wp + j * row_bytes;
      int64_t r = 0;
#if defined(__AVX2__)
      if (rows >= 4) {
        decode_row(t, row, in, wq.data());
        scales.read(t, row, in);
        for (; r + 4 <= rows; r += 4) {
          const int8_t* xq4[4] = {xq + r * in, xq + (r + 1) * in, xq + (r + 2) * in, xq + (r + 3) * in};
          float o[4];
          row_dot4(t, nb, wq.data(), scales, xq4, dxT, sxT, rows, r, o);
          for (int k = 0; k < 4; ++k) yp[(r + k) * out + j] = o[k];
        }
      }
      for (; r < rows; ++r)
        yp[r * out + j] = row_dot_blocks(t, row, in, xq + r * in, dx + r * nb, sx + r * nb);
#else
      decode_row(t, row, in, wq.data());
      scales.read(t, row, in);
      for (; r < rows; ++r)
        yp[r * out + j] = row_dot(t, nb, wq.data(), scales, xq + r * in, dx + r * nb, sx + r * nb);
#endif
    }
  });
  return y;
}

// w: [out, bytes per row] uint8 blocks of type t, rows: [n] int64 -> [n, in] float32, exactly as
// gguf-py's dequantize computes each value.
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t t, int64_t in, const torch::Tensor& rows_) {
  check_weight(w, t, in);
  const torch::Tensor rows = rows_.to(torch::kInt64).contiguous();
  const int64_t n = rows.numel(), out = w.size(0), bv = block_values(t), bb = block_bytes(t);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < out, "row ", rp[i], " is out of range [0, ", out, ")");
  auto y = torch::empty({n, in}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int8_t> q(in);
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = wp + rp[i] * w.size(1);
      decode_row(t, row, in, q.data());
      float* o = yp + i * in;
      for (int64_t b = 0; b < in / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        const int8_t* qb = q.data() + b * bv;
        float* ob = o + b * bv;
        if (t == Q8_0 || t == Q5_0) {
          const float d = half_to_float(blk);
          for (int k = 0; k < 32; ++k) ob[k] = d * float(qb[k]);
        } else if (t == Q4_K) {
          const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
          int32_t sc[8], mn[8];
          q4k_scales(blk + 4, sc, mn);
          for (int s = 0; s < 8; ++s) {
            const float ds = d * float(sc[s]), dm = dmin * float(mn[s]);
            for (int k = 0; k < 32; ++k) {
              const float p = ds * float(qb[32 * s + k]);
              ob[32 * s + k] = p - dm;
            }
          }
        } else {
          const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
          const float d = half_to_float(blk + 208);
          for (int s = 0; s < 16; ++s) {
            const float ds = d * float(scales[s]);
            for (int k = 0; k < 16; ++k) ob[16 * s + k] = ds * float(qb[16 * s + k]);
          }
        }
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row, per-32-value int8 activations (xq, dx, sx)");
  m.def("quant_matmul", &quant_matmul, "x @ W.T with W in GGUF blocks, batch-invariant");
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGUF-block matrix as float32");
}
