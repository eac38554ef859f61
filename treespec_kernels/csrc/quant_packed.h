// The K types on AVX-512 VNNI from weights repacked once, at load time: sixteen outputs in the
// sixteen int32 lanes of one zmm, the activation rows broadcast.
// Part of quant_matmul.cpp (one translation unit), included there after quant_lanes.h.
#ifndef TREESPEC_QUANT_PACKED_H
#define TREESPEC_QUANT_PACKED_H

namespace {

// Rows (lo..hi) the K types run on the packed weights where a matrix has them (`set_packed_rows`;
// lo 0: never).
int64_t g_packed_min_rows = 1;
int64_t g_packed_max_rows = int64_t(1) << 40;

#if defined(TREESPEC_AVX512)
// ---------------------------------------------------------------------------------------------------
// The layout (`pack_k`): the outputs in groups of PK_OUT = 16, each group one contiguous run of
// nsb packed super-blocks, so that a thread walks one stream of memory per group. In a packed
// super-block, a 64-byte chunk holds four consecutive values of each of the 16 outputs (byte 4 o +
// i: output o, value i), two such steps a chunk as the low and high nibbles. Unit u covers the
// values 32 u .. 32 u + 31; its chunk j (0..3) holds the values 32 u + 4 j + i (low nibble) and
// 32 u + 16 + 4 j + i (high). So one load and one or two ops give a whole dpbusd operand of 16
// outputs, and every dpbusd does 64 useful multiply-adds whatever the row count: a row costs its
// dpbusd and a broadcast of its four bytes, the weights' unpacking is paid once for every row.
//
//   Q4_K (2368 bytes): [0, 2048) the nibble chunks (integers 0..15); [2048, 2176) the scales
//        [u][o] (u8); [2176, 2304) the mins as pairs [q][o][2] (u8; q = u / 2); [2304, 2336) d [o]
//        (half); [2336, 2368) dmin [o] (half).
//   Q6_K (3392 bytes): [0, 2048) the low four bits of q (0..63) as above; [2048, 3072) their high two
//        bits, two chunks per unit: chunk h holds the steps 4 h + m (m = 0..3) at bits 2 m;
//        [3072, 3328) the scales [s][o] (i8, s = 0..15, sixteen values each); [3328, 3360) d [o]
//        (half); 32 bytes of padding, so that every packed super-block starts on a cache line.
//
// The integers are the plain path's: Q4_K A = sum_u sc_u C_u, M = sum_u mn_u X_u; Q6_K A =
// sum_s sc_s (C_s - 32 X_s), the offset folded into each sub-block's sum before its scale (exact in
// int32: |C_s - 32 X_s| <= 16 * 95 * 127). The float chain is k_step's in every lane, so are the
// bits, for any row count and any thread count.
constexpr int PK_OUT = 16;

constexpr int64_t packed_block_bytes(int64_t t) { return t == Q4_K ? 2368 : 3392; }

// w [out, row bytes] of type t -> [out / 16, nsb * packed_block_bytes] uint8 (the outputs past a
// multiple of 16 are not packed: they run on the GGUF's blocks).
torch::Tensor pack_k_impl(const torch::Tensor& w, int64_t t, int64_t in) {
  const int64_t out = w.size(0), nsb = in / 256, groups = out / PK_OUT, pb = packed_block_bytes(t);
  auto packed = torch::zeros({groups, nsb * pb}, torch::kUInt8);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), bb = block_bytes(t);
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int8_t> q(PK_OUT * in);
    for (int64_t g = lo; g < hi; ++g) {
      for (int o = 0; o < PK_OUT; ++o) decode_row(t, wp + (g * PK_OUT + o) * row_bytes, in, q.data() + o * in);
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* b = pp + g * nsb * pb + sb * pb;
        for (int o = 0; o < PK_OUT; ++o) {
          const int8_t* v = q.data() + o * in + sb * 256;
          const uint8_t* blk = wp + (g * PK_OUT + o) * row_bytes + sb * bb;
          auto val = [&](int i) { return t == Q4_K ? int(v[i]) : int(v[i]) + 32; };  // 0..15, 0..63
          for (int u = 0; u < 8; ++u)
            for (int j = 0; j < 4; ++j)
              for (int i = 0; i < 4; ++i) {
                const int a = val(32 * u + 4 * j + i), c = val(32 * u + 16 + 4 * j + i);
                b[(4 * u + j) * 64 + 4 * o + i] = uint8_t((a & 0x0F) | ((c & 0x0F) << 4));
              }
          if (t == Q4_K) {
            int32_t sc[8], mn[8];
            q4k_scales(blk + 4, sc, mn);
            for (int u = 0; u < 8; ++u) {
              b[2048 + 16 * u + o] = uint8_t(sc[u]);
              b[2176 + 32 * (u / 2) + 2 * o + u % 2] = uint8_t(mn[u]);
            }
            std::memcpy(b + 2304 + 2 * o, blk, 2);
            std::memcpy(b + 2336 + 2 * o, blk + 2, 2);
          } else {
            for (int u = 0; u < 8; ++u)
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                  int bits = 0;
                  for (int m = 0; m < 4; ++m) bits |= (val(32 * u + 16 * h + 4 * m + i) >> 4) << (2 * m);
                  b[2048 + (2 * u + h) * 64 + 4 * o + i] = uint8_t(bits);
                }
            for (int s = 0; s < 16; ++s) b[3072 + 16 * s + o] = blk[192 + s];
            std::memcpy(b + 3328 + 2 * o, blk + 208, 2);
          }
        }
      }
    }
  });
  return packed;
}

