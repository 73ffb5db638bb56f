// y = x W^T (+ bias) for a few rows of x: the GEMMs of a decode, verification or draft pass at small batch.
//
// At 2-8 rows MKL's sgemm costs twice its single-row gemv on the same weight (measured, AMD EPYC avx512, 2 threads:
// [576, 256] 23 us at one row, 46-50 us at 2-8 rows; [2048, 256] 81 vs 154 us): it re-blocks the weight for a
// general GEMM, so a verification pass of K + 1 rows paid twice a decode's GEMM time before any arithmetic. Here the
// weight is streamed once from where it lies, sixteen of its rows at a time against up to four rows of x (x's few
// rows stay in L1), with a separate accumulator for each pair so the FMA units are not waiting on one dependency
// chain, and the next sixteen rows prefetched while these are summed.
//
// Each output is one dot product summed in one fixed order (16 lanes, then a tree), whatever the row count and the
// thread split: a row's result does not depend on the batch it runs in.
//
// bfloat16 weights (half the bytes a decode streams) run the same loop on bf16 values widened to float32 as they
// load, or, on a CPU with avx512_bf16, on vdpbf16ps dot products (a runtime check picks; both are tested).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "vec16.h"

namespace {

constexpr int64_t kMaxRows = 16;            // rows of x the kernel takes (the caller checks SMALL_GEMM_ROWS)
constexpr int64_t kWeightRows = 4;          // weight rows of block<> (the experts kernel, a block's last rows)
// Weight rows streamed together against every row of x: 16 rows' loads in flight overlap (2 threads read ~20-29
// GB/s this way on one row, AMD EPYC avx512, against ~17-21 GB/s for oneDNN's bf16 GEMV and a 4-row loop). avx2
// keeps 4 (its f32x16 is two of its 16 registers).
#ifdef __AVX512F__
constexpr int64_t kGemvRows = 16;
#else
constexpr int64_t kGemvRows = 4;
#endif
constexpr int64_t kGrainElements = 1 << 16;  // multiply-adds / 4 a thread takes at least: small GEMMs stay on one

inline f32x16 load_any(const float* p) { return load16(p); }
inline f32x16 load_any(const unsigned short* p) { return load16_bf16(p); }
inline float to_float(float v) { return v; }
inline float to_float(unsigned short b) {  // a bfloat16's bits -> its float32 value
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Up to 4 rows of x (MR) against NW weight rows (w[0..NW)): out[m * ldo + i] = x_m . w_i over k. T: float, or the
// bits of bfloat16 values, widened to float32 as they are loaded (exact), multiplied and summed in float32.
template <int MR, int NW, typename T>
inline void block(const T* const* x, const T* const* w, int64_t k, float* out, int64_t ldo) {
  f32x16 acc[MR][NW];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NW; ++j) acc[m][j] = f32x16{};  // (an `= {}` of the array became a rep stos on the stack)
  }
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    f32x16 wj[NW];
    for (int j = 0; j < NW; ++j) wj[j] = load_any(w[j] + i);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const f32x16 xm = load_any(x[m] + i);
      for (int j = 0; j < NW; ++j) acc[m][j] += xm * wj[j];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NW; ++j) {
      float sum = hsum(acc[m][j]);
      for (int64_t t = i; t < k; ++t) sum += to_float(x[m][t]) * to_float(w[j][t]);
      out[m * ldo + j] = sum;
    }
  }
}

