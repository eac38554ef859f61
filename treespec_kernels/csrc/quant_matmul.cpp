// Projections straight from a GGUF's quantized blocks (Q8_0, Q5_0, Q4_1, Q4_K, Q6_K), batch-invariant
// by construction.
//
// y[r, j] = sum_k x[r, k] * W[j, k], with W kept as the GGUF stores it: row j of the [out, in]
// matrix is in / block_size blocks of bytes. Nothing is dequantized to a float matrix.
//
// The rule (docs/architecture.md §4, "Quantized weights"), the same for one row and for many:
//
// 1. Each activation row is quantized on its own to int8, per block of QX values: d = max|x| / 127,
//    q = round-half-even(x * (1 / d)) (0 when the block is all zero), with the sum of q of every 32
//    values kept. QX is the weight type's: 32 for Q8_0, Q5_0, Q4_1 (their blocks carry a scale per
//    32), 256 for the K types (one scale per super-block, as llama.cpp's Q8_K). A row's int8 values
//    never depend on the other rows.
// 2. Everything inside an activation block is integer arithmetic, exact in int32: the dot products
//    of the weight's integers and the row's, weighted by the K types' integer sub-block scales. No
//    order of summation can change it, so the compiler or the intrinsics may vectorize it any way
//    they like, on any instruction set.
// 3. The float part is a fixed chain per (row, output): for each activation block in order, a few
//    products of the scales and one add to the accumulator (separate multiplies and adds: this
//    file is compiled with -ffp-contract=off, so the chain is the same IEEE operations on every
//    machine and the plain-torch reference in quant_matmul.py reproduces it bit for bit).
//
// So a tree row's projection equals the same row computed alone, whatever the number of rows,
// the thread count or the SIMD width. Per activation block (dx its scale; w's integers as stored):
//
//   Q8_0, Q5_0 (32)  isum = sum q_w q_x                      acc += (dw * dx) * float(isum)
//                    (Q5_0's integers are q - 16)
//   Q4_1 (32)        isum as above (integers 0..15), xs = sum q_x
//                    acc += ((dw * dx) * float(isum) + (mw * dx) * float(xs))
//   Q4_K (256)       A = sum_s sc_s * isum_s, M = sum_s m_s * xsum_s over the 8 sub-blocks of 32
//                    acc += dx * (d * float(A) - dmin * float(M))
//   Q6_K (256)       T = sum_i sc_i * isum_i over the 16 sub-blocks of 16 (integers q - 32)
//                    acc += (d * dx) * float(T)
//
// SIMD: the integer sums run on AVX2 (256-bit maddubs/madd; groups of four activation rows, the
// last one to three together), and for the K types on AVX-512 with VNNI where the CPU has it:
// below 8 rows (`set_lanes_min_rows`) tiles of weight rows x activation rows that fill the eight
// lanes of a float chain vector (one pass over the weights for up to eight rows; see "tiles of O
// weight rows x N activation rows"), from 8 rows the activation rows in the lanes of a vector and
// the weights broadcast (one dpbusd per 4 values of 16 rows; see "the activation rows in the
// lanes"). From 9 rows (`set_amx_min_rows`) the K types run on AMX tiles where the CPU has them
// (Sapphire Rapids and later: 16 weight rows x 16 activation rows per tile product, the sub-block
// scales folded into the weights' bytes first; see "The K types with AMX"). The build's
// -march=native decides what is compiled, and `simd()` says which. The integers are the same on
// every path, so the float chain sees the same numbers (tests build x86-64-v2 and x86-64-v3 beside
// native, and force the lanes and AMX on and off, and compare).
//
// `dequantize_rows` turns whole rows back into floats exactly as gguf-py's `dequantize` does (the
// embedding lookup of a quantized token table).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The AVX-512 path (512-bit integer sums with VNNI's dpwssd) where the build's -march=native has
// it; the AVX2 path otherwise. Both compute the same exact integers, then the same float chain.
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define TREESPEC_AVX512 1
#endif

#ifndef TREESPEC_PREFETCH_ROWS
#define TREESPEC_PREFETCH_ROWS 4
#endif
#ifndef TREESPEC_PREFETCH_TILES
#define TREESPEC_PREFETCH_TILES 1  // the AVX-512 tiles: tiles of eight weight rows ahead
#endif


namespace {

enum QType : int64_t { Q4_1 = 3, Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14 };

constexpr int QB = 32;  // activation block (and the inner integer dot's length)

// The kernel's work hook (`set_counting`, `work`): while counting is on, each K-type path adds what
// one call of it did: weight super-blocks unpacked, 256-value integer dot products, and reductions
// (one per super-block of each call: the step that turns a tile's integer lanes into its float
// chains). Off by default: then each path pays one untaken branch per call.
struct WorkCounters {
  std::atomic<int64_t> unpacks{0}, dots{0}, reductions{0}, calls{0};
};
WorkCounters g_work;
bool g_counting = false;

// rows from which the K types run with the activation rows in the lanes (AVX-512 VNNI); 0: never.
// 8: where the lanes overtook the tiles of outputs in the 1.5B's whole forward on an AVX-512 VNNI
// machine without AMX (bench.target_step: equal at 7 rows; 0.9x at 8, 0.7x at 16, 0.57x at 32)
int64_t g_lanes_min_rows = 8;

inline void count_work(int64_t unpacks, int64_t dots, int64_t reductions) {
  if (!g_counting) return;
  g_work.unpacks += unpacks;
  g_work.dots += dots;
  g_work.reductions += reductions;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // exact, as the conversion below: every half is a float
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

int64_t block_values(int64_t t) { return (t == Q4_K || t == Q6_K) ? 256 : 32; }

int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q8_0: return 34;
    case Q5_0: return 22;
    case Q4_1: return 20;
    case Q4_K: return 144;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "unsupported quantization type ", t, " (one of Q4_1=3, Q8_0=8, Q5_0=6, Q4_K=12, Q6_K=14)");
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

// The 8 scales and 8 mins of a Q4_K super-block (bytes 4..15), a byte each, four at a time in
// a 32-bit word.
inline void q4k_scales_packed(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t k1 = 0x3F3F3F3Fu, k2 = 0x0F0F0F0Fu, k3 = 0x03030303u;
  const uint32_t sc_lo = u[0] & k1, sc_hi = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  const uint32_t mn_lo = u[1] & k1, mn_hi = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  *sc = uint64_t(sc_lo) | (uint64_t(sc_hi) << 32);
  *mn = uint64_t(mn_lo) | (uint64_t(mn_hi) << 32);
}

// Q4_K's eight 6-bit scales and mins, packed in 12 bytes.
inline void q4k_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  uint64_t a, b;
  q4k_scales_packed(s, &a, &b);
  for (int k = 0; k < 8; ++k) {
    sc[k] = int32_t((a >> (8 * k)) & 0xFF);
    mn[k] = int32_t((b >> (8 * k)) & 0xFF);
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
    } else if (t == Q4_1) {
      const uint8_t* qs = blk + 4;
      for (int i = 0; i < 16; ++i) {
        out[i] = int8_t(qs[i] & 0x0F);
        out[i + 16] = int8_t(qs[i] >> 4);
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

#endif

inline bool k_type(int64_t t) { return t == Q4_K || t == Q6_K; }

// ---------------------------------------------------------------------------------------------------
// Q8_0, Q5_0 and Q4_1: 32-value blocks

// One activation row against one weight row of 32-value blocks (w: decoded integers or null: read
// Q8_0's straight from the blocks; sx: the row's sums of 32, read for Q4_1's minimum).
float dot32_row(int64_t t, const uint8_t* row, int64_t in, const int8_t* wq, const int8_t* xq, const float* dx,
                const int32_t* sx) {
  const int64_t bb = block_bytes(t);
  float acc = 0.0f;
  for (int64_t b = 0; b < in / QB; ++b) {
    const uint8_t* blk = row + b * bb;
    const int8_t* w = wq != nullptr ? wq + b * QB : reinterpret_cast<const int8_t*>(blk + 2);
    const int32_t isum = dot32(w, xq + b * QB);
    const float scale = half_to_float(blk) * dx[b];
    if (t == Q4_1) {
      const float mscale = half_to_float(blk + 2) * dx[b];
      const float a = scale * float(isum), m = mscale * float(sx[b]);
      acc = acc + (a + m);
    } else {
      acc = acc + scale * float(isum);
    }
  }
  return acc;
}

#if defined(__AVX2__)
// Four activation rows at once: the weight block loaded once, the four rows' integer dots reduced
// together, and the four float chains side by side in the lanes of one vector (each lane the
// scalar chain of dot32_row). dxT: [blocks, rows] (block-major), `r` the first row.
void dot32_rows4(int64_t t, const uint8_t* row, int64_t in, const int8_t* wq, const int8_t* const* xq4,
                 const float* dxT, const int32_t* sxT, int64_t rows, int64_t r, float* out4) {
  const int64_t bb = block_bytes(t);
  __m128 acc = _mm_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < in / QB; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QB));
    const __m256i wa = _mm256_abs_epi8(wv);
    __m256i p[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq4[k] + b * QB));
      p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv)), ones);
    }
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m128i isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128 dxv = _mm_loadu_ps(dxT + b * rows + r);
    const __m128 scale = _mm_mul_ps(_mm_set1_ps(half_to_float(row + b * bb)), dxv);
    if (t == Q4_1) {
      const __m128 mscale = _mm_mul_ps(_mm_set1_ps(half_to_float(row + b * bb + 2)), dxv);
      const __m128i xs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sxT + b * rows + r));
      const __m128 a = _mm_mul_ps(scale, _mm_cvtepi32_ps(isum)), m = _mm_mul_ps(mscale, _mm_cvtepi32_ps(xs));
      acc = _mm_add_ps(acc, _mm_add_ps(a, m));
    } else {
      acc = _mm_add_ps(acc, _mm_mul_ps(scale, _mm_cvtepi32_ps(isum)));
    }
  }
  _mm_storeu_ps(out4, acc);
}
#endif

