// The block types, their decoding, the integer dot helpers and the kernel's work counters.
// Part of quant_matmul.cpp (one translation unit), included there after the system headers.
#ifndef TREESPEC_QUANT_BLOCKS_H
#define TREESPEC_QUANT_BLOCKS_H

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
// 7: where the lanes caught up with the tiles of outputs in the 1.5B's whole forward on an AVX-512
// VNNI machine without AMX (bench.target_step, one thread: the tiles 166 / 190 ms at 6 / 7 rows,
// the lanes about 185 ms for any 1 to 8 rows, 282 ms at 16)
int64_t g_lanes_min_rows = 7;

// rows from which, and up to which, the K types run on the grid of weight rows x activation rows
// in one vector's lanes (AVX-512 VNNI; quant_grid.h); 0: never. It takes precedence over the lanes.
// 7..8: where it beat the tiles and the lanes in the 1.5B's whole forward on an AVX-512 VNNI
// machine without AMX (bench.roofline --grid, one thread: 8 rows 156 ms against the lanes' 176;
// 5 and 6 rows 153 against the tiles' 131 and 146; 12 and 16 rows the same as the lanes)
int64_t g_grid_min_rows = 7;
int64_t g_grid_max_rows = 8;

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

}  // namespace

#endif  // TREESPEC_QUANT_BLOCKS_H
