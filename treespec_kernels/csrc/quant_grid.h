// The K types on AVX-512 VNNI for a few rows: a grid of O weight rows x R = 16 / O activation
// rows in the sixteen int32 lanes of one zmm.
// Part of quant_matmul.cpp (one translation unit), included there after quant_tiles.h.
#ifndef TREESPEC_QUANT_GRID_H
#define TREESPEC_QUANT_GRID_H

namespace {

#if defined(TREESPEC_AVX512)
// ---------------------------------------------------------------------------------------------------
// Lane l of the grid holds output o = l % O against activation row r = l / O. One dpbusd takes four
// consecutive values of every pair: the weights' four bytes of output o (unsigned: Q4_K 0..15,
// Q6_K q in 0..63) broadcast from a block of O outputs unpacked side by side (a 16-byte broadcast
// for O = 4, an 8-byte one for O = 2: a load, no shuffle), the activations' four bytes of row r
// laid out once per call for the grid (a plain load). So every dpbusd does 64 useful
// multiply-adds, the sub-block scales are applied once per sub-block to sixteen pairs at a time
// (one mullo), and no lane is ever reduced across: the tiles' per-row packs, madd and horizontal
// sums are gone, which is what bounds them at a few rows (their int8 work per row is the same).
//
// Where it runs (set_grid_rows; quant_blocks.h has the default, 7..8 rows): one thread, AMD EPYC
// Zen 4, the 1.5B read from memory (bench.roofline --grid): the whole forward at 8 rows in 156 ms
// against the lanes' 176, but 5 and 6 rows in 153 against the tiles' 131 and 146, and 2 and 4 rows
// in 120 and 122 against 72 and 105. At a few rows it is bound by laying the weights out (the
// transposes across outputs, the scales), not by its int8 work (one dpbusd per 64 useful
// multiply-adds; dpbusd on zmm runs one a cycle here, 466 GOPS at 3.65 GHz): weights repacked for
// it once at load time, as llama.cpp repacks Q4_K for its AVX-512 kernels, are what would flatten
// the few-row cost.
//
// Per pair and super-block the integers are the plain path's:
//   Q4_K  A = sum_s sc_s C_s (8 sub-blocks of 32),  M = sum_s mn_s X_s (dpwssd of int16 pairs)
//   Q6_K  A = sum_i sc_i C_i - 32 sum_i sc_i X_i (16 sub-blocks of 16, q - 32 as the offset)
// with C a sub-block's sum of q x and X the row's sum of x over it; every partial sum is exact in
// int32 (|C| <= 32 * 63 * 127). The float chain is k_step's in every lane, so are the bits.

// The activation rows r .. r + n - 1 (n <= R) of one call, laid out for a grid of O outputs.
// outputs per pass: each activation load serves GRID_OUTPUTS / O dpbusd
constexpr int GRID_OUTPUTS = 16;

template <int O>
struct GridRows {
  std::vector<int32_t> xr;  // [in / 4][16]: lane l = values 4 k .. 4 k + 3 of row l / O
  std::vector<int32_t> xs;  // [pairs][16]: lane l = two sums of row l / O as int16 (Q4_K: of 32
                            // values, Q6_K: of 16)
  std::vector<float> dx;    // [in / 256][16]
  int64_t r = 0, n = 0;
};

template <int O>
GridRows<O> grid_rows(int64_t t, const KActs& a, int64_t r, int64_t n) {
  GridRows<O> g;
  g.r = r;
  g.n = n;
  const int64_t in = a.in, steps = in / 4, nsb = in / 256;
  const int64_t pairs = t == Q4_K ? in / 64 : in / 32;
  g.xr.assign(steps * 16, 0);
  g.xs.assign(pairs * 16, 0);
  g.dx.assign(nsb * 16, 0.0f);
  for (int64_t m = 0; m < n; ++m) {
    const int8_t* x = a.xq + (r + m) * in;
    for (int64_t k = 0; k < steps; ++k) {
      int32_t v;
      std::memcpy(&v, x + 4 * k, 4);
      for (int o = 0; o < O; ++o) g.xr[k * 16 + m * O + o] = v;
    }
    const int16_t* s = t == Q4_K ? a.s32 + (r + m) * (in / 32) : a.s16 + (r + m) * (in / 16);
    for (int64_t p = 0; p < pairs; ++p) {
      const int32_t v = int32_t(uint32_t(uint16_t(s[2 * p])) | (uint32_t(uint16_t(s[2 * p + 1])) << 16));
      for (int o = 0; o < O; ++o) g.xs[p * 16 + m * O + o] = v;
    }
    for (int64_t sb = 0; sb < nsb; ++sb)
      for (int o = 0; o < O; ++o) g.dx[sb * 16 + m * O + o] = a.dx[(r + m) * nsb + sb];
  }
  return g;
}

// One super-block of O consecutive outputs unpacked side by side. w: the four pieces of 64 values
// (16 steps of 4) of every output, interleaved by unpacklo/hi within 128-bit lanes (see
// grid_step); sc: the sub-block scales [s][o]; sp: int16 pairs [p][o] (Q4_K: the mins, Q6_K: the
// scales, for the X terms); d, dmin: the block's float scales.
template <int O>
struct GridBlock {
  alignas(64) int32_t w[64 * O];
  alignas(64) int32_t sc[16 * O];
  alignas(64) int32_t sp[8 * O];
  alignas(64) float d[O];
  alignas(64) float dmin[O];
};

// Where step k's O dwords (one per output) start in GridBlock::w: piece e = k / 16, 128-bit lane
// j = (k % 16) / 4, position m = k % 4 inside it.
template <int O>
constexpr int grid_step(int k) {
  const int e = k / 16, j = (k % 16) / 4, m = k % 4;
  return O == 4 ? (e * 4 + m) * 16 + j * 4 : (e * 2 + m / 2) * 16 + j * 4 + (m % 2) * 2;
}

template <int O>
inline __m512i grid_bcast(const int32_t* p) {
  if constexpr (O == 4) {
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm512_set1_epi64(v);
  }
}

template <int O>
inline __m512 grid_bcast_ps(const float* p) {
  if constexpr (O == 4) {
    return _mm512_broadcast_f32x4(_mm_load_ps(p));
  } else {
    double v;
    std::memcpy(&v, p, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(v));
  }
}

// Byte permutes that put O outputs' scales side by side, [O / 4]: O = 2, O = 4. Source bytes:
// Q4_K: output o's 8 scales at 8 o + s and 8 mins at 32 + 8 o + s; Q6_K: its 16 scales at 16 o + i.
// Targets: the scales [s][o] (then widened to int32) and the int16 pairs [q][o][h] (q = s / 2).
inline __m512i grid_perm(int o_count, bool q6k, bool pairs) {
  alignas(64) uint8_t idx[64] = {};
  const int n = q6k ? 16 : 8;
  for (int s = 0; s < n; ++s)
    for (int o = 0; o < o_count; ++o) {
      const int src = q6k ? 16 * o + s : (pairs ? 32 : 0) + 8 * o + s;
      const int dst = pairs ? ((s / 2) * o_count + o) * 2 + s % 2 : s * o_count + o;
      idx[dst] = uint8_t(src);
    }
  return _mm512_load_si512(idx);
}
const __m512i grid_perm_q4k_sc[2] = {grid_perm(2, false, false), grid_perm(4, false, false)};
const __m512i grid_perm_q4k_mn[2] = {grid_perm(2, false, true), grid_perm(4, false, true)};
const __m512i grid_perm_q6k_sc[2] = {grid_perm(2, true, false), grid_perm(4, true, false)};
const __m512i grid_perm_q6k_sp[2] = {grid_perm(2, true, true), grid_perm(4, true, true)};

template <int64_t T, int O>
inline void grid_unpack(const uint8_t* const* blks, GridBlock<O>& g) {
  KBlock p[O];
#pragma GCC unroll 4
  for (int o = 0; o < O; ++o) k_unpack<T, false, false>(blks[o], p[o]);
#pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {
    if constexpr (O == 4) {
      // lane j of t_m: [o0, o1, o2, o3] at step 16 e + 4 j + m
      const __m512i ab_lo = _mm512_unpacklo_epi32(p[0].w[e], p[1].w[e]), ab_hi = _mm512_unpackhi_epi32(p[0].w[e], p[1].w[e]);
      const __m512i cd_lo = _mm512_unpacklo_epi32(p[2].w[e], p[3].w[e]), cd_hi = _mm512_unpackhi_epi32(p[2].w[e], p[3].w[e]);
      _mm512_store_si512(g.w + (e * 4 + 0) * 16, _mm512_unpacklo_epi64(ab_lo, cd_lo));
      _mm512_store_si512(g.w + (e * 4 + 1) * 16, _mm512_unpackhi_epi64(ab_lo, cd_lo));
      _mm512_store_si512(g.w + (e * 4 + 2) * 16, _mm512_unpacklo_epi64(ab_hi, cd_hi));
      _mm512_store_si512(g.w + (e * 4 + 3) * 16, _mm512_unpackhi_epi64(ab_hi, cd_hi));
    } else {
      // lane j of the low half: [o0, o1] at steps 16 e + 4 j and + 1; of the high: + 2 and + 3
      _mm512_store_si512(g.w + (e * 2 + 0) * 16, _mm512_unpacklo_epi32(p[0].w[e], p[1].w[e]));
      _mm512_store_si512(g.w + (e * 2 + 1) * 16, _mm512_unpackhi_epi32(p[0].w[e], p[1].w[e]));
    }
  }
  // the scales side by side, by one byte permute of every output's scale bytes (see grid_perm)
  if constexpr (T == Q4_K) {
    uint64_t sc[4] = {}, mn[4] = {};
    for (int o = 0; o < O; ++o) {
      q4k_scales_packed(blks[o] + 4, &sc[o], &mn[o]);
      g.d[o] = half_to_float(blks[o]);
      g.dmin[o] = half_to_float(blks[o] + 2);
    }
    // in registers (a load of what was just stored a word at a time would wait for the stores)
    const __m512i Z = _mm512_set_epi64(int64_t(mn[3]), int64_t(mn[2]), int64_t(mn[1]), int64_t(mn[0]), int64_t(sc[3]),
                                       int64_t(sc[2]), int64_t(sc[1]), int64_t(sc[0]));
    const __m512i P = _mm512_permutexvar_epi8(grid_perm_q4k_sc[O / 4], Z);
    for (int c = 0; c < 8 * O / 16; ++c)
      _mm512_store_si512(g.sc + 16 * c, _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(P, c)));
    const __m512i M = _mm512_permutexvar_epi8(grid_perm_q4k_mn[O / 4], Z);
    _mm512_store_si512(g.sp, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(M)));
  } else {
    __m512i Z = _mm512_setzero_si512();
    for (int o = 0; o < O; ++o) {
      Z = _mm512_mask_broadcast_i32x4(Z, __mmask16(0xF << (4 * o)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(blks[o] + 192)));
      g.d[o] = half_to_float(blks[o] + 208);
      g.dmin[o] = 0.0f;
    }
    const __m512i P = _mm512_permutexvar_epi8(grid_perm_q6k_sc[O / 4], Z);
    for (int c = 0; c < O; ++c)
      _mm512_store_si512(g.sc + 16 * c, _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(P, c)));
    const __m512i Q = _mm512_permutexvar_epi8(grid_perm_q6k_sp[O / 4], Z);
    for (int c = 0; c < O / 2; ++c)
      _mm512_store_si512(g.sp + 16 * c, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(Q, c)));
  }
}