// block<> for mr = 1..4 rows of x against kWeightRows weight rows, the tile's rows kWeightRows apart. avx2 runs it as
// 2 x 2 blocks: a 4 x 4 block's 16 sums are 32 of its 16 registers, so every step spilled them to the stack (a MoE
// layer's experts at 32 tokens, with the prefetch below: 404 -> 280 us, benchmarks/native_ab.py experts). Each
// output is the same chain over k either way: the same bits.
template <typename T>
inline void block_rows(int64_t mr, const T* const* x, const T* const* w, int64_t k, float* tile) {
#ifdef __AVX512F__
  switch (mr) {
    case 1: block<1, kWeightRows>(x, w, k, tile, kWeightRows); break;
    case 2: block<2, kWeightRows>(x, w, k, tile, kWeightRows); break;
    case 3: block<3, kWeightRows>(x, w, k, tile, kWeightRows); break;
    default: block<4, kWeightRows>(x, w, k, tile, kWeightRows); break;
  }
#else
  for (int64_t m = 0; m < mr; m += 2) {
    for (int64_t j = 0; j < kWeightRows; j += 2) {
      if (mr - m >= 2) {
        block<2, 2>(x + m, w + j, k, tile + m * kWeightRows + j, kWeightRows);
      } else {
        block<1, 2>(x + m, w + j, k, tile + m * kWeightRows + j, kWeightRows);
      }
    }
  }
#endif
}

// Software prefetch of the next weight block. A weight row of SmolLM2 is 2-6 KB: too short a stream for the hardware
// prefetchers to run far ahead, so a block's first loads wait on DRAM, and at 2-4 rows of x (a verification pass)
// the multiply-adds between loads leave the memory bus idle. Spreading prefetches of block b + 1 over block b's loop
// keeps it busy: measured against the kernel before (Intel Xeon with AMX, 2 threads, a decode's 120 SmolLM2
// projections in turn, cold; benchmarks/native_ab.py gemv-sweep, docs/kernels.md) float32 1 row 13.6 -> 13.1 ms,
// 4 rows 20.1 -> 13.6 ms; bfloat16 1 row 16.8 -> 14.0 ms, 4 rows 32.7 -> 15.6 ms. prefetcht2: into the outer caches,
// not L1, which holds the block being summed.
struct NextBlock {
  const char* lines = nullptr;  // the next block's first byte, or null (the last block of a thread's range)
  int64_t count = 0;            // its 64-byte lines
  int64_t per_step = 0;         // lines to prefetch each step of the k loop, so the whole block is asked for in time
  int64_t issued = 0;

  NextBlock(const void* next, int64_t bytes, int64_t steps)
      : lines(static_cast<const char*>(next)), count(next ? (bytes + 63) / 64 : 0),
        per_step(steps > 0 ? (count + steps - 1) / steps : count) {}

  inline void step() {
    for (int64_t q = 0; q < per_step && issued < count; ++q, ++issued) {
      _mm_prefetch(lines + issued * 64, _MM_HINT_T2);
    }
  }
};

// MR (1-4) rows of x against kGemvRows contiguous weight rows [kGemvRows, k]: out[m * ldo + j] = x_m . w_j. Each
// output is summed exactly as block<> sums it (16 lanes stepping by 16, then hsum and the tail), so a row's result
// is the same bits whatever the rows beside it and whichever path runs it. kGemvRows weight rows in flight at once
// (their loads overlap); at MR = 1 the 16 accumulators stay in registers, at MR > 1 the MR x 16 live in L1 and
// each weight vector loaded is used MR times.
template <int MR, typename T>
inline void rows_block(const T* const* x, const T* w, int64_t k, float* out, int64_t ldo, NextBlock next) {
  f32x16 acc[MR][kGemvRows];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kGemvRows; ++j) acc[m][j] = f32x16{};
  }
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    next.step();
    f32x16 xm[MR];
    for (int m = 0; m < MR; ++m) xm[m] = load_any(x[m] + i);
#pragma GCC unroll 16
    for (int j = 0; j < kGemvRows; ++j) {
      const f32x16 wj = load_any(w + j * k + i);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] += xm[m] * wj;
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kGemvRows; ++j) {
      float sum = hsum(acc[m][j]);
      for (int64_t t = i; t < k; ++t) sum += to_float(x[m][t]) * to_float(w[j * k + t]);
      out[m * ldo + j] = sum;
    }
  }
}