// ---------------------------------------------------------------------------------------------------
// Q4_K and Q6_K: 256-value super-blocks

// The float step of one super-block (the chain of the header), given its integer totals.
inline float k_step(int64_t t, const uint8_t* blk, int32_t A, int32_t M, float dx, float acc) {
  if (t == Q4_K) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const float da = d * float(A), mc = dmin * float(M);
    const float inner = da - mc;
    return acc + dx * inner;
  }
  const float scale = half_to_float(blk + 208) * dx;
  return acc + scale * float(A);
}

// The integer total A (Q4_K: sum sc * isum; Q6_K: T) of one super-block, plainly.
int32_t k_total_plain(int64_t t, const uint8_t* blk, const int8_t* x) {
  int8_t q[256];
  decode_row(t, blk, 256, q);
  int32_t total = 0;
  if (t == Q4_K) {
    int32_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    for (int s = 0; s < 8; ++s) total += sc[s] * dot(q + 32 * s, x + 32 * s, 32);
  } else {
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) total += int32_t(scales[i]) * dot(q + 16 * i, x + 16 * i, 16);
  }
  return total;
}

#if defined(__AVX2__)
inline int32_t hsum8(__m256i v) {
  int32_t lo, hi;
  hsum_halves(v, &lo, &hi);
  return lo + hi;
}

// The integer totals A of one super-block for N activation rows (x[k]: row k's 256 values), the
// weights unpacked in registers once: maddubs of the weights with the rows' int8 values, then
// madd with the sub-block scales as int16, summed in int32 lanes (exact: see the bounds below).
template <int N>
void k_sums(int64_t t, const uint8_t* blk, const int8_t* const* x, __m256i* acc, const int32_t* sc) {
  for (int k = 0; k < N; ++k) acc[k] = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if (t == Q4_K) {  // pairs of 15 * 127 and scales <= 63: lanes far below 2^31 (sc: q4k_scales')
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * g));
      const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      const __m256i s0 = _mm256_set1_epi16(int16_t(sc[2 * g])), s1 = _mm256_set1_epi16(int16_t(sc[2 * g + 1]));
      for (int k = 0; k < N; ++k) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[k] + 64 * g));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[k] + 64 * g + 32));
        acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0));
        acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1));
      }
    }
  } else {  // Q6_K: |q - 32| <= 32, pairs of 32 * 127, |scales| <= 128
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const __m256i m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m256i low[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      for (int c = 0; c < 4; ++c) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), m2);
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(low[c], _mm256_slli_epi16(high, 4)), k32);
        const __m256i wa = _mm256_abs_epi8(w);
        const int s = 4 * h + c;  // values 32 s .. 32 s + 31: scales 2 s (first 16) and 2 s + 1
        const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(int16_t(scales[2 * s + 1])),
                                            _mm_set1_epi16(int16_t(scales[2 * s])));
        for (int k = 0; k < N; ++k) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[k] + 32 * s));
          const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, w));
          acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(p16, sc));
        }
      }
    }
  }
}

// The totals A of one super-block for N rows (each row's lanes summed).
template <int N>
void k_totals(int64_t t, const uint8_t* blk, const int8_t* const* x, int32_t* A, const int32_t* sc) {
  __m256i acc[N];
  k_sums<N>(t, blk, x, acc, sc);
  for (int k = 0; k < N; ++k) A[k] = hsum8(acc[k]);
}

// Four activation rows against one K-type weight row, the four float chains side by side in the
// lanes of one vector: each lane does exactly k_step's operations. dxT: [super-blocks, rows],
// sxT: [blocks of 32, rows] (block-major), `r` the first row.
void k_rows4(int64_t t, const uint8_t* row, int64_t in, const int8_t* const* xq4, const float* dxT,
             const int32_t* sxT, int64_t rows, int64_t r, float* out4) {
  const int64_t bb = block_bytes(t);
  count_work(in / 256, 4 * (in / 256), in / 256);
  __m128 acc = _mm_setzero_ps();
  for (int64_t sb = 0; sb < in / 256; ++sb) {
    const uint8_t* blk = row + sb * bb;
    const int8_t* x[4] = {xq4[0] + 256 * sb, xq4[1] + 256 * sb, xq4[2] + 256 * sb, xq4[3] + 256 * sb};
    int32_t sc[8], mn[8];
    if (t == Q4_K) q4k_scales(blk + 4, sc, mn);
    __m256i s[4];
    k_sums<4>(t, blk, x, s, sc);
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m128i A = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128 dx = _mm_loadu_ps(dxT + sb * rows + r);
    if (t == Q4_K) {
      __m128i M = _mm_setzero_si128();
      for (int k = 0; k < 8; ++k) {
        const __m128i sx = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sxT + (8 * sb + k) * rows + r));
        M = _mm_add_epi32(M, _mm_mullo_epi32(_mm_set1_epi32(mn[k]), sx));
      }
      const __m128 da = _mm_mul_ps(_mm_set1_ps(half_to_float(blk)), _mm_cvtepi32_ps(A));
      const __m128 mc = _mm_mul_ps(_mm_set1_ps(half_to_float(blk + 2)), _mm_cvtepi32_ps(M));
      acc = _mm_add_ps(acc, _mm_mul_ps(dx, _mm_sub_ps(da, mc)));
    } else {
      const __m128 scale = _mm_mul_ps(_mm_set1_ps(half_to_float(blk + 208)), dx);
      acc = _mm_add_ps(acc, _mm_mul_ps(scale, _mm_cvtepi32_ps(A)));
    }
  }
  _mm_storeu_ps(out4, acc);
}
#endif

#if defined(TREESPEC_AVX512)
// ---------------------------------------------------------------------------------------------------
// The K types with AVX-512: tiles of O weight rows x N activation rows (O * N <= 8), one pass over
// the weight rows for up to eight activation rows, whatever N is: a product of 1..8 rows costs one
// pass, 9..16 two, and so on (no row runs alone because the count is not a multiple of four).
//
// A super-block is four 64-value pieces (piece e: values 64 e .. 64 e + 63 of the activation row),
// each a zmm of the weight's unsigned integers (Q4_K: 0..15; Q6_K: q, 0..63, the offset 32 taken
// out below) and a zmm of the int16 sub-block scales matching maddubs' 32 pairs. Per activation
// row and piece: maddubs (u8 * s8 pairs in int16: at most 2 * 63 * 127, no saturation) then
// dpwssd (int16 pairs times the scales, added in int32). Q6_K's offset: A = sum_i sc_i * (sum q x
// - 32 sum x) over its 16 sub-blocks of 16, the second part from the row's sums of 16 (madd of
// the 16 scales with them). Bounds: |A| < 2^28 for both types, every partial sum too.
//
// The lanes of a tile, i = o * P + n (P = 8 / O), hold one (output, row) pair each: the eight
// int32 accumulators are reduced together into one ymm of totals A (and Q4_K's mins M), and the
// float chain of every pair runs in its lane, each lane doing exactly k_step's operations. The
// integers are the plain path's, and so are the bits.
struct KBlock {
  __m512i w[4];
  __m512i s[4];
  __m256i sc16;  // Q6_K: the 16 scales as int16
  __m128i mn16;  // Q4_K: the 8 mins as int16
};

// lanes 8 q .. 8 q + 7 of 32 int16 take entry `first + q` of a table of int16 (q = 0..3), or, with
// `wide`, lanes 16 q .. 16 q + 15 take entry `first + q` (q = 0, 1)
inline __m512i spread_index(int first, bool wide) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = int16_t(first + (wide ? i / 16 : i / 8));
  return _mm512_load_si512(idx);
}

// the scale spreads of the four pieces: Q4_K's sub-blocks of 32, Q6_K's of 16 (set at load time,
// so that the unpacking has no guard of a function-local static to check)
const __m512i k_wide_idx[4] = {spread_index(0, true), spread_index(2, true), spread_index(4, true),
                               spread_index(6, true)};
const __m512i k_narrow_idx[4] = {spread_index(0, false), spread_index(4, false), spread_index(8, false),
                                 spread_index(12, false)};