// Outputs j0 .. j0 + 8 * ... : groups of U * O = 8 outputs [lo, hi) against every chunk of rows.
// Per super-block the U groups are unpacked once and serve every chunk; each activation load
// serves the U groups.
template <int64_t T, int O>
void grid_outputs(const uint8_t* wp, int64_t row_bytes, const std::vector<GridRows<O>>& chunks, int64_t in,
                  float* yp, int64_t ld, int64_t lo, int64_t hi) {
  constexpr int U = GRID_OUTPUTS / O;
  constexpr int SUB = T == Q4_K ? 32 : 16, NS = 256 / SUB, SPS = SUB / 4, NP = T == Q4_K ? 4 : 8;
  const int64_t nsb = in / 256, bb = block_bytes(T), nc = int64_t(chunks.size());
  // two sets of U blocks: super-block sb + 1 is unpacked before sb is multiplied, so that the
  // broadcasts never wait for the stores that just wrote their bytes
  GridBlock<O> bufs[2][U];
  std::vector<float> accm(nc * U * 16);
  // the pass after next, in address order, into L2, a few lines at each sub-block of the first
  // chunk: a pass walks GRID_OUTPUTS rows at once, too many short streams for the hardware's
  // prefetcher, and issued in one burst the requests were dropped (measured: 1.5 ms -> 0.93-1.04 ms for
  // 4 rows of ffn_gate read from memory; into L1 the passes crowd out the activations)
  const int64_t pass = GRID_OUTPUTS * row_bytes, share = GRID_OUTPUTS * bb;
  auto unpack = [&](int64_t j0, int64_t sb, GridBlock<O>* into) {
    for (int u = 0; u < U; ++u) {
      const uint8_t* blks[O];
      for (int o = 0; o < O; ++o) blks[o] = wp + (j0 + u * O + o) * row_bytes + sb * bb;
      grid_unpack<T, O>(blks, into[u]);
    }
    count_work(GRID_OUTPUTS, 0, 0);
  };
  for (int64_t j0 = lo; j0 < hi; j0 += GRID_OUTPUTS) {
    std::fill(accm.begin(), accm.end(), 0.0f);
    unpack(j0, 0, bufs[0]);
    for (int64_t sb = 0; sb < nsb; ++sb) {
      if (sb + 1 < nsb) unpack(j0, sb + 1, bufs[(sb + 1) & 1]);
      const GridBlock<O>* blocks = bufs[sb & 1];
      // this super-block's share of the next pass, a few lines at each sub-block of the first chunk
      const char* ahead = reinterpret_cast<const char*>(wp + (j0 + 2 * GRID_OUTPUTS) * row_bytes + sb * share);
      const int64_t lines = j0 + 3 * GRID_OUTPUTS <= hi ? share / 64 : 0, per = (share / 64 + NS - 1) / NS;
      for (int64_t c = 0; c < nc; ++c) {
        const GridRows<O>& g = chunks[c];
        count_work(0, GRID_OUTPUTS * g.n, GRID_OUTPUTS);
        const int32_t* xr = g.xr.data() + sb * 64 * 16;
        __m512i A[U];
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) A[u] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int s = 0; s < NS; ++s) {
          __m512i cs[U];
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) cs[u] = _mm512_setzero_si512();
          if (c == 0)
            for (int64_t i = s * per; i < std::min<int64_t>(lines, (s + 1) * per); ++i)
              _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
#pragma GCC unroll 8
          for (int kk = 0; kk < SPS; ++kk) {
            const int k = s * SPS + kk;
            const __m512i x = _mm512_loadu_si512(xr + k * 16);
#pragma GCC unroll 8
            for (int u = 0; u < U; ++u) cs[u] = _mm512_dpbusd_epi32(cs[u], grid_bcast<O>(blocks[u].w + grid_step<O>(k)), x);
          }
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u)
            A[u] = _mm512_add_epi32(A[u], _mm512_mullo_epi32(cs[u], grid_bcast<O>(blocks[u].sc + s * O)));
        }
        const int32_t* xs = g.xs.data() + sb * NP * 16;
        const __m512 dx = _mm512_loadu_ps(g.dx.data() + sb * 16);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          __m512i X = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int q = 0; q < NP; ++q)
            X = _mm512_dpwssd_epi32(X, _mm512_loadu_si512(xs + q * 16), grid_bcast<O>(blocks[u].sp + q * O));
          float* acc = accm.data() + (c * U + u) * 16;
          const __m512 d = grid_bcast_ps<O>(blocks[u].d);
          __m512 step;
          if constexpr (T == Q4_K) {
            const __m512 da = _mm512_mul_ps(d, _mm512_cvtepi32_ps(A[u]));
            const __m512 mc = _mm512_mul_ps(grid_bcast_ps<O>(blocks[u].dmin), _mm512_cvtepi32_ps(X));
            step = _mm512_mul_ps(dx, _mm512_sub_ps(da, mc));
          } else {
            const __m512i total = _mm512_sub_epi32(A[u], _mm512_slli_epi32(X, 5));
            step = _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(total));
          }
          _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), step));
        }
      }
    }
    for (int64_t c = 0; c < nc; ++c)
      for (int u = 0; u < U; ++u)
        for (int l = 0; l < 16; ++l) {
          const int64_t r = l / O;
          if (r < chunks[c].n) yp[(chunks[c].r + r) * ld + j0 + u * O + l % O] = accm[(c * U + u) * 16 + l];
        }
  }
}

