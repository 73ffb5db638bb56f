// bfloat16 linears on CPUs without bf16 dot products (avx2 machines): FMA on weights widened to float32 in registers.
//
// Where neither avx512_bf16 nor AMX is present, oneDNN has no bf16 path and torch's bf16 matmul falls back to a
// generic loop: measured on an AMD EPYC (Zen 3, avx2, 2 threads), SmolLM2's [3072, 576] gate_up at 32 rows ran 4x
// slower in bf16 than in float32 (MKL's sgemm), so a bf16 model decoded a batch slower than its float32 copy.
// Widening a bf16 value is exact and cheap (it is a float32's upper half), so this kernel runs MKL's own float32
// inner loop on bf16 weights: 6 rows of x against 16 columns of the weight, 12 float32 accumulators, one weight
// load and two widening ops per 12 FMAs, and reads half the bytes a float32 weight would.
//
// The weight is packed once (panel_pack in tandem/native/__init__.py) into panels of 16 output columns,
// [N / 16, K, 16]: for each k the panel's 16 weights in one 32-byte piece, columns j and 8 + j side by side, so
// `<< 16` of a 32-bit lane widens column j and `& 0xffff0000` column 8 + j. Every output is one FMA chain over k
// in order, whatever the rows around it: a row's result does not depend on its batch (bf16 greedy verification
// gives decoding's bits), and the float32 sum is rounded once to bf16, the bias added first.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns of a panel
constexpr int64_t kRows = 6;    // rows of x a pass holds in registers (12 accumulators of the 16 avx2 registers)
// rows of x kept hot (in L1/L2, float32) while a thread's panels pass over them: 48 x 1,536 floats is 288 KiB
constexpr int64_t kRowBlock = 48;

#if defined(__AVX2__) && defined(__FMA__)
// acc[m][p] (two 8-lane halves: columns 0-7, 8-15 of panel p) += x[m, k] * w_p[k, :] over k; then
// out[m, panel p's columns] = bf16(acc + bias) for the panel's first `cols` columns (of the last panel, fewer)
template <int MR, int NP>
void pass(const float* x, int64_t ldx, const uint16_t* w, int64_t k, int64_t n, int64_t col0, const float* bias,
          c10::BFloat16* out, int64_t ldo) {
  __m256 lo[MR][NP], hi[MR][NP];
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) lo[m][p] = hi[m][p] = _mm256_setzero_ps();
  }
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t panel = k * kPanel;
  for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * panel + kk * kPanel));
      const __m256 w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));    // columns 0-7
      const __m256 w_hi = _mm256_castsi256_ps(_mm256_and_si256(v, upper));  // columns 8-15
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) {
        const __m256 xm = _mm256_broadcast_ss(x + m * ldx + kk);
        lo[m][p] = _mm256_fmadd_ps(xm, w_lo, lo[m][p]);
        hi[m][p] = _mm256_fmadd_ps(xm, w_hi, hi[m][p]);
      }
    }
  }
  alignas(32) float sums[MR][NP][kPanel];  // out of the registers at once, then rounded
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(sums[m][p], lo[m][p]);
      _mm256_store_ps(sums[m][p] + 8, hi[m][p]);
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t c0 = col0 + p * kPanel, cols = std::min<int64_t>(kPanel, n - c0);
    for (int m = 0; m < MR; ++m) {
      c10::BFloat16* row = out + m * ldo + c0;
      for (int64_t c = 0; c < cols; ++c) row[c] = c10::BFloat16(sums[m][p][c] + (bias ? bias[c0 + c] : 0.f));
    }
  }
}

using PassFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, const float*,
                        c10::BFloat16*, int64_t);

// the pass for `rows` (1-6) rows of x over `np` panels at once (np > 1 only for one to three rows: several panels'
// FMA chains interleaved keep the FMA units busy while a decode's few rows stream the weight)
PassFn pass_for(int64_t rows, int64_t np) {
  switch (rows) {
    case 1: return np == 4 ? pass<1, 4> : pass<1, 1>;
    case 2: return np == 3 ? pass<2, 3> : pass<2, 1>;
    case 3: return np == 2 ? pass<3, 2> : pass<3, 1>;
    case 4: return pass<4, 1>;
    case 5: return pass<5, 1>;
    default: return pass<6, 1>;
  }
}

int64_t panels_at_once(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }
#endif

}  // namespace

// x: [M, K] bf16 (K contiguous); packed: [N_pad / 16, K, 16] bf16 (panel_pack); n: the weight's N (<= N_pad);
// bias: [N] bf16 or None -> a new [M, N] bf16
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "panel_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "panel_linear: bfloat16 x and weight only, got ", x.scalar_type(), " and ", packed.scalar_type());
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
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == n,
                "panel_linear: bias must be a bfloat16 [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out;
#if !defined(__AVX2__) || !defined(__FMA__)
  TORCH_CHECK(false, "panel_linear: built without avx2 and FMA (tandem.native.panels_available() says so)");
#else
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // widened once: [M, K] float32
  const float* xp = xf.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t panel = k * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t block = std::min(kRowBlock, m - m0);
      // few rows: several panels a pass; otherwise one panel at a time against every 6 rows of the block (the
      // panel stays in L1/L2 while the row groups pass over it)
      const int64_t np = block <= 3 ? panels_at_once(block) : 1;
      for (int64_t p = begin; p < end;) {
        const int64_t at_once = p + np <= end ? np : 1;  // the thread's last few panels one at a time
        for (int64_t r = m0; r < m0 + block; r += kRows) {
          const int64_t rows = std::min(kRows, m0 + block - r);
          pass_for(rows, at_once)(xp + r * k, k, wp + p * panel, k, n, p * kPanel, bp, op + r * n, n);
        }
        p += at_once;
      }
    }
  });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("panel_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("panel_linear", torch::kCPU, &panel_linear);
}