template <int64_t T>
inline void k_unpack(const uint8_t* blk, KBlock& p) {
  const __m512i* wide_idx = k_wide_idx;
  const __m512i* narrow_idx = k_narrow_idx;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == Q4_K) {
    uint64_t sc, mn;
    q4k_scales_packed(blk + 4, &sc, &mn);
    p.mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(mn)));
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
    // bytes 16..143: 32 g + i holds value 64 g + i (low nibble) and 64 g + 32 + i (high)
    const __m512i v01 = _mm512_loadu_si512(blk + 16), v23 = _mm512_loadu_si512(blk + 80);
    const __m512i lo01 = _mm512_and_si512(v01, m4), hi01 = _mm512_and_si512(_mm512_srli_epi16(v01, 4), m4);
    const __m512i lo23 = _mm512_and_si512(v23, m4), hi23 = _mm512_and_si512(_mm512_srli_epi16(v23, 4), m4);
    // piece g: values 64 g .. 64 g + 63 = low nibbles of chunk g, then its high nibbles
    p.w[0] = _mm512_shuffle_i64x2(lo01, hi01, 0x44);  // lo01[0:256], hi01[0:256]
    p.w[1] = _mm512_shuffle_i64x2(lo01, hi01, 0xEE);  // lo01[256:512], hi01[256:512]
    p.w[2] = _mm512_shuffle_i64x2(lo23, hi23, 0x44);
    p.w[3] = _mm512_shuffle_i64x2(lo23, hi23, 0xEE);
    for (int g = 0; g < 4; ++g) p.s[g] = _mm512_permutexvar_epi16(wide_idx[g], sc16);
  } else {
  // Q6_K: ql[128], qh[64], scales[16] (int8), d
  const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  p.sc16 = sc;
  const __m512i sc16 = _mm512_castsi256_si512(sc);
  const __m512i m2 = _mm512_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m512i L = _mm512_loadu_si512(blk + 64 * h);  // l0 | l1
    const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
    for (int q = 0; q < 2; ++q) {  // piece 2 h + q: chunks 2 q (l0) and 2 q + 1 (l1) of this half
      const __m512i low = q == 0 ? _mm512_and_si512(L, m4) : _mm512_and_si512(_mm512_srli_epi16(L, 4), m4);
      // the high bits of chunk c are qh >> 2 c: 4 q in the lower 256 bits, 4 q + 2 in the upper
      const __m512i shift = _mm512_set_epi64(4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q, 4 * q, 4 * q, 4 * q);
      const __m512i high = _mm512_and_si512(_mm512_srlv_epi64(H, shift), m2);
      const int e = 2 * h + q;
      p.w[e] = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
      p.s[e] = _mm512_permutexvar_epi16(narrow_idx[e], sc16);
    }
  }
  }
}

// The int32 lanes of one activation row's integer sums against an unpacked super-block (x: the
// row's 256 values; s16: its 16 sums of 16, read for Q6_K).
template <int64_t T>
inline __m512i k_dot1(const KBlock& p, const int8_t* x, const int16_t* s16) {
  __m512i acc = _mm512_setzero_si512();
  for (int e = 0; e < 4; ++e)
    acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(p.w[e], _mm512_loadu_si512(x + 64 * e)), p.s[e]);
  if constexpr (T == Q6_K) {  // - 32 sum_i sc_i * (sum of x over sub-block i)
    const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16));
    const __m256i c = _mm256_slli_epi32(_mm256_madd_epi16(p.sc16, xs), 5);
    acc = _mm512_sub_epi32(acc, _mm512_zextsi256_si512(c));
  }
  return acc;
}

// lane i: the sum of a[i]'s lanes (eight zmm of int32)
inline __m256i reduce8(const __m512i* a) {
  __m256i h[8];
  for (int i = 0; i < 8; ++i) h[i] = _mm256_add_epi32(_mm512_castsi512_si256(a[i]), _mm512_extracti64x4_epi64(a[i], 1));
  const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
  const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(h[4], h[5]), _mm256_hadd_epi32(h[6], h[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// lane i: the sum of m[i]'s four lanes (eight xmm of int32)
inline __m256i reduce8x4(const __m128i* m) {
  const __m128i lo = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
  const __m128i hi = _mm_hadd_epi32(_mm_hadd_epi32(m[4], m[5]), _mm_hadd_epi32(m[6], m[7]));
  return _mm256_set_m128i(hi, lo);
}

// What one call's tiles read of the activations: int8 values [rows, in], per-256 scales dx
// [rows, in / 256], Q4_K's sums of 32 and Q6_K's sums of 16 as int16 ([rows, in / 32], [rows,
// in / 16]; |sum| <= 16 * 127 or 32 * 127).
struct KActs {
  const int8_t* xq;
  const float* dx;
  const int16_t* s32;
  const int16_t* s16;
  int64_t in;
};

// Outputs j .. j + O - 1 against activation rows r .. r + N - 1, into y [rows, out].
template <int64_t T, int O, int N>
void k_tile(const uint8_t* wp, int64_t row_bytes, const KActs& a, int64_t r, int64_t j, float* y,
            int64_t out) {
  constexpr int P = 8 / O;
  static_assert(N >= 1 && N <= P && O * P == 8, "a tile fills at most eight lanes");
  const int64_t in = a.in, nsb = in / 256, bb = block_bytes(T);
  const bool linear = 8 * row_bytes <= 16384;
  count_work(O * nsb, O * N * nsb, nsb);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512i s[8];
    __m128i m[8];
    alignas(16) uint16_t dh[8], mh[8];
    alignas(32) float dxl[8];
    for (int i = 0; i < 8; ++i) {
      s[i] = _mm512_setzero_si512();
      m[i] = _mm_setzero_si128();
      dxl[i] = 0.0f;
    }
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const uint8_t* blk = wp + (j + o) * row_bytes + sb * bb;
#if TREESPEC_PREFETCH_TILES > 0
      // over a group of eight weight rows, every line of the group PREFETCH_TILES ahead is asked
      // for once, ahead of its use: the tiles walk eight streams at once, too short for the
      // hardware's stream prefetcher when the rows are (the 1.5B's q, k, v, o and gate rows are
      // 864 bytes). A small group (<= 16 KB, the head's too) is fetched in address order into L1;
      // a large one (ffn_down's 58 KB) block by block, two groups ahead into L2: each measured
      // fastest for its kind of matrix (bench.roofline's cold one-row GB/s).
      if (linear) {  // the next group's bytes in address order, bb of them per block computed
        const int64_t step = (j % 8) * nsb + sb * O + o;
        const uint8_t* ahead = wp + (j - j % 8 + 8 * TREESPEC_PREFETCH_TILES) * row_bytes + step * bb;
        for (int64_t c = 0; c < bb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T0);
      } else {  // the same block two groups further, into L2 (a group is larger than L1 here)
        const uint8_t* ahead = blk + 16 * TREESPEC_PREFETCH_TILES * row_bytes;
        for (int64_t c = 0; c < bb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T1);
      }
#endif
      KBlock p;
      k_unpack<T>(blk, p);
      uint16_t d, dm = 0;
      std::memcpy(&d, T == Q4_K ? blk : blk + 208, 2);
      if constexpr (T == Q4_K) std::memcpy(&dm, blk + 2, 2);
#pragma GCC unroll 8
      for (int n = 0; n < N; ++n) {
        const int64_t row = r + n;
        const int i = o * P + n;
        s[i] = k_dot1<T>(p, a.xq + row * in + 256 * sb, a.s16 + row * (in / 16) + 16 * sb);
        if constexpr (T == Q4_K)
          m[i] = _mm_madd_epi16(p.mn16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s32 + row * (in / 32) + 8 * sb)));
        dxl[i] = a.dx[row * nsb + sb];
      }
      for (int n = 0; n < P; ++n) {
        dh[o * P + n] = d;
        mh[o * P + n] = dm;
      }
    }
    const __m256 A = _mm256_cvtepi32_ps(reduce8(s));
    const __m256 d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
    const __m256 dx = _mm256_load_ps(dxl);
    if constexpr (T == Q4_K) {
      const __m256 M = _mm256_cvtepi32_ps(reduce8x4(m));
      const __m256 dmin = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mh)));
      const __m256 da = _mm256_mul_ps(d, A), mc = _mm256_mul_ps(dmin, M);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(dx, _mm256_sub_ps(da, mc)));
    } else {
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, dx), A));
    }
  }
  alignas(32) float res[8];
  _mm256_store_ps(res, acc);
  for (int o = 0; o < O; ++o)
    for (int n = 0; n < N; ++n) y[(r + n) * out + j + o] = res[o * P + n];
}

// Eight outputs (j .. j + 7) against the activation rows r .. r + n - 1 (1 <= n <= 8), one pass
// over their weight rows: the tile shape that fills the most lanes.
template <int64_t t>
void k_tiles8(const uint8_t* wp, int64_t row_bytes, const KActs& a, int64_t r, int64_t n, int64_t j, float* y,
              int64_t out) {
  switch (n) {
    case 1: k_tile<t, 8, 1>(wp, row_bytes, a, r, j, y, out); return;
    case 2: for (int o = 0; o < 8; o += 4) k_tile<t, 4, 2>(wp, row_bytes, a, r, j + o, y, out); return;
    case 3: for (int o = 0; o < 8; o += 2) k_tile<t, 2, 3>(wp, row_bytes, a, r, j + o, y, out); return;
    case 4: for (int o = 0; o < 8; o += 2) k_tile<t, 2, 4>(wp, row_bytes, a, r, j + o, y, out); return;
    case 5: for (int o = 0; o < 8; ++o) k_tile<t, 1, 5>(wp, row_bytes, a, r, j + o, y, out); return;
    case 6: for (int o = 0; o < 8; ++o) k_tile<t, 1, 6>(wp, row_bytes, a, r, j + o, y, out); return;
    case 7: for (int o = 0; o < 8; ++o) k_tile<t, 1, 7>(wp, row_bytes, a, r, j + o, y, out); return;
    default: for (int o = 0; o < 8; ++o) k_tile<t, 1, 8>(wp, row_bytes, a, r, j + o, y, out); return;
  }
}

