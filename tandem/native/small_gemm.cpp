// y = x W^T (+ bias) for a few rows of x: the GEMMs of a decode, verification or draft pass at small batch.
//
// At 2-8 rows MKL's sgemm costs twice its single-row gemv on the same weight (measured, AMD EPYC avx512, 2 threads:
// [576, 256] 23 us at one row, 46-50 us at 2-8 rows; [2048, 256] 81 vs 154 us): it re-blocks the weight for a
// general GEMM, so a verification pass of K + 1 rows paid twice a decode's GEMM time before any arithmetic. Here the
// weight is streamed once from where it lies, four of its rows at a time against every row of x (x's few rows stay
// in L1), with 4 x 4 independent accumulators so the FMA units are not waiting on one dependency chain.
//
// Each output is one dot product summed in one fixed order (16 lanes, then a tree), whatever the row count and the
// thread split: a row's result does not depend on the batch it runs in.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

constexpr int64_t kMaxRows = 16;            // rows of x the kernel takes (the caller checks SMALL_GEMM_ROWS)
constexpr int64_t kWeightRows = 4;          // weight rows a pass streams together
constexpr int64_t kGrainElements = 1 << 16;  // multiply-adds / 4 a thread takes at least: small GEMMs stay on one

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(f32x16 acc) {
  const f32x8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// Up to 4 rows of x (MR) against 4 weight rows (w[0..3]): out[m * ldo + i] = x_m . w_i over k.
template <int MR>
inline void block(const float* const* x, const float* const* w, int64_t k, float* out, int64_t ldo) {
  f32x16 acc[MR][kWeightRows] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const f32x16 w0 = load16(w[0] + i), w1 = load16(w[1] + i), w2 = load16(w[2] + i), w3 = load16(w[3] + i);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const f32x16 xm = load16(x[m] + i);
      acc[m][0] += xm * w0;
      acc[m][1] += xm * w1;
      acc[m][2] += xm * w2;
      acc[m][3] += xm * w3;
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kWeightRows; ++j) {
      float sum = hsum(acc[m][j]);
      for (int64_t t = i; t < k; ++t) sum += x[m][t] * w[j][t];
      out[m * ldo + j] = sum;
    }
  }
}

// x: [M, K] float32 (rows may be strided, K contiguous), M <= 16; weight: [N, K] float32 contiguous;
// bias: [N] float32 or None. Returns a new [M, N].
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "small_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K] must share K, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_linear: at most ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "small_linear: K must be contiguous in x and weight");
  const int64_t rows = x.size(0), n = weight.size(0), k = weight.size(1);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous() && bias->device().is_cpu(), "small_linear: bias must be float32 [", n, "]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (n + kWeightRows - 1) / kWeightRows;
  // work of a block: its weight rows times the passes over them (one per 4 rows of x)
  const int64_t block_work = kWeightRows * k * ((rows + 3) / 4);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, block_work));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float tile[kMaxRows * kWeightRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kWeightRows, width = std::min<int64_t>(kWeightRows, n - n0);
      // a partial last block repeats its last weight row; the repeats' results are not written
      const float* w[kWeightRows];
      for (int64_t j = 0; j < kWeightRows; ++j) w[j] = wp + (n0 + std::min<int64_t>(j, width - 1)) * k;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const float* xr[4];
        const int64_t mr = std::min<int64_t>(4, rows - m0);
        for (int64_t m = 0; m < 4; ++m) xr[m] = xp + (m0 + std::min<int64_t>(m, mr - 1)) * ldx;
        float* t = tile + m0 * kWeightRows;
        switch (mr) {
          case 1: block<1>(xr, w, k, t, kWeightRows); break;
          case 2: block<2>(xr, w, k, t, kWeightRows); break;
          case 3: block<3>(xr, w, k, t, kWeightRows); break;
          default: block<4>(xr, w, k, t, kWeightRows); break;
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t j = 0; j < width; ++j) {
          op[m * n + n0 + j] = tile[m * kWeightRows + j] + (bp ? bp[n0 + j] : 0.f);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_linear", torch::kCPU, &small_linear);
}
