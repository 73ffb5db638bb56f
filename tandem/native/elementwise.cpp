// The per-layer elementwise ops of an eager float32 step, one pass and one dispatch each: RMSNorm, SwiGLU's
// silu(gate) * up, and rotary position embedding; and greedy sampling's argmax over the logits' rows. In PyTorch each is 3-10 ops (a norm: pow, mean, add, rsqrt, mul,
// mul; rotary: two gathers, slices, four muls, a sub, an add, a cat), every one a ~5-15 us dispatch at decode sizes
// and a full pass over memory at prompt sizes. vLLM's CPU backend has the same ops in C++ for the same reason.
//
// All three read rows whose last dimension is contiguous (views such as q and k inside a fused qkv output are fine)
// and write a new contiguous tensor. float32 only (the engine's float32 models; bfloat16 keeps the PyTorch path,
// whose roundings match Hugging Face's bf16 ones). Roundings: rotary is the PyTorch formula's exact bits (products
// rounded before the add, no FMA contraction); RMSNorm sums its squares in another order and silu uses its own exp,
// so those two agree with PyTorch to a few float32 ulps.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

constexpr int64_t kGrainElements = 1 << 14;  // elements a thread takes at least: small batches stay on one thread

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

float sum_of_squares(const float* x, int64_t n) {
  f32x16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f32x16 v;
    std::memcpy(&v, x + i, sizeof(v));
    acc += v * v;
  }
  const f32x8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  float sum = (h4[0] + h4[2]) + (h4[1] + h4[3]);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp(x) in float32 to ~1 ulp, 16 lanes: Cephes' expf (x = n ln2 + r with ln2 in two parts, a degree-6 polynomial
// in r, times 2^n built in the exponent bits); n rounds to nearest by the 1.5 * 2^23 trick (|x log2 e| < 2^22).
inline f32x16 exp_f32x16(f32x16 x) {
  const f32x16 zero = {};
  const f32x16 lo = zero - 87.3f, hi = zero + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  f32x16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const f32x16 z = r * r;
  f32x16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * z + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// silu(g) * u over n lanes
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f32x16 gv, uv;
    std::memcpy(&gv, g + i, sizeof(gv));
    std::memcpy(&uv, u + i, sizeof(uv));
    const f32x16 out = gv / (1.0f + exp_f32x16(-gv)) * uv;
    std::memcpy(o + i, &out, sizeof(out));
  }
  if (i < n) {  // the tail through one padded vector
    f32x16 gv = {}, uv = {};
    std::memcpy(&gv, g + i, (n - i) * sizeof(float));
    std::memcpy(&uv, u + i, (n - i) * sizeof(float));
    const f32x16 out = gv / (1.0f + exp_f32x16(-gv)) * uv;
    std::memcpy(o + i, &out, (n - i) * sizeof(float));
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) <= 1 || x.stride(-1) == 1), name, "'s last dimension must be contiguous");
}

// x: [..., H] -> weight * (x * rsqrt(mean(x^2) + eps)), Hugging Face's RMSNorm in float32
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(), "weight must be float32 [", h, "]");
  const at::Tensor rows = x.reshape({-1, h});  // a view where the leading dims allow it
  at::Tensor out = at::empty({rows.size(0), h}, x.options());
  const float* src = rows.data_ptr<float>();
  const int64_t stride = rows.stride(0);
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows.size(0), grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = src + t * stride;
      float* o = dst + t * h;
      const float inv = 1.0f / std::sqrt(sum_of_squares(xr, h) / static_cast<float>(h) + epsf);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = w[i] * (xr[i] * inv);
    }
  });
  return out.view(x.sizes());
}