// One output (j) against activation rows r .. r + n - 1 (1 <= n <= 8): the outputs past the last
// multiple of eight.
template <int64_t t>
void k_tile1(const uint8_t* wp, int64_t row_bytes, const KActs& a, int64_t r, int64_t n, int64_t j, float* y,
             int64_t out) {
  switch (n) {
    case 1: k_tile<t, 1, 1>(wp, row_bytes, a, r, j, y, out); return;
    case 2: k_tile<t, 1, 2>(wp, row_bytes, a, r, j, y, out); return;
    case 3: k_tile<t, 1, 3>(wp, row_bytes, a, r, j, y, out); return;
    case 4: k_tile<t, 1, 4>(wp, row_bytes, a, r, j, y, out); return;
    case 5: k_tile<t, 1, 5>(wp, row_bytes, a, r, j, y, out); return;
    case 6: k_tile<t, 1, 6>(wp, row_bytes, a, r, j, y, out); return;
    case 7: k_tile<t, 1, 7>(wp, row_bytes, a, r, j, y, out); return;
    default: k_tile<t, 1, 8>(wp, row_bytes, a, r, j, y, out); return;
  }
}

#endif

// N activation rows (xq[k], dx[k] per 256, sx[k] per 32) against one K-type weight row.
template <int N>
void k_rows(int64_t t, const uint8_t* row, int64_t in, const int8_t* const* xq, const float* const* dx,
            const int32_t* const* sx, float* out) {
  const int64_t bb = block_bytes(t);
  count_work(in / 256, N * (in / 256), in / 256);
  float acc[N];
  for (int k = 0; k < N; ++k) acc[k] = 0.0f;
  for (int64_t sb = 0; sb < in / 256; ++sb) {
    const uint8_t* blk = row + sb * bb;
    const int8_t* x[N];
    for (int k = 0; k < N; ++k) x[k] = xq[k] + 256 * sb;
    int32_t A[N], sc[8], mn[8];
    if (t == Q4_K) q4k_scales(blk + 4, sc, mn);
#if defined(__AVX2__)
    k_totals<N>(t, blk, x, A, sc);
#else
    for (int k = 0; k < N; ++k) A[k] = k_total_plain(t, blk, x[k]);
#endif
    for (int k = 0; k < N; ++k) {
      int32_t M = 0;
      if (t == Q4_K)
        for (int s = 0; s < 8; ++s) M += mn[s] * sx[k][8 * sb + s];
      acc[k] = k_step(t, blk, A[k], M, dx[k][sb], acc[k]);
    }
  }
  for (int k = 0; k < N; ++k) out[k] = acc[k];
}

// Activation rows r .. rows - 1 against one K-type weight row j (y: column j of [rows, out]): groups
// of four, then the last one to three rows together, never one by one.
void k_rows_upto4(int64_t t, const uint8_t* row, int64_t in, const int8_t* xq, const float* dx, const int32_t* sx,
                  int64_t rows, int64_t r, float* y, int64_t out) {
  const int64_t nx = in / 256;
  while (r < rows) {
    const int64_t n = std::min<int64_t>(4, rows - r);
    const int8_t* xk[4];
    const float* dk[4];
    const int32_t* sk[4];
    for (int64_t k = 0; k < n; ++k) {
      xk[k] = xq + (r + k) * in;
      dk[k] = dx + (r + k) * nx;
      sk[k] = sx + (r + k) * (in / QB);
    }
    float o[4];
    switch (n) {
      case 1: k_rows<1>(t, row, in, xk, dk, sk, o); break;
      case 2: k_rows<2>(t, row, in, xk, dk, sk, o); break;
      case 3: k_rows<3>(t, row, in, xk, dk, sk, o); break;
      default: k_rows<4>(t, row, in, xk, dk, sk, o); break;
    }
    for (int64_t k = 0; k < n; ++k) y[(r + k) * out] = o[k];
    r += n;
  }
}

#if defined(TREESPEC_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TREESPEC_AMX 1
// ---------------------------------------------------------------------------------------------------
// The K types with AMX (Sapphire Rapids and later), for many activation rows: tile products give
// the exact integer totals A of 16 weight rows with 16 activation rows per super-block, and the
// float chain runs the 16 activation rows side by side in the lanes of one vector, every lane doing
// exactly k_step's operations. Same integers, same chain: the same bits as every other path.
//
// The sub-block scales go into the weights before the product: w' = sc * q per value (Q4_K:
// 0..945; Q6_K: -4064..4096, stored offset by 4096 as 32..8192), split into two unsigned bytes,
// lo = w' & 255 and hi = w' >> 8. TDPBUSD (unsigned bytes times signed bytes, summed in int32)
// then gives A = C_lo + 256 C_hi (Q6_K: - 4096 * the super-block's sum of x) over the whole
// super-block in four 64-value steps per plane: no per-sub-block stores or multiplies. Bounds (|x|
// <= 127, 256 values): C_lo <= 8.3e6, 256 C_hi <= 2.7e8, all in int32.
//
// Operands: the weight planes are the product's A (16 weight rows, row-major, as decoded), the
// activations its B (four consecutive values of each of 16 rows in one 32-bit lane: `AmxRows`,
// built once per call), so C[n][m] is weight row n against activation row m.

// Linux gives a process the tile registers only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 C_lo, 1 A_lo, 2 B, 3 C_hi, 4 A_hi; every one 16 rows of 64 bytes.
void amx_configure() {
  TileConfig cfg;
  for (int i = 0; i < 5; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  // GCC 12 does not see that ldtilecfg reads the struct and drops the stores above without this
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Up to 16 activation rows (from `r`), laid out for the tile product and the vector chain; lanes
// past the last row are zero.
struct AmxRows {
  std::vector<int32_t> xw;    // [in / 4][16]: lane m = values 4 k .. 4 k + 3 of row m
  std::vector<float> dx;      // [in / 256][16]
  std::vector<int32_t> sxp;   // [in / 64][16]: lane m = (sx[m][2 p], sx[m][2 p + 1]) as int16
  std::vector<int32_t> xsum;  // [in / 256][16]: the super-block's sum of x
  int64_t r = 0, n = 0;
};

AmxRows amx_rows_of(const int8_t* xq, const float* dx, const int32_t* sx, int64_t in, int64_t r,
                    int64_t n) {
  AmxRows a;
  a.r = r;
  a.n = n;
  a.xw.assign(in / 4 * 16, 0);
  a.dx.assign(in / 256 * 16, 0.0f);
  a.sxp.assign(in / 64 * 16, 0);
  a.xsum.assign(in / 256 * 16, 0);
  for (int64_t m = 0; m < n; ++m) {
    const int8_t* x = xq + (r + m) * in;
    const int32_t* s = sx + (r + m) * (in / QB);
    for (int64_t k = 0; k < in / 4; ++k) std::memcpy(&a.xw[k * 16 + m], x + 4 * k, 4);
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      a.dx[sb * 16 + m] = dx[(r + m) * (in / 256) + sb];
      for (int k = 0; k < 8; ++k) a.xsum[sb * 16 + m] += s[8 * sb + k];
    }
    for (int64_t p = 0; p < in / 64; ++p)
      a.sxp[p * 16 + m] =
          int32_t(uint32_t(uint16_t(int16_t(s[2 * p]))) | (uint32_t(uint16_t(int16_t(s[2 * p + 1]))) << 16));
  }
  return a;
}

// 16 weight rows decoded: the planes lo and hi [16][in] uint8, and per super-block Q4_K's mins as
// int16 pairs and the half scales d (and dmin) as floats.
struct AmxWeights {
  std::vector<uint8_t> lo, hi;
  std::vector<int32_t> mnp;    // [16][in / 256][4]: (mn[2 p], mn[2 p + 1]) as int16
  std::vector<float> d, dmin;  // [16][in / 256]
};

// 32 int16 products w' (offset included) -> their low and high bytes
inline void amx_split(__m512i prod, uint8_t* lo, uint8_t* hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi16_epi8(prod));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi16_epi8(_mm512_srli_epi16(prod, 8)));
}

