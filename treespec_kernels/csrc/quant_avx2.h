// The scalar and AVX2 paths: Q8_0, Q5_0 and Q4_1 (blocks of 32), the K types by groups of four rows.
// Part of quant_matmul.cpp (one translation unit), included there after the system headers.
#ifndef TREESPEC_QUANT_AVX2_H
#define TREESPEC_QUANT_AVX2_H

namespace {

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

}  // namespace

#endif  // TREESPEC_QUANT_AVX2_H