// gate_up: [..., 2I] ([gate | up]) -> [..., I] = silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even, got ", two_i);
  const int64_t inner = two_i / 2;
  const at::Tensor rows = gate_up.reshape({-1, two_i});
  at::Tensor out = at::empty({rows.size(0), inner}, gate_up.options());
  const float* src = rows.data_ptr<float>();
  const int64_t stride = rows.stride(0);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows.size(0), grain_rows(two_i), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = src + t * stride;
      const float* u = g + inner;
      silu_mul_row(g, u, dst + t * inner, inner);
    }
  });
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = inner;
  return out.view(sizes);
}

// x: [S, V] float32 -> [S] int64, torch.argmax's answer: the first index of the row's maximum, or of its first NaN
// (NaN compares greater than everything there). One vector pass finds the maximum, a second its first index; a
// greedy step's [32, 49152] logits take ~0.1 ms instead of torch's ~1.2 ms (a scalar loop on one thread).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, V] with V > 0, got ", x.sizes());
  const int64_t rows = x.size(0), v = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(v), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = src + t * stride;
      f32x16 mx = f32x16{} - std::numeric_limits<float>::infinity();
      i32x16 nan = {};
      int64_t i = 0;
      for (; i + 16 <= v; i += 16) {
        const f32x16 e = load16(xr + i);
        nan |= e != e;
        mx = e > mx ? e : mx;
      }
      float best = -std::numeric_limits<float>::infinity();
      bool has_nan = false;
      for (int lane = 0; lane < 16; ++lane) {
        has_nan |= nan[lane] != 0;
        best = std::max(best, mx[lane]);
      }
      for (; i < v; ++i) {
        has_nan |= std::isnan(xr[i]);
        best = std::max(best, xr[i]);
      }
      int64_t at = 0;
      if (has_nan) {
        while (!std::isnan(xr[at])) ++at;
      } else {
        while (xr[at] != best) ++at;
      }
      dst[t] = at;
    }
  });
  return out;
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // PyTorch's muls round before its sub/add: no fused multiply-adds here

// x: [T, H, D] (rows and heads may be strided, D contiguous); positions: [T] int64; cos, sin: [P, R / 2] float32.
// Returns a new [T, H, D]: the first R dims of each head rotated by the angle of its token's position (neox halves,
// or interleaved GPT-J pairs), the rest copied.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotary_dim, bool interleaved) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.sizes());
  const int64_t t_count = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t half = rotary_dim / 2;
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= d, "rotary_dim must be even and in (0, ", d,
              "], got ", rotary_dim);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == t_count && positions.scalar_type() == at::kLong &&
                  positions.device().is_cpu(), "positions must be int64 [", t_count, "]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "cos and sin must be contiguous float32 [max_position, ", half, "]");
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t max_position = cos.size(0);
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_position, "position ", p[t], " of token ", t, " is outside [0, ",
                max_position, ")");
  }
  at::Tensor out = at::empty({t_count, heads, d}, x.options());
  const float* src = x.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t_count, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_p + p[t] * half;
      const float* s = sin_p + p[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = src + t * st + h * sh;
        float* o = dst + (t * heads + h) * d;
        if (interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
            const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
            o[2 * i] = a - b;
            o[2 * i + 1] = e + f;
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xr[i], x2 = xr[i + half];
            const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
            o[i] = a - b;
            o[i + half] = e + f;
          }
        }
        for (int64_t i = rotary_dim; i < d; ++i) o[i] = xr[i];
      }
    }
  });
  return out;
}

#pragma GCC pop_options

}  // namespace

namespace tandem_native {
// silu(g) * u over n lanes, for the routed experts' kernel (small_gemm.cpp): one formula for both
void silu_mul(const float* g, const float* u, float* o, int64_t n) { silu_mul_row(g, u, o, n); }
}  // namespace tandem_native

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin, int rotary_dim, bool interleaved) -> Tensor");
  m.impl("rms_norm", torch::kCPU, &rms_norm);
  m.impl("silu_and_mul", torch::kCPU, &silu_and_mul);
  m.impl("rotary", torch::kCPU, &rotary);
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", torch::kCPU, &argmax_rows);
}