void amx_decode_block(int64_t t, const uint8_t* blk, uint8_t* lo, uint8_t* hi, int32_t* mnp, float* d,
                      float* dmin) {
  if (t == Q4_K) {
    // w' = sc * q with sc = 16 sh + sl: lo = sl * q (<= 225), hi = sh * q (<= 45), so that
    // sum x w' = C_lo + 16 C_hi; each a byte lookup (vpshufb) of q in a table of multiples
    alignas(64) static const auto mul = [] {
      std::array<uint8_t, 256> m{};
      for (int c = 0; c < 16; ++c)
        for (int i = 0; i < 16; ++i) m[16 * c + i] = uint8_t(c * i);
      return m;
    }();
    const auto table = [&](int a, int b) {  // 128-bit lanes 0, 1: multiples of a; 2, 3: of b
      const __m512i ta = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(&mul[16 * a])));
      const __m256i tb = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(&mul[16 * b])));
      return _mm512_inserti64x4(ta, tb, 1);
    };
    int32_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    for (int k = 0; k < 4; ++k) mnp[k] = int32_t(uint32_t(mn[2 * k]) | (uint32_t(mn[2 * k + 1]) << 16));
    *d = half_to_float(blk);
    *dmin = half_to_float(blk + 2);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {  // values 64 g .. 64 g + 63: sub-blocks 2 g (low nibbles), 2 g + 1
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * g));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                           _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
      const int a = 2 * g, b = 2 * g + 1;
      _mm512_storeu_si512(lo + 64 * g, _mm512_shuffle_epi8(table(sc[a] & 15, sc[b] & 15), q));
      _mm512_storeu_si512(hi + 64 * g, _mm512_shuffle_epi8(table(sc[a] >> 4, sc[b] >> 4), q));
    }
    return;
  }
  // Q6_K: the integers q - 32 (as k_unpack decodes them), 16 int8 scales (one per 16 values), d
  static const __m512i pair_idx[8] = {
      spread_index(0, true), spread_index(2, true),  spread_index(4, true),  spread_index(6, true),
      spread_index(8, true), spread_index(10, true), spread_index(12, true), spread_index(14, true)};
  *d = half_to_float(blk + 208);
  const __m512i sc16 = _mm512_castsi256_si512(
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
  const __m512i offset = _mm512_set1_epi16(4096);
  KBlock p;
  k_unpack<Q6_K>(blk, p);
  const __m512i k32 = _mm512_set1_epi8(32);
  for (int e = 0; e < 4; ++e) {
    const __m512i w = _mm512_sub_epi8(p.w[e], k32);  // q - 32, values 64 e .. 64 e + 63
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * e + h;  // values 32 i .. 32 i + 31: sub-blocks 2 i and 2 i + 1
      const __m256i part = h == 0 ? _mm512_castsi512_si256(w) : _mm512_extracti64x4_epi64(w, 1);
      const __m512i scale = _mm512_permutexvar_epi16(pair_idx[i], sc16);
      const __m512i prod = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_cvtepi8_epi16(part), scale), offset);
      amx_split(prod, lo + 32 * i, hi + 32 * i);
    }
  }
}

void amx_decode(int64_t t, const uint8_t* rows, int64_t row_bytes, int64_t in, AmxWeights& w) {
  const int64_t nsb = in / 256, bb = block_bytes(t);
  w.lo.resize(16 * in);
  w.hi.resize(16 * in);
  w.mnp.resize(16 * nsb * 4);
  w.d.resize(16 * nsb);
  w.dmin.resize(16 * nsb);  // Q4_K's; Q6_K leaves it unread
  for (int n = 0; n < 16; ++n)
    for (int64_t sb = 0; sb < nsb; ++sb)
      amx_decode_block(t, rows + n * row_bytes + sb * bb, w.lo.data() + n * in + 256 * sb,
                       w.hi.data() + n * in + 256 * sb, w.mnp.data() + (n * nsb + sb) * 4,
                       w.d.data() + n * nsb + sb, w.dmin.data() + n * nsb + sb);
}

// One super-block's tile products: c[0..255] = C_lo, c[256..511] = C_hi ([16][16] int32 each).
inline void amx_superblock(const uint8_t* lo, const uint8_t* hi, int64_t in, const int32_t* xw, int32_t* c) {
  _tile_zero(0);
  _tile_zero(3);
  for (int k = 0; k < 4; ++k) {
    _tile_loadd(2, xw + 16 * 16 * k, 64);
    _tile_loadd(1, lo + 64 * k, in);
    _tile_loadd(4, hi + 64 * k, in);
    _tile_dpbusd(0, 1, 2);
    _tile_dpbusd(3, 4, 2);
  }
  _tile_stored(0, c, 64);
  _tile_stored(3, c + 256, 64);
}

// 16 weight rows (outputs j .. j + 15) against the rows in `a`: y[r + m][j + n].
void amx_block(int64_t t, const AmxWeights& w, int64_t in, const AmxRows& a, float* yp, int64_t out, int64_t j) {
  const int64_t nsb = in / 256;
  alignas(64) int32_t c[2 * 256];
  __m512 acc[16];
  for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    amx_superblock(w.lo.data() + 256 * sb, w.hi.data() + 256 * sb, in, a.xw.data() + sb * 64 * 16, c);
    const __m512 dx = _mm512_loadu_ps(a.dx.data() + sb * 16);
    const __m512i xsum4096 = _mm512_slli_epi32(_mm512_loadu_si512(a.xsum.data() + sb * 16), 12);
    for (int n = 0; n < 16; ++n) {
      // Q4_K: lo + 16 hi (the scale's two nibbles); Q6_K: lo + 256 hi (the product's two bytes)
      __m512i A = _mm512_add_epi32(_mm512_load_si512(c + 16 * n),
                                   _mm512_slli_epi32(_mm512_load_si512(c + 256 + 16 * n), t == Q4_K ? 4 : 8));
      const __m512 d = _mm512_set1_ps(w.d[n * nsb + sb]);
      if (t == Q4_K) {
        __m512i M = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k)
          M = _mm512_dpwssd_epi32(M, _mm512_set1_epi32(w.mnp[(n * nsb + sb) * 4 + k]),
                                  _mm512_loadu_si512(a.sxp.data() + (4 * sb + k) * 16));
        const __m512 da = _mm512_mul_ps(d, _mm512_cvtepi32_ps(A));
        const __m512 mc = _mm512_mul_ps(_mm512_set1_ps(w.dmin[n * nsb + sb]), _mm512_cvtepi32_ps(M));
        acc[n] = _mm512_add_ps(acc[n], _mm512_mul_ps(dx, _mm512_sub_ps(da, mc)));
      } else {
        A = _mm512_sub_epi32(A, xsum4096);
        const __m512 scale = _mm512_mul_ps(d, dx);
        acc[n] = _mm512_add_ps(acc[n], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(A)));
      }
    }
  }
  alignas(64) float o[16][16];
  for (int n = 0; n < 16; ++n) _mm512_store_ps(o[n], acc[n]);
  for (int64_t m = 0; m < a.n; ++m)
    for (int n = 0; n < 16; ++n) yp[(a.r + m) * out + j + n] = o[n][m];
}

// Outputs [lo, hi) (multiples of 16) of a K-type projection for every row tile in `tiles`.
void amx_outputs(int64_t t, const uint8_t* wp, int64_t row_bytes, int64_t in, const std::vector<AmxRows>& tiles,
                 float* yp, int64_t out, int64_t lo, int64_t hi) {
  amx_configure();
  AmxWeights w;
  for (int64_t j = lo; j < hi; j += 16) {
    amx_decode(t, wp + j * row_bytes, row_bytes, in, w);
    for (const AmxRows& a : tiles) {
      count_work(&a == &tiles.front() ? 16 * (in / 256) : 0, 16 * a.n * (in / 256), in / 256);
      amx_block(t, w, in, a, yp, out, j);
    }
  }
  _tile_release();
}
#endif

// Rows from which the K types go to the AMX path where the CPU has it (0: never; set by
// `set_amx_min_rows` for the tests and the benchmark's A/B).
#if defined(TREESPEC_AVX512)

#if defined(TREESPEC_AVX512)
// ---------------------------------------------------------------------------------------------------
// The K types with the activation rows in the lanes (AVX-512 VNNI), for many rows: each lane of a
// vector is one activation row (16 of them in a zmm, 8 in a ymm), and one weight row's four
// consecutive values are broadcast to every lane, so one dpbusd does 4 multiply-adds for each of
// the rows (twice the maddubs-then-dpwssd pair's rate), and the weight row is unpacked once per
// call whatever the number of rows.
//
// dpbusd multiplies unsigned bytes by signed ones; here the activations take the unsigned side, as
// x + 128 (0..255), and the weights the signed one (Q4_K: 0..15, Q6_K: q, 0..63). So for a
// sub-block s, C_s = sum (x + 128) q = sum x q + 128 W_s with W_s = sum q, and the totals are
//   Q4_K  A = sum_s sc_s C_s - 128 sum_s sc_s W_s                 (the last sum: one integer per
//   Q6_K  A = sum_i sc_i C_i - 128 sum_i sc_i W_i - 32 sum_i sc_i X_i      weight block, K)
// with X_i a row's sum of x over sub-block i (Q6_K's q - 32 offset), and Q4_K's M = sum_s mn_s X_s
// by dpwssd of the rows' sums of 32 (int16 pairs) with the mins. Every sum is exact in int32
// (|C_s| <= 32 * 15 * 255 for Q4_K, 16 * 63 * 255 for Q6_K; |A| < 2^28): the same A and M as
// every other path, then k_step's float chain in each lane.

// The activation rows r .. r + n - 1 laid out for L lanes (lanes past n are rows of zeros).
struct LaneRows {
  std::vector<int32_t> xw;   // [in / 4][L]: lane m = values 4 k .. 4 k + 3 of row m, each + 128
  std::vector<int32_t> xs;   // [in / 64][L] Q4_K: (sum of x over values 64 p .. 64 p + 31, over the
                             // next 32) as int16; [in / 32][L] Q6_K: the same per 16 values
  std::vector<float> dx;     // [in / 256][L]
  int64_t r = 0, n = 0;
};

