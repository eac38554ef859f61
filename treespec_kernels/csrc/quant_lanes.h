// The K types on AVX-512 VNNI with the activation rows in the lanes (many rows), and the dispatch between the lanes and the tiles.
// Part of quant_matmul.cpp (one translation unit), included there after the system headers.
#ifndef TREESPEC_QUANT_LANES_H
#define TREESPEC_QUANT_LANES_H

namespace {

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

#if defined(TREESPEC_AVX512)
// Outputs first .. out - 1 of the K types on AVX-512: tiles of eight outputs, each a pass over
// their weight rows per eight activation rows; the outputs past the last multiple of eight one by
// one. Threads take whole tiles (eight consecutive weight rows, no cache line of y shared).
void k_outputs_avx512(int64_t t, const uint8_t* wp, int64_t row_bytes, const int8_t* xq, const float* dx,
                      const int32_t* sx, int64_t rows, int64_t in, int64_t first, int64_t out, int64_t grain,
                      float* yp, int64_t ld, const uint8_t* packed) {
  // the activation sums the type reads (Q4_K's mins: per 32; Q6_K's offset: per 16), once per call
  std::vector<int16_t> s32(t == Q4_K ? rows * (in / 32) : 0), s16(t == Q6_K ? rows * (in / 16) : 0);
  for (size_t i = 0; i < s32.size(); ++i) s32[i] = int16_t(sx[i]);
  for (size_t i = 0; i < s16.size(); ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += xq[16 * i + k];
    s16[i] = int16_t(sum);
  }
  const KActs acts{xq, dx, s32.data(), s16.data(), in};
  const int64_t tiles = (out - first) / 8;
  const auto tile1 = t == Q4_K ? k_tile1<Q4_K> : k_tile1<Q6_K>;
  if (packed != nullptr && first == 0 && g_packed_min_rows > 0 && rows >= g_packed_min_rows && rows <= g_packed_max_rows) {
    const int64_t groups = out / PK_OUT;
    packed_run(t, packed, acts, rows, groups, grain, yp, ld);
    for (int64_t j = PK_OUT * groups; j < out; ++j)
      for (int64_t r = 0; r < rows; r += 8) tile1(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), j, yp, ld);
    return;
  }
  if (g_grid_min_rows > 0 && rows >= g_grid_min_rows && rows <= g_grid_max_rows) {  // the grid
    const int64_t groups = (out - first) / GRID_OUTPUTS;
    grid_run(t, wp, row_bytes, acts, rows, first, groups, grain, yp, ld);
    for (int64_t j = first + GRID_OUTPUTS * groups; j < out; ++j)
      for (int64_t r = 0; r < rows; r += 8) tile1(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), j, yp, ld);
    return;
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
  const auto tiles8 = t == Q4_K ? k_tiles8<Q4_K> : k_tiles8<Q6_K>;
  at::parallel_for(0, tiles, std::max<int64_t>(1, grain / 8), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t r = 0; r < rows; r += 8)
        tiles8(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), first + 8 * b, yp, ld);
  });
  for (int64_t j = first + 8 * tiles; j < out; ++j)
    for (int64_t r = 0; r < rows; r += 8) tile1(wp, row_bytes, acts, r, std::min<int64_t>(8, rows - r), j, yp, ld);
}
#endif

}  // namespace

#endif  // TREESPEC_QUANT_LANES_H
