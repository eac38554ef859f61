// The K types on AMX tiles (Sapphire Rapids and later), for many rows.
// Part of quant_matmul.cpp (one translation unit), included there after the system headers.
#ifndef TREESPEC_QUANT_AMX_H
#define TREESPEC_QUANT_AMX_H

namespace {

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

}  // namespace

#endif  // TREESPEC_QUANT_AMX_H