template <int L>
LaneRows lane_rows(int64_t t, const int8_t* xq, const float* dx, const int16_t* s32, const int16_t* s16, int64_t in,
                   int64_t r, int64_t n) {
  LaneRows a;
  a.r = r;
  a.n = n;
  a.xw.assign(in / 4 * L, int32_t(0x80808080u));
  const int64_t pairs = t == Q4_K ? in / 64 : in / 32;
  a.xs.assign(pairs * L, 0);
  a.dx.assign(in / 256 * L, 0.0f);
  for (int64_t m = 0; m < n; ++m) {
    const int8_t* x = xq + (r + m) * in;
    for (int64_t k = 0; k < in / 4; ++k) {
      uint32_t v;
      std::memcpy(&v, x + 4 * k, 4);
      a.xw[k * L + m] = int32_t(v ^ 0x80808080u);
    }
    const int16_t* s = t == Q4_K ? s32 + (r + m) * (in / 32) : s16 + (r + m) * (in / 16);
    for (int64_t p = 0; p < pairs; ++p)
      a.xs[p * L + m] = int32_t(uint32_t(uint16_t(s[2 * p])) | (uint32_t(uint16_t(s[2 * p + 1])) << 16));
    for (int64_t sb = 0; sb < in / 256; ++sb) a.dx[sb * L + m] = dx[(r + m) * (in / 256) + sb];
  }
  return a;
}

// One weight super-block unpacked for the lanes: its 256 integers in value order (q, as signed
// bytes), the sub-block scales, K, and the block's half scales.
struct LaneBlock {
  alignas(64) int8_t q[256];
  int32_t sc[16];
  int32_t mn[8];  // Q4_K's mins, as int16 pairs in mnp
  int32_t mnp[4];
  int32_t scp[8];  // Q6_K's scales as int16 pairs (for the X term)
  int32_t k;
  float d, dmin;
};

template <int64_t T>
inline void lane_unpack(const uint8_t* blk, LaneBlock& b) {
  KBlock p;
  k_unpack<T>(blk, p);
  // k_unpack's pieces hold values 64 e .. 64 e + 63 in order (see there)
  for (int e = 0; e < 4; ++e) _mm512_store_si512(b.q + 64 * e, p.w[e]);
  // K = sum_v sc(v) q_v, by maddubs of the integers with the scales spread as bytes
  __m512i kacc = _mm512_setzero_si512();
  if constexpr (T == Q4_K) {
    uint64_t sc, mn;
    q4k_scales_packed(blk + 4, &sc, &mn);
    for (int s = 0; s < 8; ++s) {
      b.sc[s] = int32_t((sc >> (8 * s)) & 0xFF);
      b.mn[s] = int32_t((mn >> (8 * s)) & 0xFF);
    }
    for (int k = 0; k < 4; ++k) b.mnp[k] = int32_t(uint32_t(b.mn[2 * k]) | (uint32_t(b.mn[2 * k + 1]) << 16));
    b.d = half_to_float(blk);
    b.dmin = half_to_float(blk + 2);
  } else {
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) b.sc[i] = scales[i];
    for (int k = 0; k < 8; ++k)
      b.scp[k] = int32_t(uint32_t(uint16_t(int16_t(scales[2 * k]))) | (uint32_t(uint16_t(int16_t(scales[2 * k + 1]))) << 16));
    b.d = half_to_float(blk + 208);
    b.dmin = 0.0f;
  }
  // p.s[e]: the int16 scale of each maddubs pair of piece e; maddubs(q, 1) then madd with them
  const __m512i ones8 = _mm512_set1_epi8(1);
  for (int e = 0; e < 4; ++e) kacc = _mm512_dpwssd_epi32(kacc, _mm512_maddubs_epi16(p.w[e], ones8), p.s[e]);
  b.k = _mm512_reduce_add_epi32(kacc);
}

// The vector of L lanes: the few operations the lanes' blocks take, for a zmm (16) and a ymm (8).
struct Lanes16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I dpbusd(I c, I a, I b) { return _mm512_dpbusd_epi32(c, a, b); }
  static I dpwssd(I c, I a, I b) { return _mm512_dpwssd_epi32(c, a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I times32(I a) { return _mm512_slli_epi32(a, 5); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
};

struct Lanes8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int L = 8;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I dpbusd(I c, I a, I b) { return _mm256_dpbusd_epi32(c, a, b); }
  static I dpwssd(I c, I a, I b) { return _mm256_dpwssd_epi32(c, a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I times32(I a) { return _mm256_slli_epi32(a, 5); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
};

// G weight rows' super-block sb against one chunk of rows (lanes): acc[o * 16 ..] += each one's
// float step. Each activation step (4 values of every row) is loaded once and used by the G
// weight rows, whose 4 values are broadcast: G dpbusd per load.
template <int64_t T, class V, int G>
inline void lane_blocks(const LaneBlock* b, const LaneRows& a, int64_t sb, float* acc, int64_t acc_stride) {
  constexpr int L = V::L;
  constexpr int SUB = T == Q4_K ? 32 : 16;  // values per sub-block
  const int32_t* xw = a.xw.data() + (sb * 64) * L;  // 64 steps of 4 values per super-block
  typename V::I A[G];
#pragma GCC unroll 8
  for (int o = 0; o < G; ++o) A[o] = V::set1(-128 * b[o].k);
  for (int s = 0; s < 256 / SUB; ++s) {
    typename V::I c[G];
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) c[o] = V::zero();
#pragma GCC unroll 8
    for (int k = 0; k < SUB / 4; ++k) {
      const int step = s * (SUB / 4) + k;
      const typename V::I x = V::load(xw + step * L);
#pragma GCC unroll 8
      for (int o = 0; o < G; ++o) {
        int32_t w;
        std::memcpy(&w, b[o].q + 4 * step, 4);
        c[o] = V::dpbusd(c[o], x, V::set1(w));
      }
    }
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) A[o] = V::add(A[o], V::mullo(c[o], V::set1(b[o].sc[s])));
  }
  const typename V::F dx = V::fload(a.dx.data() + sb * L);
  if constexpr (T == Q4_K) {
    const int32_t* xs = a.xs.data() + (sb * 4) * L;
    typename V::I M[G];
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) M[o] = V::zero();
    for (int p = 0; p < 4; ++p) {
      const typename V::I x = V::load(xs + p * L);
#pragma GCC unroll 8
      for (int o = 0; o < G; ++o) M[o] = V::dpwssd(M[o], x, V::set1(b[o].mnp[p]));
    }
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) {
      float* y = acc + o * acc_stride;
      const typename V::F da = V::fmul(V::fset1(b[o].d), V::cvt(A[o]));
      const typename V::F mc = V::fmul(V::fset1(b[o].dmin), V::cvt(M[o]));
      V::fstore(y, V::fadd(V::fload(y), V::fmul(dx, V::fsub(da, mc))));
    }
  } else {
    const int32_t* xs = a.xs.data() + (sb * 8) * L;
    typename V::I X[G];
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) X[o] = V::zero();
    for (int p = 0; p < 8; ++p) {
      const typename V::I x = V::load(xs + p * L);
#pragma GCC unroll 8
      for (int o = 0; o < G; ++o) X[o] = V::dpwssd(X[o], x, V::set1(b[o].scp[p]));
    }
#pragma GCC unroll 8
    for (int o = 0; o < G; ++o) {
      float* y = acc + o * acc_stride;
      const typename V::I total = V::sub(A[o], V::times32(X[o]));
      V::fstore(y, V::fadd(V::fload(y), V::fmul(V::fmul(V::fset1(b[o].d), dx), V::cvt(total))));
    }
  }
}

// Outputs lo .. hi - 1 against every activation row, the rows in lanes: chunks of 16 (zmm) and a
// last chunk of up to 8 (ymm) where it fits. Eight outputs at a time: their super-block unpacked
// once, then each chunk's activations for that super-block (4 KB) serve all eight from L1.
template <int64_t T>
void lane_outputs(const uint8_t* wp, int64_t row_bytes, const std::vector<LaneRows>& chunks,
                  const std::vector<int>& widths, int64_t in, float* yp, int64_t ld, int64_t lo, int64_t hi) {
  constexpr int G = 8;
  const int64_t nsb = in / 256, bb = block_bytes(T), nc = int64_t(chunks.size());
  std::vector<float> acc(G * nc * 16);
  std::vector<LaneBlock> b(G);
  for (int64_t j0 = lo; j0 < hi; j0 += G) {
    const int64_t g = std::min<int64_t>(G, hi - j0);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int64_t o = 0; o < g; ++o) {
        const uint8_t* blk = wp + (j0 + o) * row_bytes + sb * bb;
        for (int64_t c = 0; c < bb; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + G * row_bytes + c), _MM_HINT_T0);
        lane_unpack<T>(blk, b[o]);
      }
      count_work(g, 0, 0);
      for (int64_t c = 0; c < nc; ++c) {
        count_work(0, g * chunks[c].n, g);
        float* a = acc.data() + c * 16;
        const bool wide = widths[c] == 16;
        if (g == G && wide) {
          lane_blocks<T, Lanes16, G>(b.data(), chunks[c], sb, a, nc * 16);
        } else if (g == G) {
          lane_blocks<T, Lanes8, G>(b.data(), chunks[c], sb, a, nc * 16);
        } else {
          for (int64_t o = 0; o < g; ++o) {
            if (wide)
              lane_blocks<T, Lanes16, 1>(b.data() + o, chunks[c], sb, a + o * nc * 16, nc * 16);
            else
              lane_blocks<T, Lanes8, 1>(b.data() + o, chunks[c], sb, a + o * nc * 16, nc * 16);
          }
        }
      }
    }
    for (int64_t o = 0; o < g; ++o)
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t m = 0; m < chunks[c].n; ++m) yp[(chunks[c].r + m) * ld + j0 + o] = acc[(o * nc + c) * 16 + m];
  }
}