// The activation rows of one call as the packed path reads them: per row, the int8 values (read as
// broadcast dwords), the scale per super-block, and Q4_K: the sums per 32 values as int16 pairs
// [in / 64]; Q6_K: -32 x the sums per 16 values [in / 16].
struct PackedActs {
  const int8_t* xq;
  const float* dx;
  std::vector<int32_t> xs;
  int64_t in = 0, per_row = 0;
};

PackedActs packed_acts(int64_t t, const KActs& a, int64_t rows) {
  PackedActs p{a.xq, a.dx, {}, a.in, t == Q4_K ? a.in / 64 : a.in / 16};
  p.xs.resize(rows * p.per_row);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < p.per_row; ++i) {
      if (t == Q4_K) {
        const int16_t* s = a.s32 + r * (a.in / 32) + 2 * i;
        p.xs[r * p.per_row + i] = int32_t(uint32_t(uint16_t(s[0])) | (uint32_t(uint16_t(s[1])) << 16));
      } else {
        p.xs[r * p.per_row + i] = -32 * int32_t(a.s16[r * (a.in / 16) + i]);
      }
    }
  return p;
}

// acc + dpbusd(w, the four bytes at p in every lane), with the bytes as the instruction's embedded
// broadcast operand: GCC does not fold a broadcast into vpdpbusd by itself, and a separate
// vpbroadcastd per dpbusd costs a vector op each
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One group of 16 outputs (its packed super-blocks at pg) against activation rows r0 .. r0 + R - 1:
// y[r][j0 .. j0 + 15].
#ifndef TREESPEC_PACKED_AHEAD
#define TREESPEC_PACKED_AHEAD 4
#endif

// A sub-block's integer sum kept in NA partial sums a row, so that with few rows the dpbusd are
// several independent chains instead of one waiting on each dpbusd's latency. Integer sums, so any
// split gives the same bits.
template <int NA>
inline __m512i sum_parts(const __m512i (&p)[NA]) {
  __m512i s = p[0];
  for (int a = 1; a < NA; ++a) s = _mm512_add_epi32(s, p[a]);
  return s;
}