// Outputs first .. first + 8 * groups - 1 against every row, on the grid: four rows a chunk (O = 4)
// up to four rows, eight a chunk (O = 2) beyond.
void grid_run(int64_t t, const uint8_t* wp, int64_t row_bytes, const KActs& a, int64_t rows, int64_t first,
              int64_t groups, int64_t grain, float* yp, int64_t ld) {
  auto go = [&](auto o_tag) {
    constexpr int O = decltype(o_tag)::value;
    constexpr int R = 16 / O;
    std::vector<GridRows<O>> chunks;
    for (int64_t r = 0; r < rows; r += R) chunks.push_back(grid_rows<O>(t, a, r, std::min<int64_t>(R, rows - r)));
    const auto run = t == Q4_K ? grid_outputs<Q4_K, O> : grid_outputs<Q6_K, O>;
    at::parallel_for(0, groups, std::max<int64_t>(1, grain / GRID_OUTPUTS), [&](int64_t lo, int64_t hi) {
      run(wp, row_bytes, chunks, a.in, yp, ld, first + GRID_OUTPUTS * lo, first + GRID_OUTPUTS * hi);
    });
  };
  if (rows <= 4)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 2>{});
}

#endif

}  // namespace

#endif  // TREESPEC_QUANT_GRID_H