template <typename T>
inline void rows_blocks(int64_t mr, const T* const* x, const T* w, int64_t k, float* tile, NextBlock next) {
  switch (mr) {
    case 1: rows_block<1>(x, w, k, tile, kGemvRows, next); break;
    case 2: rows_block<2>(x, w, k, tile, kGemvRows, next); break;
    case 3: rows_block<3>(x, w, k, tile, kGemvRows, next); break;
    default: rows_block<4>(x, w, k, tile, kGemvRows, next); break;
  }
}

// The same for bfloat16 on a CPU with avx512_bf16: vdpbf16ps multiplies 32 bf16 pairs and adds each two adjacent
// products into one of 16 float32 lanes, so a weight byte costs a third of the widening path's instructions. The
// products of two bf16 are exact in float32; the sums round as the widening path's do, in another lane order (the
// two paths may differ in the last bit of a float32 sum, never in how they round the bf16 result's inputs).
// Compiled for that ISA alone (the target attribute) and called only where the CPU has it (kHasBf16Dot), so the
// extension still builds and runs on CPUs without it.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void block_dp(const unsigned short* const* x, const unsigned short* const* w, int64_t k, float* out, int64_t ldo) {
  __m512 acc[MR][kWeightRows];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kWeightRows; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w[0] + i), w1 = (__m512bh)_mm512_loadu_si512(w[1] + i),
                   w2 = (__m512bh)_mm512_loadu_si512(w[2] + i), w3 = (__m512bh)_mm512_loadu_si512(w[3] + i);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512bh xm = (__m512bh)_mm512_loadu_si512(x[m] + i);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xm, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xm, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xm, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xm, w3);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kWeightRows; ++j) {
      float sum = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t t = i; t < k; ++t) sum += to_float(x[m][t]) * to_float(w[j][t]);
      out[m * ldo + j] = sum;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void block_rows_dp(int64_t mr, const unsigned short* const* x, const unsigned short* const* w, int64_t k,
                   float* tile) {
  switch (mr) {
    case 1: block_dp<1>(x, w, k, tile, kWeightRows); break;
    case 2: block_dp<2>(x, w, k, tile, kWeightRows); break;
    case 3: block_dp<3>(x, w, k, tile, kWeightRows); break;
    default: block_dp<4>(x, w, k, tile, kWeightRows); break;
  }
}

// rows_block for avx512_bf16, summing each output as block_dp<> does
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void rows_block_dp(const unsigned short* const* x, const unsigned short* w, int64_t k, float* out, int64_t ldo,
                   NextBlock next) {
  __m512 acc[MR][kGemvRows];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kGemvRows; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    next.step();
    __m512bh xm[MR];
    for (int m = 0; m < MR; ++m) xm[m] = (__m512bh)_mm512_loadu_si512(x[m] + i);
#pragma GCC unroll 16
    for (int j = 0; j < kGemvRows; ++j) {
      const __m512bh wj = (__m512bh)_mm512_loadu_si512(w + j * k + i);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xm[m], wj);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kGemvRows; ++j) {
      float sum = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t t = i; t < k; ++t) sum += to_float(x[m][t]) * to_float(w[j * k + t]);
      out[m * ldo + j] = sum;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void rows_blocks_dp(int64_t mr, const unsigned short* const* x, const unsigned short* w, int64_t k, float* tile,
                    NextBlock next) {
  switch (mr) {
    case 1: rows_block_dp<1>(x, w, k, tile, kGemvRows, next); break;
    case 2: rows_block_dp<2>(x, w, k, tile, kGemvRows, next); break;
    case 3: rows_block_dp<3>(x, w, k, tile, kGemvRows, next); break;
    default: rows_block_dp<4>(x, w, k, tile, kGemvRows, next); break;
  }
}

const bool kHasBf16Dot = __builtin_cpu_supports("avx512bf16");

