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
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t kMaxRows = 16;            // rows of x the kernel takes (the caller checks SMALL_GEMM_ROWS)
constexpr int64_t kWeightRows = 4;          // weight rows a pass streams together
constexpr int64_t kGrainElements = 1 << 16;  // multiply-adds / 4 a thread takes at least: small GEMMs stay on one

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

// block<> for mr = 1..4 rows of x, the tile's rows kWeightRows apart
inline void block_rows(int64_t mr, const float* const* x, const float* const* w, int64_t k, float* tile) {
  switch (mr) {
    case 1: block<1>(x, w, k, tile, kWeightRows); break;
    case 2: block<2>(x, w, k, tile, kWeightRows); break;
    case 3: block<3>(x, w, k, tile, kWeightRows); break;
    default: block<4>(x, w, k, tile, kWeightRows); break;
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
        block_rows(mr, xr, w, k, t);
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
      const float* w[kWeightRows];
      for (int64_t j = 0; j < kWeightRows; ++j) w[j] = weight + (e * n + n0 + std::min<int64_t>(j, width - 1)) * k;
      for (int64_t p0 = first[e]; p0 < first[e + 1]; p0 += 4) {
        const int64_t mr = std::min<int64_t>(4, first[e + 1] - p0);
        const float* xr[4];
        for (int64_t m = 0; m < 4; ++m) xr[m] = rows[p0 + std::min<int64_t>(m, mr - 1)];
        block_rows(mr, xr, w, k, tile);
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
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, int expert_start) -> Tensor");
  m.impl("moe_experts", torch::kCPU, &moe_experts);
}
