// Linears on avx2 CPUs as panels of the weight: bfloat16 where the CPU has no bf16 dot products, and float32 where
// it has no avx512.
//
// bfloat16: where neither avx512_bf16 nor AMX is present, oneDNN has no bf16 path and torch's bf16 matmul falls back
// to a generic loop: measured on an AMD EPYC (Zen 3, avx2, 2 threads), SmolLM2's [3072, 576] gate_up at 32 rows ran
// 4x slower in bf16 than in float32 (MKL's sgemm), so a bf16 model decoded a batch slower than its float32 copy.
// Widening a bf16 value is exact and cheap (it is a float32's upper half), so this kernel runs MKL's own float32
// inner loop on bf16 weights: 6 rows of x against 16 columns of the weight, 12 float32 accumulators, one weight
// load and two widening ops per 12 FMAs, and reads half the bytes a float32 weight would.
//
// float32: the same loop on float32 panels (two loads per 12 FMAs) keeps avx2's FMA units busier than oneDNN's
// float32 GEMM does at a decode batch's rows (measured: the note at FP32_PANEL_MAX_ROWS in tandem/layers/cpu_gemm.py).
//
// The weight is packed once (panel_pack in tandem/native/__init__.py) into panels of 16 output columns,
// [N / 16, K, 16]: for each k the panel's 16 weights in one piece. bfloat16 lays columns j and 8 + j side by side,
// so `<< 16` of a 32-bit lane widens column j and `& 0xffff0000` column 8 + j; float32 keeps the columns in order.
// Every output is one FMA chain over k in order, whatever the rows around it: a row's result does not depend on its
// batch (greedy verification gives decoding's bits), and a bf16 output is the float32 sum rounded once, the bias
// added first.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec16.h"  // widen_bf16

namespace {

constexpr int64_t kPanel = 16;  // output columns of a panel
constexpr int64_t kRows = 6;    // rows of x a pass holds in registers (12 accumulators of the 16 avx2 registers)
// rows of x a thread's panels pass over before the next rows: a panel's piece of K (piece_steps) stays in L1 while
// every 6 rows of the block pass over it, so each panel is read from memory once a block (128 rows x a piece of
// <= 512 steps is at most 256 KiB of float32 x, in L2); at 48 rows SmolLM2's 128-row verification pass read its
// LM head from DRAM three times
constexpr int64_t kRowBlock = 128;
// Blocks of up to kWholeRows rows pass over each panel's whole K, one panel at a time, its first pass asking for the
// weight kAheadSteps k steps ahead (2 KiB of float32, 1 KiB of bf16). A verification pass's 4-6 rows went through the
// pieces below, whose prefetch asks for a whole next piece at once and then waits on it, and streamed the weight at
// ~60% of a one-row decode's rate. Measured (AMD EPYC, Zen 3, 2 threads, SmolLM2-135M's 120 projections in turn, cold,
// median ms a sweep of 3 runs alternating with the kernel before): float32 4 / 6 / 8 / 12 rows 22.2 / 24.4 / 27.1 /
// 29.6 -> 17.5 / 19.1 / 22.9 / 25.1, one row 13.8 / 13.2; bfloat16 15.6 / 17.6 / 21.3 / 23.4 -> 10.6 / 11.7 / 15.9 /
// 18.8, one row 8.2 / 8.1
constexpr int64_t kWholeRows = 12;
constexpr int64_t kAheadSteps = 32;
// bf16 rows widened into a buffer each thread keeps, up to this many floats (256 KiB: 64 rows of K = 1,024)
constexpr int64_t kKeptWidened = 64 << 10;

#if defined(__AVX2__) && defined(__FMA__)
// a panel's 16 weights at one k as float32: columns 0-7 and 8-15
inline void load_panel(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                          // columns 0-7
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));  // 8-15
}

