// The K types on AVX-512 VNNI: tiles of weight rows x activation rows (the few-row path).
// Part of quant_matmul.cpp (one translation unit), included there after the system headers.
#ifndef TREESPEC_QUANT_TILES_H
#define TREESPEC_QUANT_TILES_H

namespace {

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
  __m512i s[4];   // the maddubs pairs' scales (k_unpack<T, false>)
  __m512i s2[2];  // the packed dpbusd lanes' scales (k_unpack<T, true>; see k_dot1)
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

// The scales of pieces 2 h and 2 h + 1 as packs_epi32 lays out their dpbusd lanes: int16 lane
// 8 k + m of the pack is piece 2 h's int32 lane 4 k + m (m < 4: values 64 (2 h) + 16 k + 4 m ..
// + 3) or piece 2 h + 1's lane 4 k + m - 4 (m >= 4). Its sub-block: Q4_K (32 values) 2 e + k / 2,
// Q6_K (16 values) 4 e + k, e the piece.
inline __m512i pair_index(int h, bool wide) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) {
    const int k = i / 8, m = i % 8, e = 2 * h + (m >= 4 ? 1 : 0);
    idx[i] = int16_t(wide ? 2 * e + k / 2 : 4 * e + k);
  }
  return _mm512_load_si512(idx);
}
const __m512i k_wide_pairs[2] = {pair_index(0, true), pair_index(1, true)};
const __m512i k_narrow_pairs[2] = {pair_index(0, false), pair_index(1, false)};

// (Scales false: the weights' integers only, for the grid, which reads the scales itself)
template <int64_t T, bool Pairs = false, bool Scales = true>
inline void k_unpack(const uint8_t* blk, KBlock& p) {
  const __m512i* wide_idx = k_wide_idx;
  const __m512i* narrow_idx = k_narrow_idx;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == Q4_K) {
    uint64_t sc = 0, mn = 0;
    if constexpr (Scales) q4k_scales_packed(blk + 4, &sc, &mn);
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
    if constexpr (!Scales) {
      (void)sc16;
    } else if constexpr (Pairs) {
      for (int h = 0; h < 2; ++h) p.s2[h] = _mm512_permutexvar_epi16(k_wide_pairs[h], sc16);
    } else {
      for (int g = 0; g < 4; ++g) p.s[g] = _mm512_permutexvar_epi16(wide_idx[g], sc16);
    }
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
      if constexpr (Scales && !Pairs) p.s[e] = _mm512_permutexvar_epi16(narrow_idx[e], sc16);
    }
  }
  if constexpr (Scales && Pairs)
    for (int h = 0; h < 2; ++h) p.s2[h] = _mm512_permutexvar_epi16(k_narrow_pairs[h], sc16);
  }
}

// The int32 lanes of one activation row's integer sums against an unpacked super-block (x: the
// row's 256 values; s16: its 16 sums of 16, read for Q6_K; p unpacked with Pairs). Per piece one
// dpbusd: each int32 lane the sum of four products w x, |.| <= 4 * 63 * 128 < 2^15, so two pieces
// pack into int16 without saturating and one madd per pair of pieces takes the sub-block scales:
// six multiplies per row and block where maddubs then dpwssd per piece take eight. The sum of the
// lanes is the same integer.
template <int64_t T>
inline __m512i k_dot1(const KBlock& p, const int8_t* x, const int16_t* s16) {
  const __m512i z = _mm512_setzero_si512();
  __m512i t[4];
  for (int e = 0; e < 4; ++e) t[e] = _mm512_dpbusd_epi32(z, p.w[e], _mm512_loadu_si512(x + 64 * e));
  __m512i acc = _mm512_madd_epi16(_mm512_packs_epi32(t[0], t[1]), p.s2[0]);
  acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(t[2], t[3]), p.s2[1]);
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
      k_unpack<T, true>(blk, p);
      uint16_t d, dm = 0;
      std::memcpy(&d, T == Q4_K ? blk : blk + 208, 2);
      if constexpr (T == Q4_K) std::memcpy(&dm, blk + 2, 2);
#pragma GCC unroll 8
      for (int n = 0; n < N; ++n) {
        const int64_t row = r + n;
        const int i = o * P + n;
        const int16_t* s16 = T == Q6_K ? a.s16 + row * (in / 16) + 16 * sb : nullptr;  // Q6_K's only
        s[i] = k_dot1<T>(p, a.xq + row * in + 256 * sb, s16);
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

}  // namespace

#endif  // TREESPEC_QUANT_TILES_H
