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
// Packed weights (quant_packed.h, `pack_k`): where the CPU has AVX-512 VNNI, a model repacks its
// K-type matrices once at load (sixteen outputs a vector, about the blocks' size) and every row
// count of `set_packed_rows` (by default all, AMX's row counts excepted) runs on them: a few rows
// cost about one, the weights' unpacking paid once for up to eight rows. The paths below run where
// a matrix has no packed copy.
//
// SIMD: the integer sums run on AVX2 (256-bit maddubs/madd; groups of four activation rows, the
// last one to three together), and for the K types on AVX-512 with VNNI where the CPU has it:
// below 7 rows (`set_lanes_min_rows`) tiles of weight rows x activation rows that fill the eight
// lanes of a float chain vector (one pass over the weights for up to eight rows; see "tiles of O
// weight rows x N activation rows"), at 7 and 8 rows (`set_grid_rows`) a grid of weight rows x
// activation rows in one vector's lanes (quant_grid.h), from 9 rows the activation rows in the lanes of a vector and
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


#include "quant_blocks.h"
#include "quant_avx2.h"
#include "quant_tiles.h"
#include "quant_amx.h"
#include "quant_grid.h"
#include "quant_packed.h"
#include "quant_lanes.h"

namespace {

// Rows from which the K types go to the AMX path where the CPU has it (0: never; set by
// `set_amx_min_rows` for the tests and the benchmark's A/B).
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

// w of type t repacked for the packed path (quant_packed.h): [out / 16, bytes] uint8, or an empty
// tensor where this build or the type has no packed path.
torch::Tensor pack_k(const torch::Tensor& w, int64_t t, int64_t in) {
  check_weight(w, t, in);
#if defined(TREESPEC_AVX512)
  if (k_type(t) && w.size(0) >= PK_OUT) return pack_k_impl(w, t, in);
#endif
  return torch::empty({0}, torch::kUInt8);
}

// The packed weights to run this call on, or nullptr (none given, or not for this row count).
const uint8_t* packed_for(const torch::Tensor& packed, const torch::Tensor& w, int64_t t, int64_t in, int64_t rows) {
  if (!packed.defined() || packed.numel() == 0) return nullptr;
#if defined(TREESPEC_AVX512)
  TORCH_CHECK(k_type(t) && packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == w.size(0) / PK_OUT && packed.size(1) == in / 256 * packed_block_bytes(t),
              "the packed weights must be pack_k's [", w.size(0) / PK_OUT, ", ", in / 256 * packed_block_bytes(t),
              "] uint8 for this matrix");
#if defined(TREESPEC_AMX)
  if (g_amx_min_rows > 0 && rows >= g_amx_min_rows && amx_permitted()) return nullptr;  // AMX's tiles take these
#endif
  if (g_packed_min_rows > 0 && rows >= g_packed_min_rows && rows <= g_packed_max_rows) return packed.data_ptr<uint8_t>();
  return nullptr;
#else
  (void)w, (void)t, (void)in, (void)rows;
  TORCH_CHECK(false, "this build has no packed path (pack_k gives an empty tensor here)");
  return nullptr;
#endif
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
// packed: pack_k's repacking of w, or an empty tensor
void matmul_part(const QuantRows& a, const torch::Tensor& w, int64_t t, float* yp, int64_t ld, const torch::Tensor& packed) {
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
  const uint8_t* pk = packed_for(packed, w, t, in, rows);
#if defined(TREESPEC_AMX)
  if (pk == nullptr && k_type(t) && g_amx_min_rows > 0 && rows >= g_amx_min_rows && out >= 16 && amx_permitted()) {
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
    k_outputs_avx512(t, wp, row_bytes, xq, dx, sx, rows, in, first, out, grain, yp, ld, pk);
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
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  check_weight(w, t, x.size(1));
  if (g_counting) ++g_work.calls;
  auto y = torch::empty({x.size(0), w.size(0)}, torch::kFloat32);
  matmul_part(quantize_for(x, k_type(t) ? 256 : QB), w, t, y.data_ptr<float>(), w.size(0), packed);
  return y;
}

// x [rows, in] against several matrices stacked along the outputs (a fused q|k|v or gate|up whose
// parts may be of different types) -> [rows, sum of their outputs]: x is quantized once per
// activation block size, and every part writes its own columns (each column as quant_matmul of
// that part alone computes it).
torch::Tensor quant_matmul_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                                 const std::vector<int64_t>& ts, const std::vector<torch::Tensor>& packs) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  TORCH_CHECK(!ws.empty() && ws.size() == ts.size(), "give one type per part (", ws.size(), " parts, ",
              ts.size(), " types)");
  TORCH_CHECK(packs.empty() || packs.size() == ws.size(), "give one packed tensor (or an empty one) per part (",
              ws.size(), " parts, ", packs.size(), " packed)");
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
    matmul_part(a, ws[i], ts[i], y.data_ptr<float>() + col, total, packs.empty() ? torch::Tensor() : packs[i]);
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
        for (int k = 0; k < 8; ++k) acc[k] = _mm512_dpbusd_epi32(acc[k], w[k], x);
        x = _mm512_add_epi8(x, step);
      }
      (void)s;
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
  m.def("set_grid_rows", [](int64_t lo, int64_t hi) {
    g_grid_min_rows = lo;
    g_grid_max_rows = hi;
  }, "the row counts (lo..hi) the K types run on the grid of weight rows x activation rows (lo 0: never)");
  m.def("grid_rows", []() { return std::vector<int64_t>{g_grid_min_rows, g_grid_max_rows}; },
        "the row counts (lo, hi) of the grid (lo 0: never)");
  m.def("lanes_min_rows", []() { return g_lanes_min_rows; }, "rows from which the K types put the rows in the lanes (0: never)");
  m.def("quantize_rows", &quantize_rows, "per-row int8 activations per 32 or 256 values (xq, dx, sx)");
  m.def("quant_matmul", &quant_matmul, "x @ W.T with W in GGUF blocks, batch-invariant", py::arg("x"), py::arg("w"),
        py::arg("t"), py::arg("packed") = torch::empty({0}, torch::kUInt8));
  m.def("quant_matmul_parts", &quant_matmul_parts, "x @ [W1; W2; ...].T, x quantized once", py::arg("x"), py::arg("ws"),
        py::arg("ts"), py::arg("packs") = std::vector<torch::Tensor>());
  m.def("pack_k", &pack_k, "a K-type matrix repacked for the packed path (empty where there is none)");
  m.def("set_packed_rows", [](int64_t lo, int64_t hi) {
    g_packed_min_rows = lo;
    g_packed_max_rows = hi;
  }, "the row counts (lo..hi) the K types run on packed weights where given (lo 0: never)");
  m.def("packed_rows", []() { return std::vector<int64_t>{g_packed_min_rows, g_packed_max_rows}; },
        "the row counts (lo, hi) of the packed path (lo 0: never)");
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