inline void load_panel(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

// acc[m][p] (two 8-lane halves: columns 0-7, 8-15 of panel p) += x[m, k] * w_p[k, :] over k; then
// out[m, panel p's columns] = O(acc + bias) for the panel's first `cols` columns (of the last panel, fewer). W, O:
// uint16_t (bf16 bits) and c10::BFloat16, or float and float
//
// K in pieces: the pass covers k in [k0, k1) of the weight's `k`; `partial` ([MR][NP][16] floats) holds the sums of
// the pieces before (k0 > 0) and takes these (k1 < k) instead of out. A chain stopped and resumed through memory is
// the same chain: the float32 values stored are the registers' own.
template <int MR, int NP, bool PF, typename W, typename O>
void pass(const float* x, int64_t ldx, const W* w, int64_t k, int64_t k0, int64_t k1, float* partial, int64_t n,
          int64_t col0, const float* bias, O* out, int64_t ldo) {
  __m256 lo[MR][NP], hi[MR][NP];
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) {
      const float* c = partial + (m * NP + p) * kPanel;
      lo[m][p] = k0 > 0 ? _mm256_loadu_ps(c) : _mm256_setzero_ps();
      hi[m][p] = k0 > 0 ? _mm256_loadu_ps(c + 8) : _mm256_setzero_ps();
    }
  }
  const int64_t panel = k * kPanel;
  for (int64_t kk = k0; kk < k1; ++kk) {
    // an asm statement that names no memory: with _mm_prefetch GCC kept the accumulators in memory, storing each
    // of them every step (3x slower)
    if constexpr (PF) {
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        asm volatile("prefetcht0 (%0)" : : "r"(w + p * panel + (kk + kAheadSteps) * kPanel));
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      __m256 w_lo, w_hi;
      load_panel(w + p * panel + kk * kPanel, w_lo, w_hi);
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) {
        const __m256 xm = _mm256_broadcast_ss(x + m * ldx + kk);
        lo[m][p] = _mm256_fmadd_ps(xm, w_lo, lo[m][p]);
        hi[m][p] = _mm256_fmadd_ps(xm, w_hi, hi[m][p]);
      }
    }
  }
  alignas(32) float sums[MR][NP][kPanel];  // out of the registers at once, then rounded
  float* keep = k1 < k ? partial : &sums[0][0][0];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(keep + (m * NP + p) * kPanel, lo[m][p]);
      _mm256_storeu_ps(keep + (m * NP + p) * kPanel + 8, hi[m][p]);
    }
  }
  if (k1 < k) return;
  for (int p = 0; p < NP; ++p) {
    const int64_t c0 = col0 + p * kPanel, cols = std::min<int64_t>(kPanel, n - c0);
    for (int m = 0; m < MR; ++m) {
      O* row = out + m * ldo + c0;
      for (int64_t c = 0; c < cols; ++c) row[c] = O(sums[m][p][c] + (bias ? bias[c0 + c] : 0.f));
    }
  }
}

template <typename W, typename O>
using PassFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                        const float*, O*, int64_t);

// the pass for `rows` (1-6) rows of x over `np` panels at once (np > 1 only for one to three rows: several panels'
// FMA chains interleaved keep the FMA units busy while a decode's few rows stream the weight)
template <typename W, typename O, bool PF>
PassFn<W, O> pass_for_pf(int64_t rows, int64_t np) {
  switch (rows) {
    case 1: return np == 4 ? pass<1, 4, PF, W, O> : pass<1, 1, PF, W, O>;
    case 2: return np == 3 ? pass<2, 3, PF, W, O> : pass<2, 1, PF, W, O>;
    case 3: return np == 2 ? pass<3, 2, PF, W, O> : pass<3, 1, PF, W, O>;
    case 4: return pass<4, 1, PF, W, O>;
    case 5: return pass<5, 1, PF, W, O>;
    default: return pass<6, 1, PF, W, O>;
  }
}
template <typename W, typename O>
PassFn<W, O> pass_for(int64_t rows, int64_t np, bool prefetch = false) {
  return prefetch ? pass_for_pf<W, O, true>(rows, np) : pass_for_pf<W, O, false>(rows, np);
}

int64_t panels_at_once(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }

// k steps of a piece: one panel's piece in at most 16 KiB, half of L1, while 6-row passes go over it (a float32
// panel of SmolLM2's K = 576, 36 KiB, was read from L2 by every pass: 100-120 GFLOP/s at 16-128 rows against 160
// for bf16's 18 KiB panels); the pieces of a K are equal
int64_t piece_steps(int64_t k, int64_t weight_bytes) {
  const int64_t pieces = std::max<int64_t>(1, (k * kPanel * weight_bytes + (16 << 10) - 1) / (16 << 10));
  return (k + pieces - 1) / pieces;
}

// rows of the next pass when `left` rows remain: 6, but 7-9 as two passes of 3-5 (a pass of 1-2 rows holds 2-4
// FMA chains, too few to keep two FMA units busy: 32 rows as 6 x 5 + 2 ran ~25% below 128 rows' rate)
int64_t group_rows(int64_t left) { return left > kRows && left < kRows + 4 ? (left + 1) / 2 : std::min(kRows, left); }