// The weight streamed once for every row of x: parallel over blocks of kGemvRows weight rows, each against every row
// of x, 4 at a time (rows 5-16 read the block again from cache; only the first group prefetches the next block).
// rows_of(mr, xr, w, k, tile, next) runs a block; the last n % kGemvRows weight rows go through tile_of (block<>'s
// 4 weight rows at a time). step: the elements of k one step of rows_of's loop covers. write(m, c, value) stores
// one result.
template <typename T, typename Rows, typename Tile, typename Write>
void stream_rows(const T* xp, int64_t ldx, const T* wp, int64_t rows, int64_t n, int64_t k, int64_t step,
                 Rows rows_of, Tile tile_of, Write write) {
  const int64_t blocks = n / kGemvRows, groups = (rows + 3) / 4;
  const int64_t block_bytes = kGemvRows * k * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, kGemvRows * k * groups / 4));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float tile[4 * kGemvRows];
    for (int64_t b = begin; b < end; ++b) {
      const T* wb = wp + b * kGemvRows * k;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        const T* xr[4];
        for (int64_t m = 0; m < 4; ++m) xr[m] = xp + (m0 + std::min<int64_t>(m, mr - 1)) * ldx;
        const bool ahead = m0 == 0 && b + 1 < end;
        rows_of(mr, xr, wb, k, tile, NextBlock(ahead ? wb + kGemvRows * k : nullptr, block_bytes, k / step));
        for (int64_t m = 0; m < mr; ++m) {
          for (int64_t j = 0; j < kGemvRows; ++j) write(m0 + m, b * kGemvRows + j, tile[m * kGemvRows + j]);
        }
      }
    }
  });
  float tile[kMaxRows * kWeightRows];
  for (int64_t n0 = blocks * kGemvRows; n0 < n; n0 += kWeightRows) {
    const int64_t width = std::min<int64_t>(kWeightRows, n - n0);
    // a partial last block repeats its last weight row; the repeats' results are not written
    const T* w[kWeightRows];
    for (int64_t j = 0; j < kWeightRows; ++j) w[j] = wp + (n0 + std::min<int64_t>(j, width - 1)) * k;
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      const T* xr[4];
      const int64_t mr = std::min<int64_t>(4, rows - m0);
      for (int64_t m = 0; m < 4; ++m) xr[m] = xp + (m0 + std::min<int64_t>(m, mr - 1)) * ldx;
      tile_of(mr, xr, w, k, tile + m0 * kWeightRows);
    }
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < width; ++j) write(m, n0 + j, tile[m * kWeightRows + j]);
    }
  }
}

// x: [M, K] float32 or bfloat16 (rows may be strided, K contiguous), M <= 16; weight: [N, K] of x's dtype,
// contiguous; bias: [N] of x's dtype or None. Returns a new [M, N] of x's dtype (bfloat16: the float32 sum plus the
// bias, rounded once). isa (bfloat16 only): 1 the avx512_bf16 dot products, 0 the widening path, -1 the best here.
at::Tensor small_linear_isa(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: CPU tensors only");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "small_linear: float32 or bfloat16 x and weight of one dtype, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K] must share K, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_linear: at most ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "small_linear: K must be contiguous in x and weight");
  TORCH_CHECK(isa >= -1 && isa <= 1, "small_linear: isa is -1 (best), 0 (widening) or 1 (avx512_bf16), got ", isa);
  TORCH_CHECK(isa != 1 || kHasBf16Dot, "small_linear: this CPU has no avx512_bf16 dot products");
  const int64_t rows = x.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n && bias->device().is_cpu(),
                "small_linear: bias must be [", n, "] of x's dtype");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0 || n == 0) return out;
  const int64_t ldx = x.stride(0);
  if (dtype == at::kFloat) {
    float* op = out.data_ptr<float>();
    auto write = [&](int64_t m, int64_t c, float v) { op[m * n + c] = v + (bp ? bp[c] : 0.f); };
    stream_rows(x.data_ptr<float>(), ldx, weight.data_ptr<float>(), rows, n, k, 16, rows_blocks<float>,
                block_rows<float>, write);
    return out;
  }
  const auto* xp = reinterpret_cast<const unsigned short*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const unsigned short*>(weight.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  auto write = [&](int64_t m, int64_t c, float v) { op[m * n + c] = at::BFloat16(v + (bp ? bp[c] : 0.f)); };
  const bool dot = isa == 1 || (isa == -1 && kHasBf16Dot);
  if (dot) {
    stream_rows(xp, ldx, wp, rows, n, k, 32, rows_blocks_dp, block_rows_dp, write);
  } else {
    stream_rows(xp, ldx, wp, rows, n, k, 16, rows_blocks<unsigned short>, block_rows<unsigned short>, write);
  }
  return out;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return small_linear_isa(x, weight, bias, -1);
}

