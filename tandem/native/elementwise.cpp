// The per-layer elementwise ops of an eager step, one pass and one dispatch each: RMSNorm (alone, or after the
// residual add it follows), SwiGLU's silu(gate) * up, and rotary position embedding; and greedy sampling's argmax over
// the logits' rows. In PyTorch each is 3-10 ops (a norm: pow, mean, add, rsqrt, mul, mul; rotary: two gathers, slices,
// four muls, a sub, an add, a cat), every one a ~5-15 us dispatch at decode sizes and a full pass over memory at
// prompt sizes. vLLM's CPU backend has the same ops in C++ for the same reason.
//
// They read rows whose last dimension is contiguous (views such as q and k inside a fused qkv output are fine) and
// write new contiguous tensors, in float32 or bfloat16. Roundings: the bfloat16 kernels compute in float32 and round
// to bfloat16 (to nearest even) exactly where Hugging Face's bfloat16 modules do, each PyTorch op rounding its result:
// RMSNorm rounds the normalised row before the weight multiplies it, silu(gate) is rounded before the multiply by up,
// rotary rounds cos, sin and each of its four products. Rotary and the residual add are the PyTorch formulas' exact
// bits in both dtypes (products rounded before the add, no FMA contraction); RMSNorm sums its squares in another
// order and silu uses its own exp, so those two agree with PyTorch to a few float32 ulps before any bf16 rounding.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Vectors of the machine's width: sixteen lanes with avx512, eight elsewhere (GCC lowers a 64-byte vector extension
// type without avx512 through the stack: rms_norm of 2,048 rows x 256 ran 1.9x slower than PyTorch's on an avx2
// machine). Reductions (rms_norm's sum of squares) sum kLanes partial sums, then a tree: a fixed order per machine.
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

constexpr int64_t kGrainElements = 1 << 14;  // elements a thread takes at least: small batches stay on one thread

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));

// Vector and scalar loads and stores of a row's elements as float32: F32 as they lie, BF16 (uint16_t storage) widened
// on load and rounded to nearest even on store; `round` rounds a float32 result to the element type's precision
// (what a PyTorch op on that dtype does to each result).
struct F32 {
  using T = float;
  static vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
  static vf round(vf v) { return v; }
  static float load1(const float* p) { return *p; }
  static void store1(float* p, float v) { *p = v; }
  static float round1(float v) { return v; }
};

struct BF16 {
  using T = uint16_t;
  static vf load(const uint16_t* p) {
    vh h;
    std::memcpy(&h, p, sizeof(h));
    return std::bit_cast<vf>(__builtin_convertvector(h, vu) << 16);
  }
  // float32 bits rounded to nearest even at bit 16; NaN stays a (quiet) NaN, as c10::BFloat16's conversion has it
  static vu rounded_bits(vf v) {
    const vu b = std::bit_cast<vu>(v);
    const vu nan = std::bit_cast<vu>(v != v);
    return (((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u) & ~nan) | (0x7FC00000u & nan);
  }
  static void store(uint16_t* p, vf v) {
    const vh h = __builtin_convertvector(rounded_bits(v) >> 16, vh);
    std::memcpy(p, &h, sizeof(h));
  }
  static vf round(vf v) { return std::bit_cast<vf>(rounded_bits(v)); }
  static float load1(const uint16_t* p) { return std::bit_cast<float>(static_cast<uint32_t>(*p) << 16); }
  static uint16_t bits1(float v) {
    const uint32_t b = std::bit_cast<uint32_t>(v);
    return v != v ? 0x7FC0 : static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  static void store1(uint16_t* p, float v) { *p = bits1(v); }
  static float round1(float v) { return std::bit_cast<float>(static_cast<uint32_t>(bits1(v)) << 16); }
};

// A row's tail (under kLanes elements) through one zero-padded vector
template <typename IO>
inline vf load_tail(const typename IO::T* p, int64_t n) {
  typename IO::T buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(buf[0]));
  return IO::load(buf);
}

template <typename IO>
inline void store_tail(typename IO::T* p, vf v, int64_t n) {
  typename IO::T buf[kLanes];
  IO::store(buf, v);
  std::memcpy(p, buf, n * sizeof(buf[0]));
}

inline float hsum(vf acc) {
#ifdef __AVX512F__
  const f32x8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f32x8 h8 = acc;
#endif
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// exp(x) in float32 to ~1 ulp, kLanes lanes: Cephes' expf (x = n ln2 + r with ln2 in two parts, a degree-6 polynomial
// in r, times 2^n built in the exponent bits); n rounds to nearest by the 1.5 * 2^23 trick (|x log2 e| < 2^22).
inline vf exp_v(vf x) {
  const vf zero = {};
  const vf lo = zero - 87.3f, hi = zero + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const vf z = r * r;
  vf p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * z + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// silu(g) * u over n lanes; bfloat16 rounds silu(g) before the multiply, as F.silu(gate) * up does
template <typename IO>
inline void silu_mul_row(const typename IO::T* g, const typename IO::T* u, typename IO::T* o, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf gv = IO::load(g + i);
    IO::store(o + i, IO::round(gv / (1.0f + exp_v(-gv))) * IO::load(u + i));
  }
  if (i < n) {
    const vf gv = load_tail<IO>(g + i, n - i);
    store_tail<IO>(o + i, IO::round(gv / (1.0f + exp_v(-gv))) * load_tail<IO>(u + i, n - i), n - i);
  }
}

// One row of RMSNorm: o = w * round(x * rsqrt(mean(x^2) + eps)), rounded (Hugging Face's RMSNorm: the normalised
// row is cast back to the input's dtype before the weight multiplies it). With `res`, x is first replaced by
// round(x + res), which is also written to `sum` (the residual stream after the add).
template <typename IO>
inline void rms_norm_row(const typename IO::T* x, const typename IO::T* res, typename IO::T* sum,
                         const typename IO::T* w, typename IO::T* o, int64_t h, float eps) {
  vf acc = {};
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) {
    vf v = IO::load(x + i);
    if (res != nullptr) {
      v = IO::round(v + IO::load(res + i));
      IO::store(sum + i, v);
    }
    acc += v * v;
  }
  float total = hsum(acc);
  for (; i < h; ++i) {
    float v = IO::load1(x + i);
    if (res != nullptr) {
      v = IO::round1(v + IO::load1(res + i));
      IO::store1(sum + i, v);
    }
    total += v * v;
  }
  const float inv = 1.0f / std::sqrt(total / static_cast<float>(h) + eps);
  const typename IO::T* src = res != nullptr ? sum : x;
  i = 0;
  for (; i + kLanes <= h; i += kLanes) IO::store(o + i, IO::load(w + i) * IO::round(IO::load(src + i) * inv));
  for (; i < h; ++i) IO::store1(o + i, IO::load1(w + i) * IO::round1(IO::load1(src + i) * inv));
}

bool is_half_precision(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16; }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) <= 1 || x.stride(-1) == 1), name, "'s last dimension must be contiguous");
}