#endif

// Outputs first .. out - 1 of the K types on AVX-512: tiles of eight outputs, each a pass over
// their weight rows per eight activation rows; the outputs past the last multiple of eight one by
// one. Threads take whole tiles (eight consecutive weight rows, no cache line of y shared).
void k_outputs_avx512(int64_t t, const uint8_t* wp, int64_t row_bytes, const int8_t* xq, const float* dx,
                      const int32_t* sx, int64_t rows, int64_t in, int64_t first, int64_t out, int64_t grain,
                      float* yp, int64_t ld) {
  std::vector<int16_t> s32(rows * (in / 32)), s16(rows * (in / 16));
  for (int64_t i = 0; i < rows * (in / 32); ++i) s32[i] = int16_t(sx[i]);
  for (int64_t i = 0; i < rows * (in / 16); ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += xq[16 * i + k];
    s16[i] = int16_t(sum);
  }
  if (g_lanes_min_rows > 0 && rows >= g_lanes_min_rows) {  // the rows in the lanes
    std::vector<LaneRows> chunks;
    std::vector<int> widths;
    for (int64_t r = 0; r < rows; r += 16) {
      const int64_t n = std::min<int64_t>(16, rows - r);
      widths.push_back(n <= 8 ? 8 : 16);
      chunks.push_back(n <= 8 ? lane_rows<8>(t, xq, dx, s32.data(), s16.data(), in, r, n)
                              : lane_rows<16>(t, xq, dx, s32.data(), s16.data(), in, r, n));
    }
    const auto run = t == Q4_K ? lane_outputs<Q4_K> : lane_outputs<Q6_K>;
    at::parallel_for(first, out, std::max<int64_t>(1, grain), [&](int64_t lo, int64_t hi) {
      run(wp, row_bytes, chunks, widths, in, yp, ld, lo, hi);
    });
    return;
  }
  const KActs acts{xq, dx, s32.data(), s16.data(), in};
  const int64_t tiles = (out - first) / 8;
  const auto tiles8 = t == Q4_K ? k_tiles8<Q4_K> : k_tiles8<Q6_K>;
  const auto tile1 = t == Q4_K ? k_tile1<Q4_K> : k_tile1<Q6_K>;
  at::parallel_for(0, tiles, std::max<int64_t>(1, grain / 8), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t r = 0; r < rows; r += 8)
        tiles8(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), first + 8 * b, yp, ld);
  });
  for (int64_t j = first + 8 * tiles; j < out; ++j)
    for (int64_t r = 0; r < rows; r += 8) tile1(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), j, yp, ld);
}
#endif

int64_t g_amx_min_rows = 9;

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

#if defined(TREESPEC_AVX512)
// One activation block of qx values (32 or 256) quantized as quantize_rows' scalar loop does, 16
// values at a time, with the same results: max|x| by max_ps (which, like fmax, keeps the other
// operand where one is NaN), q = v * (1 / d) rounded half to even (roundscale), then clamped by
// min_ps(q, 127) and max_ps(q, -127) in that order (a NaN q becomes 127, as fmin(127, NaN) does).
inline void quantize_block_avx512(const float* v, int64_t qx, int8_t* q, int32_t* sums, float* dout) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < qx; k += 16) amax = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(v + k), sign), amax);
  const float m = _mm512_reduce_max_ps(amax);
  const float d = m / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 idv = _mm512_set1_ps(id), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int64_t s = 0; s < qx / QB; ++s) {
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const float* p = v + s * QB + 16 * h;
      __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(p), idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_max_ps(_mm512_min_ps(r, hi), lo);
      const __m512i qi = _mm512_cvttps_epi32(r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + s * QB + 16 * h), _mm512_cvtepi32_epi8(qi));
      sum = _mm512_add_epi32(sum, qi);
    }
    sums[s] = _mm512_reduce_add_epi32(sum);
  }
  *dout = d;
}
#endif

// x: [rows, in] float32, qx: the activation block (32 or 256) -> (xq [rows, in] int8, dx
// [rows, in / qx] float32, sx [rows, in / 32] int32: the sums of every 32 int8 values)
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x_, int64_t qx) {
  TORCH_CHECK(x_.device().is_cpu() && x_.scalar_type() == torch::kFloat32 && x_.dim() == 2,
              "x must be a [rows, in] float32 CPU tensor");
  TORCH_CHECK(qx == 32 || qx == 256, "the activation block must be 32 or 256, got ", qx);
  const torch::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % qx == 0, "in_features (", in, ") must be a multiple of ", qx);
  const int64_t nb = in / qx;
  auto xq = torch::empty({rows, in}, torch::kInt8);
  auto dx = torch::empty({rows, nb}, torch::kFloat32);
  auto sx = torch::empty({rows, in / QB}, torch::kInt32);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int32_t* sp = sx.data_ptr<int32_t>();
  at::parallel_for(0, rows * nb, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* v = xp + i * qx;
#if defined(TREESPEC_AVX512)
      quantize_block_avx512(v, qx, qp + i * qx, sp + i * (qx / QB), dp + i);
      continue;
#endif
      float amax = 0.0f;
      for (int64_t k = 0; k < qx; ++k) amax = std::fmax(amax, std::fabs(v[k]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t s = 0; s < qx / QB; ++s) {
        int32_t sum = 0;
        for (int k = 0; k < QB; ++k) {
          const float q = std::nearbyint(v[s * QB + k] * id);  // round half to even, as torch.round
          const int8_t qi = int8_t(std::fmax(-127.0f, std::fmin(127.0f, q)));
          qp[i * qx + s * QB + k] = qi;
          sum += qi;
        }
        sp[i * (qx / QB) + s] = sum;
      }
      dp[i] = d;
    }
  });
  return {xq, dx, sx};
}

// x: [rows, in] float32, w: [out, bytes per row] uint8 blocks of type t -> [rows, out] float32
// The quantized activations of one call, for weights of one activation block size (qx).
struct QuantRows {
  torch::Tensor xq, dx, sx, dxt, sxt;  // dxt, sxt: block-major copies for the four-row paths' loads
  int64_t rows = 0, in = 0, qx = 0;
};

QuantRows quantize_for(const torch::Tensor& x, int64_t qx) {
  QuantRows a;
  auto q = quantize_rows(x, qx);
  a.xq = q[0];
  a.dx = q[1];
  a.sx = q[2];
  a.dxt = q[1].t().contiguous();
  a.sxt = q[2].t().contiguous();
  a.rows = x.size(0);
  a.in = x.size(1);
  a.qx = qx;
  return a;
}

// y[:, 0:out] (row stride ld) = the quantized rows times the out x in matrix w of type t
void matmul_part(const QuantRows& a, const torch::Tensor& w, int64_t t, float* yp, int64_t ld) {
  const int64_t rows = a.rows, in = a.in, out = w.size(0), nx = in / a.qx;
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* dx = a.dx.data_ptr<float>();
  const int32_t* sx = a.sx.data_ptr<int32_t>();
  const float* dxT = a.dxt.data_ptr<float>();
  const int32_t* sxT = a.sxt.data_ptr<int32_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  (void)dxT;
  (void)sxT;
  (void)nx;
  // at least ~256 KB of weights (times the rows of x) per task: a small matrix (the 1.5B's k and v,
  // 0.2 MB) runs on the calling thread, without waking the pool's sleeping threads (the verifier
  // runs with OMP_WAIT_POLICY=PASSIVE, and a forward calls this ~200 times)
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 18) / std::max<int64_t>(1, row_bytes * rows));
  int64_t first = 0;  // outputs before `first` are done by the AMX path
#if defined(TREESPEC_AMX)
  if (k_type(t) && g_amx_min_rows > 0 && rows >= g_amx_min_rows && out >= 16 && amx_permitted()) {
    std::vector<AmxRows> tiles;
    for (int64_t r = 0; r < rows; r += 16) tiles.push_back(amx_rows_of(xq, dx, sx, in, r, std::min<int64_t>(16, rows - r)));
    first = out / 16 * 16;
    at::parallel_for(0, first / 16, std::max<int64_t>(1, grain / 16), [&](int64_t lo, int64_t hi) {
      amx_outputs(t, wp, row_bytes, in, tiles, yp, ld, 16 * lo, 16 * hi);
    });
  }
#endif
#if defined(TREESPEC_AVX512)
  if (k_type(t)) {
    k_outputs_avx512(t, wp, row_bytes, xq, dx, sx, rows, in, first, out, grain, yp, ld);
    return;
  }