// out[p, :] = rows[p] . weight[expert of p]^T for P rows grouped by expert: rows [first[e], first[e + 1]) use
// weight + e * n * k ([n, k] contiguous). Parallel over (expert, 4 weight rows); each output is block<>'s one
// fixed-order dot product, so a row's result does not depend on which other rows share its expert.
void grouped_rows_gemm(const std::vector<const float*>& rows, const std::vector<int64_t>& first, const float* weight,
                       int64_t n, int64_t k, float* out) {
  const int64_t experts = static_cast<int64_t>(first.size()) - 1;
  const int64_t blocks = (n + kWeightRows - 1) / kWeightRows;
  std::vector<int64_t> units;  // expert * blocks + block, for the experts that have rows
  for (int64_t e = 0; e < experts; ++e) {
    if (first[e + 1] > first[e]) {
      for (int64_t b = 0; b < blocks; ++b) units.push_back(e * blocks + b);
    }
  }
  if (units.empty()) return;
  const int64_t pairs = first[experts];
  const int64_t unit_work = kWeightRows * k * ((pairs + 3) / 4) / std::max<int64_t>(1, static_cast<int64_t>(units.size()) / blocks);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, unit_work));
  at::parallel_for(0, static_cast<int64_t>(units.size()), grain, [&](int64_t begin, int64_t end) {
    float tile[4 * kWeightRows];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t e = units[u] / blocks, b = units[u] % blocks;
      const int64_t n0 = b * kWeightRows, width = std::min<int64_t>(kWeightRows, n - n0);
      if (u + 1 < end) {  // the next unit's weight rows, asked for while these are summed (they come cold from L3)
        const int64_t e1 = units[u + 1] / blocks, n1 = units[u + 1] % blocks * kWeightRows;
        const char* next = reinterpret_cast<const char*>(weight + (e1 * n + n1) * k);
        const int64_t bytes = std::min<int64_t>(kWeightRows, n - n1) * k * static_cast<int64_t>(sizeof(float));
        for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      }
      const float* w[kWeightRows];
      for (int64_t j = 0; j < kWeightRows; ++j) w[j] = weight + (e * n + n0 + std::min<int64_t>(j, width - 1)) * k;
      for (int64_t p0 = first[e]; p0 < first[e + 1]; p0 += 4) {
        const int64_t mr = std::min<int64_t>(4, first[e + 1] - p0);
        const float* xr[4];
        for (int64_t m = 0; m < 4; ++m) xr[m] = rows[p0 + std::min<int64_t>(m, mr - 1)];
        block_rows<float>(mr, xr, w, k, tile);
        for (int64_t m = 0; m < mr; ++m) {
          for (int64_t j = 0; j < width; ++j) out[(p0 + m) * n + n0 + j] = tile[m * kWeightRows + j];
        }
      }
    }
  });
}

}  // namespace

namespace tandem_native {
void silu_mul(const float* g, const float* u, float* o, int64_t n);  // elementwise.cpp
// the op itself, for the fused decoder layer (decoder_layer.cpp)
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return ::small_linear(x, weight, bias);
}
}  // namespace tandem_native