// Calls fn.template operator()<IO>() with the IO of x's dtype (float32 or bfloat16)
template <typename Fn>
void by_dtype(const at::Tensor& x, Fn&& fn) {
  if (is_half_precision(x)) {
    fn(BF16{});
  } else {
    fn(F32{});
  }
}

template <typename IO>
typename IO::T* ptr(const at::Tensor& t) {
  return reinterpret_cast<typename IO::T*>(t.data_ptr());
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight, int64_t h) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(), "weight must be ", x.scalar_type() == at::kFloat ? "float32" : "bfloat16",
              " [", h, "] (x's dtype)");
}

// x: [..., H] -> weight * (x * rsqrt(mean(x^2) + eps)), Hugging Face's RMSNorm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t h = x.size(-1);
  check_norm_weight(x, weight, h);
  const at::Tensor rows = x.reshape({-1, h});  // a view where the leading dims allow it
  at::Tensor out = at::empty({rows.size(0), h}, x.options());
  const int64_t stride = rows.stride(0);
  by_dtype(x, [&](auto io) {
    using IO = decltype(io);
    const auto* src = ptr<IO>(rows);
    const auto* w = ptr<IO>(weight);
    auto* dst = ptr<IO>(out);
    at::parallel_for(0, rows.size(0), grain_rows(h), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rms_norm_row<IO>(src + t * stride, nullptr, nullptr, w, dst + t * h, h, static_cast<float>(eps));
      }
    });
  });
  return out.view(x.sizes());
}