// out [M, N] = x [M, K] (float32) times the packed weight's panels, parallel over panels
template <typename W, typename O>
void run_panels(const float* xp, const W* wp, int64_t m, int64_t k, int64_t n, int64_t panels, const float* bp,
                O* op) {
  const int64_t panel = k * kPanel, steps = piece_steps(k, sizeof(W));
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float partial[kRowBlock * kPanel];  // a row block's sums over the pieces before, one panel
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t block = std::min(kRowBlock, m - m0);
      // few rows: several panels a pass, the whole K (each panel is read once); bf16 3 rows as below (its 12
      // accumulators and widening ops left the loads waiting: 3 rows ran 1.3x a one-row sweep, 1.2x as below)
      if (block <= (sizeof(W) == 2 ? 2 : 3)) {
        const int64_t np = panels_at_once(block);
        for (int64_t p = begin; p < end;) {
          const int64_t at_once = p + np <= end ? np : 1;  // the thread's last few panels one at a time
          pass_for<W, O>(block, at_once)(xp + m0 * k, k, wp + p * panel, k, 0, k, partial, n, p * kPanel, bp,
                                         op + m0 * n, n);
          p += at_once;
        }
        continue;
      }
      if (block <= kWholeRows) {  // one panel at a time, the whole K, its first pass prefetching ahead
        for (int64_t p = begin; p < end; ++p) {
          for (int64_t r = m0, rows = 0; r < m0 + block; r += rows) {
            rows = group_rows(m0 + block - r);
            pass_for<W, O>(rows, 1, r == m0)(xp + r * k, k, wp + p * panel, k, 0, k, partial, n, p * kPanel, bp,
                                             op + r * n, n);
          }
        }
        continue;
      }
      // otherwise one panel at a time, piece by piece of K, each piece against every 6 rows of the block while it
      // stays in L1
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < k; k0 += steps) {
          const int64_t k1 = std::min(k, k0 + steps);
          // the next piece (the rest of this panel, or the next panel's first: the thread's panels lie back to
          // back) asked for into L2 a share before each pass over this one, so the first pass over the next does
          // not wait on DRAM (cold weights: a decode's, read once a step)
          const char* next = reinterpret_cast<const char*>(wp + p * panel + k1 * kPanel);
          const char* stop = reinterpret_cast<const char*>(wp + end * panel);
          const int64_t lines = std::min<int64_t>(stop - next, (k1 - k0) * kPanel * sizeof(W)) / 64;
          const int64_t share = (lines * kRows + block - 1) / block;  // lines a pass of 6 rows asks for
          int64_t asked = 0;
          for (int64_t r = m0, rows = 0; r < m0 + block; r += rows) {
            for (const int64_t upto = std::min(lines, asked + share); asked < upto; ++asked) {
              _mm_prefetch(next + asked * 64, _MM_HINT_T1);
            }
            rows = group_rows(m0 + block - r);
            pass_for<W, O>(rows, 1)(xp + r * k, k, wp + p * panel, k, k0, k1, partial + (r - m0) * kPanel, n,
                                    p * kPanel, bp, op + r * n, n);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

// x: [M, K] bf16 or float32 (K contiguous); packed: [N_pad / 16, K, 16] of x's dtype (panel_pack); n: the weight's
// N (<= N_pad); bias: [N] of x's dtype or None -> a new [M, N] of x's dtype
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "panel_linear: CPU tensors only");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && packed.scalar_type() == dtype,
              "panel_linear: bfloat16 or float32 x and weight of one dtype, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kPanel,
              "panel_linear: x [M, K] with K contiguous, packed [N / 16, K, 16] contiguous; got ", x.sizes(),
              " and ", packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "panel_linear: x has K = ", k, ", the packed weight ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "panel_linear: N = ", n, " does not fit ", panels,
              " panels of 16 columns");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n && bias->device().is_cpu(),
                "panel_linear: bias must be a CPU [", n, "] of x's dtype");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out;
#if !defined(__AVX2__) || !defined(__FMA__)
  TORCH_CHECK(false, "panel_linear: built without avx2 and FMA (tandem.native.panels_available() says so)");
#else
  // x as contiguous float32 rows: bf16 widened once (exact) into this thread's buffer (decode-sized rows; a prompt
  // chunk's into one of its own, not kept), float32 read in place where its rows lie back to back. Not through
  // `x.to(kFloat)`: at a decode's one row that dispatch and its allocation (~5-8 us) were a tenth of a small
  // projection's time, four times a layer.
  thread_local std::vector<float> small_rows;
  std::vector<float> large_rows;
  const float* xp;
  at::Tensor x_dense;
  if (dtype == at::kFloat) {
    x_dense = m == 1 || x.stride(0) == k ? x : x.contiguous();
    xp = x_dense.data_ptr<float>();
  } else {
    std::vector<float>& widened = m * k <= kKeptWidened ? small_rows : large_rows;
    widened.resize(static_cast<size_t>(m * k));
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t r = 0; r < m; ++r) widen_bf16(xb + r * x.stride(0), widened.data() + r * k, k);
    xp = widened.data();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    run_panels(xp, packed.data_ptr<float>(), m, k, n, panels, bp, out.data_ptr<float>());
  } else {
    run_panels(xp, reinterpret_cast<const uint16_t*>(packed.data_ptr()), m, k, n, panels, bp,
               out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("panel_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("panel_linear", torch::kCPU, &panel_linear);
}