namespace {

// The routed experts of a MoE layer: out[t] = sum over t's choices c, in ascending expert order, of
// weight_c * (w2[e_c] . (silu(w13[e_c, :I] . x_t) * (w13[e_c, I:] . x_t))). Only the chosen (token, expert) pairs
// are computed (a dense run over every expert costs E / K times the multiply-adds), each expert's weights streamed
// once for all of its rows; a choice outside [expert_start, expert_start + E) (another expert-parallel rank's)
// adds nothing. x: [T, H] (H contiguous); w13: [E, 2I, H]; w2: [E, H, I] contiguous float32; topk_ids: [T, K]
// int64 global ids; topk_weights: [T, K] float32. Returns a new [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, int64_t expert_start) {
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(), "moe_experts: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat &&
                  topk_weights.scalar_type() == at::kFloat, "moe_experts: float32 x, weights and routing weights");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "moe_experts: topk_ids must be int64");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "moe_experts: x must be [T, H] with H contiguous, got ", x.sizes());
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I] must be contiguous");
  const int64_t t_count = x.size(0), h = x.size(1), experts = w13.size(0), inner = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * inner && w13.size(2) == h && w2.size(0) == experts && w2.size(1) == h &&
                  w2.size(2) == inner, "moe_experts: shapes disagree: x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == t_count && topk_ids.sizes() == topk_weights.sizes() &&
                  topk_ids.is_contiguous() && topk_weights.is_contiguous(),
              "moe_experts: topk_ids and topk_weights must be contiguous [T, K]");
  const int64_t k = topk_ids.size(1);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* route = topk_weights.data_ptr<float>();
  // the chosen pairs grouped by local expert (a counting sort; a token's choices are distinct experts)
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t c = 0; c < t_count * k; ++c) {
    const int64_t e = ids[c] - expert_start;
    if (e >= 0 && e < experts) ++first[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  const int64_t pairs = first[experts];
  std::vector<int64_t> next(first.begin(), first.end() - 1), pair_of(t_count * k, -1);
  std::vector<const float*> rows(pairs);
  const float* xp = x.data_ptr<float>();
  for (int64_t c = 0; c < t_count * k; ++c) {
    const int64_t e = ids[c] - expert_start;
    if (e < 0 || e >= experts) continue;
    pair_of[c] = next[e]++;
    rows[pair_of[c]] = xp + (c / k) * x.stride(0);
  }
  at::Tensor out = at::zeros({t_count, h}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (pairs == 0 || h == 0) return out;
  at::Tensor gate_up = at::empty({pairs, 2 * inner}, x.options());
  grouped_rows_gemm(rows, first, w13.data_ptr<float>(), 2 * inner, h, gate_up.data_ptr<float>());
  at::Tensor act = at::empty({pairs, inner}, x.options());
  float* gp = gate_up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, pairs, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, inner)), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) tandem_native::silu_mul(gp + p * 2 * inner, gp + p * 2 * inner + inner, ap + p * inner, inner);
  });
  std::vector<const float*> act_rows(pairs);
  for (int64_t p = 0; p < pairs; ++p) act_rows[p] = ap + p * inner;
  at::Tensor down = at::empty({pairs, h}, x.options());
  grouped_rows_gemm(act_rows, first, w2.data_ptr<float>(), h, inner, down.data_ptr<float>());
  const float* dp = down.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // each token's choices summed in ascending expert order, each weighted first (the PyTorch paths' order)
  at::parallel_for(0, t_count, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, h * k)), [&](int64_t b, int64_t e) {
    std::vector<std::pair<int64_t, int64_t>> mine(k);  // (local expert, pair)
    for (int64_t t = b; t < e; ++t) {
      int64_t n = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = pair_of[t * k + j];
        if (p >= 0) mine[n++] = {ids[t * k + j] - expert_start, j};
      }
      std::sort(mine.begin(), mine.begin() + n);
      float* o = op + t * h;
      for (int64_t c = 0; c < n; ++c) {
        const int64_t j = mine[c].second;
        const float wgt = route[t * k + j];
        const float* y = dp + pair_of[t * k + j] * h;
        for (int64_t i = 0; i < h; ++i) o[i] = o[i] + y[i] * wgt;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_linear", torch::kCPU, &small_linear);
  m.def("small_linear_isa(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
  m.impl("small_linear_isa", torch::kCPU, &small_linear_isa);
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, int expert_start) -> Tensor");
  m.impl("moe_experts", torch::kCPU, &moe_experts);
}