// x, residual: [T, H] -> (RMSNorm(x + residual), x + residual): a decoder layer's residual add and the norm after
// it in one pass over the rows (vLLM's fused_add_rms_norm, but out of place: both results are new tensors)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "x and residual must be [tokens, hidden] of one dtype, got ", x.sizes(), " and ", residual.sizes());
  const int64_t h = x.size(1), t_count = x.size(0);
  check_norm_weight(x, weight, h);
  at::Tensor out = at::empty({t_count, h}, x.options());
  at::Tensor sum = at::empty({t_count, h}, x.options());
  by_dtype(x, [&](auto io) {
    using IO = decltype(io);
    const auto* xs = ptr<IO>(x);
    const auto* rs = ptr<IO>(residual);
    const auto* w = ptr<IO>(weight);
    auto* o = ptr<IO>(out);
    auto* s = ptr<IO>(sum);
    const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
    at::parallel_for(0, t_count, grain_rows(h), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rms_norm_row<IO>(xs + t * x_stride, rs + t * r_stride, s + t * h, w, o + t * h, h, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// gate_up: [..., 2I] ([gate | up]) -> [..., I] = silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even, got ", two_i);
  const int64_t inner = two_i / 2;
  const at::Tensor rows = gate_up.reshape({-1, two_i});
  at::Tensor out = at::empty({rows.size(0), inner}, gate_up.options());
  const int64_t stride = rows.stride(0);
  by_dtype(gate_up, [&](auto io) {
    using IO = decltype(io);
    const auto* src = ptr<IO>(rows);
    auto* dst = ptr<IO>(out);
    at::parallel_for(0, rows.size(0), grain_rows(two_i), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto* g = src + t * stride;
        silu_mul_row<IO>(g, g + inner, dst + t * inner, inner);
      }
    });
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
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 logits");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, V] with V > 0, got ", x.sizes());
  const int64_t rows = x.size(0), v = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(v), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = src + t * stride;
      vf mx = vf{} - std::numeric_limits<float>::infinity();
      vi nan = {};
      int64_t i = 0;
      for (; i + kLanes <= v; i += kLanes) {
        const vf e = F32::load(xr + i);
        nan |= e != e;
        mx = e > mx ? e : mx;
      }
      float best = -std::numeric_limits<float>::infinity();
      bool has_nan = false;
      for (int lane = 0; lane < kLanes; ++lane) {
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

// One head's rotation: the first R dims by the angles whose cos and sin (float32 tables, rounded to the element type
// first, as Hugging Face casts them to the activations' dtype) are c and s; each product rounded before the sub/add
template <typename IO>
inline void rotate_head(const typename IO::T* xr, typename IO::T* o, const float* c, const float* s, int64_t half,
                        int64_t rotary_dim, int64_t d, bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = IO::load1(xr + 2 * i), x2 = IO::load1(xr + 2 * i + 1);
      const float ci = IO::round1(c[i]), si = IO::round1(s[i]);
      IO::store1(o + 2 * i, IO::round1(x1 * ci) - IO::round1(x2 * si));
      IO::store1(o + 2 * i + 1, IO::round1(x2 * ci) + IO::round1(x1 * si));
    }
  } else {
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const vf x1 = IO::load(xr + i), x2 = IO::load(xr + i + half);
      const vf ci = IO::round(F32::load(c + i)), si = IO::round(F32::load(s + i));
      IO::store(o + i, IO::round(x1 * ci) - IO::round(x2 * si));
      IO::store(o + i + half, IO::round(x2 * ci) + IO::round(x1 * si));
    }
    for (; i < half; ++i) {
      const float x1 = IO::load1(xr + i), x2 = IO::load1(xr + i + half);
      const float ci = IO::round1(c[i]), si = IO::round1(s[i]);
      IO::store1(o + i, IO::round1(x1 * ci) - IO::round1(x2 * si));
      IO::store1(o + i + half, IO::round1(x2 * ci) + IO::round1(x1 * si));
    }
  }
  if (d > rotary_dim) std::memcpy(o + rotary_dim, xr + rotary_dim, (d - rotary_dim) * sizeof(xr[0]));
}

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
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  by_dtype(x, [&](auto io) {
    using IO = decltype(io);
    const auto* src = ptr<IO>(x);
    auto* dst = ptr<IO>(out);
    at::parallel_for(0, t_count, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          rotate_head<IO>(src + t * st + h * sh, dst + (t * heads + h) * d, cos_p + p[t] * half,
                          sin_p + p[t] * half, half, rotary_dim, d, interleaved);
        }
      }
    });
  });
  return out;
}

#pragma GCC pop_options

}  // namespace

namespace tandem_native {
// silu(g) * u over n lanes, for the routed experts' kernel (small_gemm.cpp): one formula for both
void silu_mul(const float* g, const float* u, float* o, int64_t n) { silu_mul_row<F32>(g, u, o, n); }
// the ops themselves, for the fused decoder layer (decoder_layer.cpp): a direct call, not a dispatch
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return ::add_rms_norm(x, residual, weight, eps);
}
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return ::silu_and_mul(gate_up); }
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotary_dim, bool interleaved) {
  return ::rotary(x, positions, cos, sin, rotary_dim, interleaved);
}
}  // namespace tandem_native

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", torch::kCPU, &add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin, int rotary_dim, bool interleaved) -> Tensor");
  m.impl("rms_norm", torch::kCPU, &rms_norm);
  m.impl("silu_and_mul", torch::kCPU, &silu_and_mul);
  m.impl("rotary", torch::kCPU, &rotary);
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", torch::kCPU, &argmax_rows);
}