#endif
  at::parallel_for(first, out, grain, [&](int64_t lo, int64_t hi) {
    std::vector<int8_t> wq(in);
    for (int64_t j = lo; j < hi; ++j) {
      const uint8_t* row = wp + j * row_bytes;
#if defined(__SSE__) && TREESPEC_PREFETCH_ROWS > 0
      // the weight row PREFETCH_ROWS ahead, line by line: the hardware's streamer stops at every 4 KB
      // page of the file's mapping, and a forward reads each matrix once, from memory
      if (j + TREESPEC_PREFETCH_ROWS < hi) {
        const char* ahead = reinterpret_cast<const char*>(row + TREESPEC_PREFETCH_ROWS * row_bytes);
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
#endif
      int64_t r = 0;
      if (k_type(t)) {
#if defined(__AVX2__)
        for (; r + 4 <= rows; r += 4) {
          const int8_t* x4[4] = {xq + r * in, xq + (r + 1) * in, xq + (r + 2) * in, xq + (r + 3) * in};
          float o[4];
          k_rows4(t, row, in, x4, dxT, sxT, rows, r, o);
          for (int k = 0; k < 4; ++k) yp[(r + k) * ld + j] = o[k];
        }
#endif
        k_rows_upto4(t, row, in, xq, dx, sx, rows, r, yp + j, ld);
        continue;
      }
      const int8_t* wdec = nullptr;  // Q8_0 is read straight from its blocks
      if (t == Q5_0 || t == Q4_1) {
        decode_row(t, row, in, wq.data());
        wdec = wq.data();
      }
#if defined(__AVX2__)
      if (rows >= 4 && wdec == nullptr) {
        decode_row(t, row, in, wq.data());
        wdec = wq.data();
      }
      for (; r + 4 <= rows; r += 4) {
        const int8_t* xq4[4] = {xq + r * in, xq + (r + 1) * in, xq + (r + 2) * in, xq + (r + 3) * in};
        float o[4];
        dot32_rows4(t, row, in, wdec, xq4, dxT, sxT, rows, r, o);
        for (int k = 0; k < 4; ++k) yp[(r + k) * ld + j] = o[k];
      }
#endif
      for (; r < rows; ++r)
        yp[r * ld + j] = dot32_row(t, row, in, wdec, xq + r * in, dx + r * nx, sx + r * (in / QB));
    }
  });
}

// x: [rows, in] float32, w: [out, bytes per row] uint8 blocks of type t -> [rows, out] float32
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  check_weight(w, t, x.size(1));
  if (g_counting) ++g_work.calls;
  auto y = torch::empty({x.size(0), w.size(0)}, torch::kFloat32);
  matmul_part(quantize_for(x, k_type(t) ? 256 : QB), w, t, y.data_ptr<float>(), w.size(0));
  return y;
}

// x [rows, in] against several matrices stacked along the outputs (a fused q|k|v or gate|up whose
// parts may be of different types) -> [rows, sum of their outputs]: x is quantized once per
// activation block size, and every part writes its own columns (each column as quant_matmul of
// that part alone computes it).
torch::Tensor quant_matmul_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                                 const std::vector<int64_t>& ts) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  TORCH_CHECK(!ws.empty() && ws.size() == ts.size(), "give one type per part (", ws.size(), " parts, ",
              ts.size(), " types)");
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], ts[i], x.size(1));
    total += ws[i].size(0);
  }
  auto y = torch::empty({x.size(0), total}, torch::kFloat32);
  QuantRows k, b;  // the K types' activations (per 256) and the others' (per 32), each made once
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    QuantRows& a = k_type(ts[i]) ? k : b;
    if (a.qx == 0) a = quantize_for(x, k_type(ts[i]) ? 256 : QB);
    matmul_part(a, ws[i], ts[i], y.data_ptr<float>() + col, total);
    col += ws[i].size(0);
  }
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
        } else if (t == Q4_1) {
          const float d = half_to_float(blk), m = half_to_float(blk + 2);
          for (int k = 0; k < 32; ++k) {
            const float p = d * float(qb[k]);
            ob[k] = p + m;
          }
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

// The roofline's probes (bench.roofline): what the memory and the integer units of these cores give.

// Reads every byte of buf once (64-byte loads, summed so that no load can be dropped), split
// across the torch threads in contiguous chunks: the read bandwidth the projections can reach.
int64_t stream_read(const torch::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == torch::kUInt8 && buf.is_contiguous(),
              "the buffer must be a contiguous uint8 CPU tensor");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t lines = buf.numel() / 64;
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t lo, int64_t hi) {
#if defined(__AVX2__)
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    for (int64_t i = lo; i < hi; ++i) {
      acc0 = _mm256_add_epi64(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i)));
      acc1 = _mm256_add_epi64(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i + 32)));
    }
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    int64_t acc = 0;
    for (int64_t i = lo; i < hi; ++i) {
      int64_t v;
      std::memcpy(&v, p + 64 * i, 8);
      acc += v;
    }
    total += acc;
#endif
  });
  return total.load();
}

// `iters` rounds of the K types' integer step on values in registers (per round and thread: 8
// products of 64 int8 pairs with 8 different weight vectors, as maddubs then dpwssd on AVX-512
// VNNI, 8 of 32 pairs as maddubs, madd and add on AVX2), on every torch thread: returns the
// multiply-adds done, for the compute roof in GOPS.
int64_t int_peak(int64_t iters) {
  const int threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t th = lo; th < hi; ++th) {
      int64_t v = 0;
#if defined(TREESPEC_AVX512)
      __m512i acc[8], w[8];
      const __m512i s = _mm512_set1_epi16(3), step = _mm512_set1_epi8(1);
      __m512i x = _mm512_set1_epi8(int8_t(5 + th));
      for (int k = 0; k < 8; ++k) {
        acc[k] = _mm512_setzero_si512();
        w[k] = _mm512_set1_epi8(int8_t(3 + k));
      }
      for (int64_t i = 0; i < iters; ++i) {
        for (int k = 0; k < 8; ++k) acc[k] = _mm512_dpwssd_epi32(acc[k], _mm512_maddubs_epi16(w[k], x), s);
        x = _mm512_add_epi8(x, step);
      }
      for (int k = 0; k < 8; ++k) v += _mm512_reduce_add_epi32(acc[k]);
#elif defined(__AVX2__)
      __m256i acc[8], w[8];
      const __m256i ones = _mm256_set1_epi16(1), step = _mm256_set1_epi8(1);
      __m256i x = _mm256_set1_epi8(int8_t(5 + th));
      for (int k = 0; k < 8; ++k) {
        acc[k] = _mm256_setzero_si256();
        w[k] = _mm256_set1_epi8(int8_t(3 + k));
      }
      for (int64_t i = 0; i < iters; ++i) {
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(w[k], x), ones));
        x = _mm256_add_epi8(x, step);
      }
      for (int k = 0; k < 8; ++k) v += hsum8(acc[k]);
#endif
      sink += v;
    }
  });
  (void)sink.load();
#if defined(TREESPEC_AVX512)
  return threads * iters * 8 * 64;
#elif defined(__AVX2__)
  return threads * iters * 8 * 32;
#else
  return 0;
#endif
}

// The SIMD paths this build runs (the K types' integer sums, the rest): for the benchmarks' tables.
std::string simd() {
#if defined(TREESPEC_AMX)
  if (amx_permitted() && g_amx_min_rows > 0)
    return "amx-int8 (K types, " + std::to_string(g_amx_min_rows) + "+ rows), avx512-vnni (K types), avx2";
#endif
#if defined(TREESPEC_AVX512)
  return "avx512-vnni (K types), avx2";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("simd", &simd, "the SIMD paths this build runs");
  m.def("set_amx_min_rows", [](int64_t n) { g_amx_min_rows = n; }, "rows from which the K types use AMX (0: never)");
  m.def("amx_min_rows", []() { return g_amx_min_rows; }, "rows from which the K types use AMX (0: never)");
  m.def("set_lanes_min_rows", [](int64_t n) { g_lanes_min_rows = n; }, "rows from which the K types put the rows in the lanes (0: never)");
  m.def("lanes_min_rows", []() { return g_lanes_min_rows; }, "rows from which the K types put the rows in the lanes (0: never)");
  m.def("quantize_rows", &quantize_rows, "per-row int8 activations per 32 or 256 values (xq, dx, sx)");
  m.def("quant_matmul", &quant_matmul, "x @ W.T with W in GGUF blocks, batch-invariant");
  m.def("quant_matmul_parts", &quant_matmul_parts, "x @ [W1; W2; ...].T, x quantized once");
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGUF-block matrix as float32");
  m.def("set_counting", [](bool on) {
    g_counting = on;
    g_work.unpacks = g_work.dots = g_work.reductions = g_work.calls = 0;
  }, "count the K types' work from now on (and zero the counters), or stop counting");
  m.def("work", []() {
    return std::vector<int64_t>{g_work.unpacks.load(), g_work.dots.load(), g_work.reductions.load(), g_work.calls.load()};
  }, "the counters: (super-blocks unpacked, 256-value dot products, reductions, calls)");
  m.def("stream_read", &stream_read, "read every byte of a buffer once (the read bandwidth probe)");
  m.def("int_peak", &int_peak, "rounds of the integer step in registers; returns the multiply-adds");
}