// `real` <= R: the rows r0 .. r0 + real - 1 are computed, the kernel's other R - real rows repeat the
// last of them and are not stored (`packed_group_rows` runs one and two rows so).
template <int64_t T, int R>
void packed_group(const uint8_t* pg, int64_t nsb, const PackedActs& x, int64_t r0, float* y, int64_t ld, int64_t j0,
                  const uint8_t* end, int real = R) {
  constexpr int64_t PB = packed_block_bytes(T);
  constexpr int NA = R <= 3 ? 2 : 1;  // partial sums a row (`sum_parts`); one row runs as two or more
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const int64_t in = x.in;
  int64_t row[R];
  for (int r = 0; r < R; ++r) row[r] = r0 + std::min(r, real - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = pg + sb * PB;
    // the super-block AHEAD ahead (in the next group past this one's last: a thread's groups are
    // one stream) into L2, a few lines at each unit
    const char* ahead = reinterpret_cast<const char*>(b + TREESPEC_PACKED_AHEAD * PB);
    const bool fetch = b + (TREESPEC_PACKED_AHEAD + 1) * PB <= end;
    __m512i A[R];
    for (int r = 0; r < R; ++r) A[r] = _mm512_setzero_si512();
    // each row's values of this super-block: the unrolled loops below address them at constant
    // offsets from one pointer a row
    const int8_t* xs[R];
    for (int r = 0; r < R; ++r) xs[r] = x.xq + row[r] * in + sb * 256;
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      if (fetch)
        for (int64_t l = u * (PB / 64) / 8; l < (u + 1) * (PB / 64) / 8; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
      if constexpr (T == Q4_K) {
        __m512i cs[R][NA];
        for (int r = 0; r < R; ++r)
          for (int a = 0; a < NA; ++a) cs[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i n = _mm512_load_si512(b + (4 * u + j) * 64);
          const __m512i lo = _mm512_and_si512(n, m4), hi = _mm512_and_si512(_mm512_srli_epi16(n, 4), m4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            cs[r][2 * j % NA] = dpbusd_bcast(cs[r][2 * j % NA], lo, xs[r] + 32 * u + 4 * j);
            cs[r][(2 * j + 1) % NA] = dpbusd_bcast(cs[r][(2 * j + 1) % NA], hi, xs[r] + 32 * u + 16 + 4 * j);
          }
        }
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(b + 2048 + 16 * u)));
        for (int r = 0; r < R; ++r) A[r] = _mm512_add_epi32(A[r], _mm512_mullo_epi32(sum_parts<NA>(cs[r]), sc));
      } else {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // sub-block 2 u + h: the low nibbles (h = 0) or the high
          const int s = 2 * u + h;
          const __m512i hb = _mm512_load_si512(b + 2048 + (2 * u + h) * 64);
          __m512i cs[R][NA];
          for (int r = 0; r < R; ++r) {
            cs[r][0] = _mm512_set1_epi32(x.xs[row[r] * x.per_row + sb * 16 + s]);
            for (int a = 1; a < NA; ++a) cs[r][a] = _mm512_setzero_si512();
          }
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i n = _mm512_load_si512(b + (4 * u + j) * 64);
            const __m512i lo = h == 0 ? _mm512_and_si512(n, m4) : _mm512_and_si512(_mm512_srli_epi16(n, 4), m4);
            // the two high bits of step 4 h + j, at bits 2 j of hb, to bits 4..5
            const __m512i up = j == 0 ? _mm512_slli_epi16(hb, 4)
                               : j == 1 ? _mm512_slli_epi16(hb, 2)
                               : j == 2 ? hb
                                        : _mm512_srli_epi16(hb, 2);
            const __m512i wv = _mm512_ternarylogic_epi32(lo, up, m30, 0xF8);  // lo | (up & 0x30)
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) cs[r][j % NA] = dpbusd_bcast(cs[r][j % NA], wv, xs[r] + 32 * u + 16 * h + 4 * j);
          }
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(b + 3072 + 16 * s)));
          for (int r = 0; r < R; ++r) A[r] = _mm512_add_epi32(A[r], _mm512_mullo_epi32(sum_parts<NA>(cs[r]), sc));
        }
      }
    }
    if constexpr (T == Q4_K) {
      const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b + 2304)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b + 2336)));
      __m512i mn[4];
      for (int q = 0; q < 4; ++q)
        mn[q] = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(b + 2176 + 32 * q)));
      for (int r = 0; r < R; ++r) {
        const int32_t* xs = x.xs.data() + row[r] * x.per_row + sb * 4;
        __m512i X = _mm512_setzero_si512();
        for (int q = 0; q < 4; ++q) X = _mm512_dpwssd_epi32(X, mn[q], _mm512_set1_epi32(xs[q]));
        const __m512 dx = _mm512_set1_ps(x.dx[row[r] * (in / 256) + sb]);
        const __m512 da = _mm512_mul_ps(d, _mm512_cvtepi32_ps(A[r]));
        const __m512 mc = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(X));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dx, _mm512_sub_ps(da, mc)));
      }
    } else {
      const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b + 3328)));
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(x.dx[row[r] * (in / 256) + sb]);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(A[r])));
      }
    }
  }
  for (int r = 0; r < real; ++r) _mm512_storeu_ps(y + (r0 + r) * ld + j0, acc[r]);
}

#ifndef TREESPEC_PACKED_MIN_R
#define TREESPEC_PACKED_MIN_R 3
#endif
constexpr int PACKED_MIN_R = TREESPEC_PACKED_MIN_R;
static_assert(PACKED_MIN_R >= 2 && PACKED_MIN_R <= 8, "one and two rows run as 2..8");

template <int64_t T>
void packed_group_rows(const uint8_t* pg, int64_t nsb, const PackedActs& x, int64_t r0, int64_t n, float* y,
                       int64_t ld, int64_t j0, const uint8_t* end) {
  switch (n) {
    // one and two rows run as three (the repeated rows' products are not stored): a Zen 4 core
    // streamed the 1.5B's head 25% faster so, the extra work hiding under the memory reads
    case 1: packed_group<T, PACKED_MIN_R>(pg, nsb, x, r0, y, ld, j0, end, 1); break;
    case 2: packed_group<T, PACKED_MIN_R>(pg, nsb, x, r0, y, ld, j0, end, 2); break;
    case 3: packed_group<T, 3>(pg, nsb, x, r0, y, ld, j0, end); break;
    case 4: packed_group<T, 4>(pg, nsb, x, r0, y, ld, j0, end); break;
    case 5: packed_group<T, 5>(pg, nsb, x, r0, y, ld, j0, end); break;
    case 6: packed_group<T, 6>(pg, nsb, x, r0, y, ld, j0, end); break;
    case 7: packed_group<T, 7>(pg, nsb, x, r0, y, ld, j0, end); break;
    default: packed_group<T, 8>(pg, nsb, x, r0, y, ld, j0, end); break;
  }
}

// The outputs 0 .. 16 * groups - 1 of a matrix with packed weights, against every row: per group,
// the rows in chunks of up to eight (a group's weights, read from memory once, stay in L2 for the
// next chunk).
void packed_run(int64_t t, const uint8_t* packed, const KActs& a, int64_t rows, int64_t groups, int64_t grain,
                float* yp, int64_t ld) {
  const PackedActs x = packed_acts(t, a, rows);
  const int64_t nsb = a.in / 256, stride = nsb * packed_block_bytes(t);
  const auto run = t == Q4_K ? packed_group_rows<Q4_K> : packed_group_rows<Q6_K>;
  at::parallel_for(0, groups, std::max<int64_t>(1, grain / PK_OUT), [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      // the last chunk of rows prefetches on into the thread's next groups; the others stop at
      // this group's end (the chunks after them find it in L2)
      for (int64_t r = 0; r < rows; r += 8) {
        const int64_t n = std::min<int64_t>(8, rows - r);
        const uint8_t* end = packed + (r + 8 >= rows ? hi : g + 1) * stride;
        count_work(nsb * PK_OUT, nsb * PK_OUT * n, 0);
        run(packed + g * stride, nsb, x, r, n, yp, ld, g * PK_OUT, end);
      }
    }
  });
}
#endif

}  // namespace

#endif  // TREESPEC_QUANT_PACKED_H
