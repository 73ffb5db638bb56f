// Paged attention for short rows (decodes, verification rows) on the CPU, reading each row's keys and values in
// place through its block table: no gathered copy of the prefix, no padding, no mask tensor.
//
// Rows: int32 [R, 5] = (block-table row, first query token, number of queries, seq_len, first key position).
// Query token t of a row sees the keys at positions [key_start, min(positions[t] + 1, seq_len)): causality from
// positions, as the padded path's mask has it (a PCP piece's positions need not be consecutive).
//
// Work is split over (row, key chunk): each task reads its chunk's key slots once (every KV head of a slot lies side
// by side) and scores them against every query head of every query of the row, keeps each query's max, sum and
// weighted values over the chunk, and a second pass merges the chunks by log-sum-exp (flash-decoding), so a single
// long row still spreads over every thread.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "amx_tiles.h"  // amx_ready(), on every build
#include "attention_amx.h"
#include "attention_bf16.h"
#include "vec16.h"

namespace {

constexpr int64_t kMaxChunk = 512;  // keys a task scores at most
constexpr int64_t kMinChunk = 64;   // ... and at least, unless the row has fewer
constexpr int64_t kPrefetchBytes = 256 << 10;  // a task's keys and values prefetched up front, at most
constexpr int64_t kWideKey = 128;  // key widths above it score keys-outer (L1 reuse across queries)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// rows of at least this many queries (prompt rows) run on AMX tiles where isa is 2: past any verification row of
// K <= 31 drafts, whose queries must give their decodes' bits (the dot-product path's)
constexpr int64_t kAmxMinQueries = 33;
constexpr float kLog2e = 1.44269504088896341f;
constexpr int64_t kSerialPairs = 8192;  // (query head, key) pairs below which a call runs on one thread

#ifdef __AVX512F__
const bool kHasBf16Dot = __builtin_cpu_supports("avx512bf16");
#else
const bool kHasBf16Dot = false;
#endif

// A key or value row as float32: the cache row itself for float32, else converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

template <>
inline const float* as_float<at::BFloat16>(const at::BFloat16* src, float* buf, int64_t n) {
  widen_bf16(reinterpret_cast<const uint16_t*>(src), buf, n);
  return buf;
}

// float8 (kv_cache_dtype fp8_e4m3 / fp8_e5m2): each of the 256 codes' float32 value looked up, the cache's bytes
// converted in the task's buffer as bfloat16's are (a saturated store never holds an inf or nan code)
template <typename F8>
const float* fp8_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    return t;
  }();
  return table.data();
}

template <typename F8>
inline const float* fp8_as_float(const F8* src, float* buf, int64_t n) {
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
  const float* table = fp8_values<F8>();
  int64_t i = 0;
#ifdef __AVX512F__
  // 16 codes at a time through float16 (the table's one-at-a-time loads cost fp8 ~1.25x bf16's decode at 32k keys):
  // e5m2 is float16's upper byte; e4m3 moved into float16's exponent and mantissa fields is the value / 2^8
  // (exponent bias 7 vs 15; subnormals included), so a shift, the hardware float16 -> float32 and one multiply
  constexpr bool e5m2 = std::is_same_v<F8, c10::Float8_e5m2>;
  const __m512 unbias = _mm512_set1_ps(e5m2 ? 1.0f : 256.0f);
  for (; i + 16 <= n; i += 16) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    __m256i h = e5m2 ? _mm256_slli_epi16(w, 8)
                     : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    _mm512_storeu_ps(buf + i, _mm512_mul_ps(_mm512_cvtph_ps(h), unbias));
  }
#endif
  for (; i < n; ++i) buf[i] = table[s[i]];
  return buf;
}

template <>
inline const float* as_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* buf, int64_t n) {
  return fp8_as_float(src, buf, n);
}

template <>
inline const float* as_float<c10::Float8_e5m2>(const c10::Float8_e5m2* src, float* buf, int64_t n) {
  return fp8_as_float(src, buf, n);
}

// One vector accumulator and a tree sum at the end: the compiler's own simd reduction sums its lanes one by one
// through memory (16 dependent adds a dot, most of a decode's scoring time).
inline float dot(const float* a, const float* b, int64_t n) {
  f32x16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// One query against four keys: four independent accumulators (one dot's chain of dependent FMAs leaves the FMA
// units idle most cycles) and the query's vectors loaded once for all four.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t n,
                 float* out) {
  f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 x = load16(q + i);
    a0 += x * load16(k0 + i);
    a1 += x * load16(k1 + i);
    a2 += x * load16(k2 + i);
    a3 += x * load16(k3 + i);
  }
  out[0] = hsum(a0);
  out[1] = hsum(a1);
  out[2] = hsum(a2);
  out[3] = hsum(a3);
  for (; i < n; ++i) {
    out[0] += q[i] * k0[i];
    out[1] += q[i] * k1[i];
    out[2] += q[i] * k2[i];
    out[3] += q[i] * k3[i];
  }
}

#ifdef __AVX512F__
constexpr bool kBlock4x4 = true;  // 16 accumulators + the 4 keys and a query fit avx512's 32 vector registers
#else
constexpr bool kBlock4x4 = false;  // (avx2's 16 would spill them)
#endif

// Four queries (q, q + q_stride, ...) against four keys: 16 accumulators, so each loaded vector feeds four FMAs
// (dot4 feeds 4 FMAs from 5 loads, and the loads, not the FMAs, bound it). out[i * out_stride + e] = q_i . k_e:
// each the same sum in the same order as dot4's, so the two give the same bits.
inline void dot4x4(const float* q, int64_t q_stride, const float* k0, const float* k1, const float* k2,
                   const float* k3, int64_t n, float* out, int64_t out_stride) {
  f32x16 a[4][4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 y0 = load16(k0 + i), y1 = load16(k1 + i), y2 = load16(k2 + i), y3 = load16(k3 + i);
#pragma GCC unroll 4
    for (int64_t r = 0; r < 4; ++r) {
      const f32x16 x = load16(q + r * q_stride + i);
      a[r][0] += x * y0;
      a[r][1] += x * y1;
      a[r][2] += x * y2;
      a[r][3] += x * y3;
    }
  }
  for (int64_t r = 0; r < 4; ++r) {
    float* o = out + r * out_stride;
    const float* qr = q + r * q_stride;
    o[0] = hsum(a[r][0]);
    o[1] = hsum(a[r][1]);
    o[2] = hsum(a[r][2]);
    o[3] = hsum(a[r][3]);
    for (int64_t t = i; t < n; ++t) {
      o[0] += qr[t] * k0[t];
      o[1] += qr[t] * k1[t];
      o[2] += qr[t] * k2[t];
      o[3] += qr[t] * k3[t];
    }
  }
}

// weighted_cols' 64-column case for four queries' probabilities (p, p + p_stride, ...) over the same values, each
// value row loaded once for all four; acc + r * acc_stride is query r's output row. Every query runs all w keys, so
// a query that sees fewer keys needs its probabilities past its width zeroed (0 * a finite value adds exactly 0:
// the same bits as weighted_cols over its own width).
inline void weighted_cols4(const float* p, int64_t p_stride, const float* base, const int64_t* off, int64_t w,
                           int64_t d, float* acc, int64_t acc_stride) {
#ifdef __AVX512F__
  f32x16 a[4][4] = {};
  for (int64_t s = 0; s < w; ++s) {
    const float* v = base + off[s] + d;
    const f32x16 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
#pragma GCC unroll 4
    for (int64_t r = 0; r < 4; ++r) {
      const f32x16 ps = splat16(p[r * p_stride + s]);
      a[r][0] += ps * v0;
      a[r][1] += ps * v1;
      a[r][2] += ps * v2;
      a[r][3] += ps * v3;
    }
  }
  for (int64_t r = 0; r < 4; ++r) std::memcpy(acc + r * acc_stride + d, &a[r][0], sizeof(a[r]));
#else
  // avx2's 16 registers hold four queries' sums of 16 columns (8), the values (2) and a probability: the 64
  // columns in four passes over the keys, each value line still read once for all four queries
  for (int64_t c = d; c < d + 64; c += 16) {
    f32x16 a[4] = {};
    for (int64_t s = 0; s < w; ++s) {
      const f32x16 v = load16(base + off[s] + c);
#pragma GCC unroll 4
      for (int64_t r = 0; r < 4; ++r) a[r] += splat16(p[r * p_stride + s]) * v;
    }
    for (int64_t r = 0; r < 4; ++r) std::memcpy(acc + r * acc_stride + c, &a[r], sizeof(a[r]));
  }
#endif
}

// acc[d:d + cols] = sum_s p[s] * (base + off[s])[d:d + cols], cols = 64, 16 or a tail under 16: the output block
// held in registers while the keys stream past (an axpy per key would store and reload the output for every key)
inline void weighted_cols(const float* p, const float* base, const int64_t* off, int64_t w, int64_t d,
                          int64_t cols, float* acc) {
  if (cols == 64) {
    f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t s = 0; s < w; ++s) {
      const float* v = base + off[s] + d;
      const f32x16 ps = splat16(p[s]);
      a0 += ps * load16(v);
      a1 += ps * load16(v + 16);
      a2 += ps * load16(v + 32);
      a3 += ps * load16(v + 48);
    }
    std::memcpy(acc + d, &a0, sizeof(a0));
    std::memcpy(acc + d + 16, &a1, sizeof(a1));
    std::memcpy(acc + d + 32, &a2, sizeof(a2));
    std::memcpy(acc + d + 48, &a3, sizeof(a3));
  } else if (cols == 16) {
    f32x16 a0 = {};
    for (int64_t s = 0; s < w; ++s) a0 += splat16(p[s]) * load16(base + off[s] + d);
    std::memcpy(acc + d, &a0, sizeof(a0));
  } else {
    for (int64_t c = d; c < d + cols; ++c) {
      float a = 0.f;
      for (int64_t s = 0; s < w; ++s) a += p[s] * base[off[s] + c];
      acc[c] = a;
    }
  }
}

// max(x[0..n)), n >= 1, of finite or -inf scores: sixteen running maxima (one scalar max a score is a chain of
// dependent instructions: ~10% of a bf16 decode call)
inline float max_of(const float* x, int64_t n) {
  float lanes[16];
  std::fill(lanes, lanes + 16, kNegInf);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma omp simd
    for (int64_t e = 0; e < 16; ++e) lanes[e] = lanes[e] > x[i + e] ? lanes[e] : x[i + e];
  }
  float mx = kNegInf;
  for (int64_t e = 0; e < 16; ++e) mx = std::max(mx, lanes[e]);
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// x[i] <- exp(x[i] - mx) for finite x[i] <= mx; returns their sum. exp as 2^n * 2^f, f in [-1/2, 1/2], 2^f by
// Cephes' exp2f polynomial (relative error ~1e-7): a loop the compiler vectorizes, where libm's expf is a call a
// score (a decode step at 32 rows x 9 heads x 1k keys scores 288k).
inline float exp_sum(float* x, int64_t n, float mx) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    float y = std::max((x[i] - mx) * 1.44269504088896341f, -126.f);
    const float k = std::nearbyint(y);
    const float f = y - k;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = p * scale;
    sum += x[i];
  }
  return sum;
}

// T: the queries' and outputs' dtype (the model's); KV: the cache's (kv_cache_dtype), T itself or narrower
// A task's queries' outputs (acc / l) and LSEs, when the row is one chunk
template <typename T>
void write_task(T* op, float* lp, int64_t t0, int64_t n, int64_t hq, int64_t dv, int64_t o_tok, int64_t o_head,
                const float* m, const float* l, const float* acc) {
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = h * n + i;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
      T* o = op + (t0 + i) * o_tok + h * o_head;
      for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<T>(acc[j * dv + d] * inv);
      lp[(t0 + i) * hq + h] = l[j] > 0.f ? m[j] + std::log(l[j]) : kNegInf;
    }
  }
}

#ifdef __AVX512F__
// One task (a row's chunk of `width` keys, slot_of(s) the s-th key's slot) on bf16 queries over a bf16 cache, with
// attention_bf16.h's loops: each query's max score m, sum of exponentials l and weighted values acc (query head h's
// query i at h * n + i, as the widening path keeps them). q: the row's first query token.
template <typename SlotOf>
void dot_task(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* kp, const uint16_t* vp,
              int64_t k_head, int64_t v_head, int64_t k_slot, int64_t v_slot, const SlotOf& slot_of, int64_t width,
              const int64_t* width_of, int64_t n, int64_t hq, int64_t hkv, int64_t dk, int64_t dv, float scale,
              int64_t chunk, float* m, float* l, float* acc) {
  namespace ba = bf16_attention;
  thread_local std::vector<float> tl_scores;
  thread_local std::vector<uint16_t> tl_probs;
  thread_local std::vector<int64_t> tl_koff, tl_voff;
  const int64_t stride = (chunk + 31) / 32 * 32;  // a query's scores and probabilities, padded for 16-key blocks
  const int64_t nq = hq * n, r = hq / hkv;
  if (static_cast<int64_t>(tl_scores.size()) < nq * stride) tl_scores.resize(nq * stride);
  if (static_cast<int64_t>(tl_probs.size()) < nq * stride) tl_probs.resize(nq * stride);
  if (static_cast<int64_t>(tl_koff.size()) < chunk) tl_koff.resize(chunk), tl_voff.resize(chunk);
  float* scores = tl_scores.data();
  uint16_t* probs = tl_probs.data();
  int64_t* koff = tl_koff.data();
  int64_t* voff = tl_voff.data();
  const int64_t k_bytes = ((hkv - 1) * k_head + dk) * 2, v_bytes = ((hkv - 1) * v_head + dv) * 2;
  const bool prefetch = width * (k_bytes + v_bytes) <= kPrefetchBytes;
  for (int64_t s = 0; s < width; ++s) {
    const int64_t slot = slot_of(s);
    koff[s] = slot * k_slot;
    voff[s] = slot * v_slot;
    if (prefetch) {  // every line of the chunk asked for up front, as the float32 path does
      const char* kr = reinterpret_cast<const char*>(kp + koff[s]);
      const char* vr = reinterpret_cast<const char*>(vp + voff[s]);
      for (int64_t b = 0; b < k_bytes; b += 64) __builtin_prefetch(kr + b);
      for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(vr + b);
    }
  }
  for (int64_t g = 0; g < hkv; ++g) {
    const int64_t j0 = g * r * n, j1 = (g + 1) * r * n;
    int64_t wg = 0;  // keys any query of the group sees
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t w = width_of[j];
      wg = std::max(wg, w);
      if (w == 0) continue;  // no key of this chunk is visible to this query: m, l, acc stay as filled
      const int64_t h = j / n, i = j % n;
      float* sj = scores + j * stride;
      ba::score_keys(q + i * q_tok + h * q_head, kp + g * k_head, koff, w, dk, scale, sj);
      m[j] = ba::max_of(sj, w);
      l[j] = ba::exp_sum(sj, w, m[j], kLog2e, probs + j * stride);
    }
    if (wg == 0) continue;
    const int64_t padded = (wg + 1) / 2 * 2;  // pairs of keys: a zero probability past each query's width
    for (int64_t j = j0; j < j1; ++j) std::fill(probs + j * stride + width_of[j], probs + j * stride + padded, 0);
    for (int64_t j = j0; j < j1; j += 4) {
      const int64_t nb = std::min<int64_t>(4, j1 - j);
      const uint16_t* p[4];
      float* a[4];
      int64_t wb = 0;  // keys any query of the four sees (a row's consecutive queries of one head: causal widths)
      for (int64_t e = 0; e < nb; ++e) {
        p[e] = probs + (j + e) * stride, a[e] = acc + (j + e) * dv;
        wb = std::max(wb, width_of[j + e]);
      }
      ba::weigh_values_any(nb, p, vp + g * v_head, voff, wb, dv, a);
    }
  }
}
#endif

#ifdef __AVX512F__
// dot_task for a row of kAmxMinQueries or more queries on AMX tiles (attention_amx.h): the group's keys and values laid out as
// B tiles once, each query head's queries 16 at a time against them. Same outputs (m, l, acc) as dot_task.
template <typename SlotOf>
void amx_task(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint16_t* kp, const uint16_t* vp,
              int64_t k_head, int64_t v_head, int64_t k_slot, int64_t v_slot, const SlotOf& slot_of, int64_t width,
              const int64_t* width_of, int64_t n, int64_t hq, int64_t hkv, int64_t dk, int64_t dv, float scale,
              float* m, float* l, float* acc) {
  namespace ma = amx_attention;
  amx::configure();
  const int64_t r = hq / hkv, dkp = (dk + 31) / 32 * 32, key_blocks = (width + 15) / 16;
  const int64_t value_blocks = (width + 31) / 32, chunks = (dv + 15) / 16, stride = value_blocks * 32;
  thread_local std::vector<int64_t> tl_koff, tl_voff;
  thread_local std::vector<uint32_t> tl_keys;
  thread_local std::vector<uint16_t> tl_values, tl_q, tl_probs;
  thread_local std::vector<float> tl_scores, tl_out;
  auto grow = [](auto& vec, int64_t size) {
    if (static_cast<int64_t>(vec.size()) < size) vec.resize(size);
    return vec.data();
  };
  int64_t* koff = grow(tl_koff, width);
  int64_t* voff = grow(tl_voff, width);
  uint32_t* keys = grow(tl_keys, key_blocks * (dkp / 32) * 256);
  uint16_t* values = grow(tl_values, value_blocks * chunks * 512);
  uint16_t* qbuf = grow(tl_q, 16 * dkp);
  uint16_t* probs = grow(tl_probs, 16 * stride);
  float* scores = grow(tl_scores, 16 * stride);
  float* obuf = grow(tl_out, 16 * 64);
  for (int64_t s = 0; s < width; ++s) {
    const int64_t slot = slot_of(s);
    koff[s] = slot * k_slot;
    voff[s] = slot * v_slot;
  }
  for (int64_t g = 0; g < hkv; ++g) {
    for (int64_t b = 0; b < key_blocks; ++b) {
      ma::keys_as_b(kp + g * k_head, koff + b * 16, std::min<int64_t>(16, width - b * 16), dk,
                    keys + b * (dkp / 32) * 256);
    }
    for (int64_t b = 0; b < value_blocks; ++b) {
      ma::values_as_b(vp + g * v_head, voff + b * 32, std::min<int64_t>(32, width - b * 32), dv,
                      values + b * chunks * 512);
    }
    for (int64_t h = g * r; h < (g + 1) * r; ++h) {
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t rows = std::min<int64_t>(16, n - i0);
        std::memset(qbuf, 0, 16 * dkp * sizeof(uint16_t));
        int64_t wq = 0;  // keys any of the 16 queries sees
        for (int64_t i = 0; i < rows; ++i) {
          std::memcpy(qbuf + i * dkp, q + (i0 + i) * q_tok + h * q_head, dk * sizeof(uint16_t));
          wq = std::max(wq, width_of[h * n + i0 + i]);
        }
        if (wq == 0) continue;  // m, l, acc stay as filled
        for (int64_t b = 0; b < (wq + 15) / 16; ++b) {
          ma::score_block(qbuf, dkp, keys + b * (dkp / 32) * 256, scores + b * 16, stride * sizeof(float));
        }
        const int64_t padded = (wq + 31) / 32 * 32;
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t w = i < rows ? width_of[h * n + i0 + i] : 0;
          float* si = scores + i * stride;
          if (w > 0) {  // unscaled scores: the scale goes into the exponent
            const int64_t j = h * n + i0 + i;
            const float mx = bf16_attention::max_of(si, w);
            m[j] = mx * scale;
            l[j] = bf16_attention::exp_sum(si, w, mx, scale * kLog2e, probs + i * stride);
          }
          std::fill(probs + i * stride + w, probs + i * stride + padded, 0);
        }
        for (int64_t t0 = 0; t0 < chunks; t0 += 4) {
          const int64_t nt = std::min<int64_t>(4, chunks - t0);
          ma::weigh_block(probs, stride, values, padded / 32, chunks, t0, nt, obuf, 64 * sizeof(float));
          const int64_t d0 = t0 * 16, cols = std::min<int64_t>(nt * 16, dv - d0);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t j = h * n + i0 + i;
            if (width_of[j] > 0) std::memcpy(acc + j * dv + d0, obuf + i * 64, cols * sizeof(float));
          }
        }
      }
    }
  }
  amx::release();
}
#endif

// isa (bfloat16 over a bfloat16 cache): 1 runs attention_bf16.h's avx512_bf16 loops, 2 also attention_amx.h's
// tiles for rows of kAmxMinQueries or more, 0 the widening path
template <typename T, typename KV>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& block_table,
         const torch::Tensor& rows, const torch::Tensor& positions, int64_t block_size, double scale,
         torch::Tensor& out, torch::Tensor& lse, int64_t isa) {
  const int64_t num_rows = rows.size(0);
  const int64_t hq = q.size(1), dk = q.size(2), hkv = k.size(1), dv = v.size(2);
  const bool bf16_dot = isa >= 1, amx_rows = isa == 2;
  const int64_t r = hq / hkv;
  const int32_t* rw = rows.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const KV* kp = reinterpret_cast<const KV*>(k.data_ptr());
  const KV* vp = reinterpret_cast<const KV*>(v.data_ptr());
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1), o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t k_slot = k.stride(0), k_head = k.stride(1), v_slot = v.stride(0), v_head = v.stride(1);
  const float fscale = static_cast<float>(scale);

  int64_t max_q = 1, max_keys = 1, pairs = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    max_q = std::max<int64_t>(max_q, rw[5 * i + 2]);
    max_keys = std::max<int64_t>(max_keys, rw[5 * i + 3] - rw[5 * i + 4]);
    pairs += rw[5 * i + 2] * std::max<int64_t>(0, rw[5 * i + 3] - rw[5 * i + 4]) * hq;
  }
  // a call this small runs on the calling thread: waking the others cost more than its work (a batch-1 decode at
  // SmolLM2's shapes, ~720 (query, key) pairs, 20 us a call in parallel). Threads only: the chunks, and so the bits,
  // are the same either way.
  const bool serial = pairs < kSerialPairs;
  // enough tasks for every thread (a long row split into chunks, merged after), no chunk past kMaxChunk
  const int64_t want = (4 * at::get_num_threads() + num_rows - 1) / num_rows;
  const int64_t chunk = std::min(kMaxChunk, std::max(kMinChunk, (max_keys + want - 1) / want));
  // tasks: row i's chunks are tasks first_task[i] .. first_task[i + 1] - 1; only a row of several chunks keeps
  // partial results (each query's max, sum and weighted values per chunk), from part_at[i] on
  std::vector<int64_t> first_task(num_rows + 1, 0), part_at(num_rows, 0);
  // a prompt row on AMX tiles is split by its queries instead (qblock[i] of them a task, every key they see, no
  // merge): its keys' tile layout is cheap next to its scores, and each query's softmax stays whole (the same bits
  // however the row is split)
  std::vector<int64_t> qblock(num_rows, 0);
  bool amx_split = false;
#ifdef __AVX512F__
  amx_split = std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16> && bf16_dot && amx_rows;
#endif
  int64_t parts = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    if (const int64_t n = rw[5 * i + 2]; amx_split && n >= kAmxMinQueries) {
      const int64_t blocks = std::min((n + 15) / 16, (8 * at::get_num_threads() + num_rows - 1) / num_rows);
      qblock[i] = ((n + blocks - 1) / blocks + 15) / 16 * 16;
      first_task[i + 1] = first_task[i] + (n + qblock[i] - 1) / qblock[i];
      continue;
    }
    const int64_t chunks = std::max<int64_t>(1, (rw[5 * i + 3] - rw[5 * i + 4] + chunk - 1) / chunk);
    first_task[i + 1] = first_task[i] + chunks;
    part_at[i] = parts;
    if (chunks > 1) parts += chunks * hq * rw[5 * i + 2];
  }
  const int64_t tasks = first_task[num_rows];
  std::vector<float> part_m(parts), part_l(parts), part_acc(parts * dv);
  const int64_t qrows = hq * max_q;  // query vectors of a row: head h's query i at h * n + i

  // Tasks are handed out one at a time from a shared counter rather than in contiguous ranges: a long causal row's
  // first key chunk is seen by all its queries and its last by few, so a contiguous split of its chunks gave one
  // thread ~70% of the work. Which thread runs a task does not change its result.
  std::atomic<int64_t> next_task{0};
  const int64_t workers = serial ? 1 : std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // per thread, reused across calls (sized by the largest call seen), read through plain pointers: a
    // thread_local looked up in the loops would cost a TLS call per access in a shared library
    thread_local std::vector<float> tl_qf, tl_kf, tl_vf, tl_scores, tl_m, tl_l, tl_acc;
    thread_local std::vector<int64_t> tl_width, tl_koff, tl_voff;
    auto grow = [](auto& vec, int64_t size) {
      if (static_cast<int64_t>(vec.size()) < size) vec.resize(size);
      return vec.data();
    };
    float* qf = grow(tl_qf, qrows * dk);
    float* scores = grow(tl_scores, qrows * chunk);
    float* m_buf = grow(tl_m, qrows);
    float* l_buf = grow(tl_l, qrows);
    float* acc_buf = grow(tl_acc, qrows * dv);
    int64_t* width_of = grow(tl_width, qrows);
    for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t row = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t c = task - first_task[row], chunks = first_task[row + 1] - first_task[row];
      const int32_t* rr = rw + 5 * row;
#ifdef __AVX512F__
      if (qblock[row] > 0) {  // amx_split's rows: the row's last (causal: widest) query blocks first
        const int64_t t0 = rr[1], seq_len = rr[3], key_start = rr[4];
        const int64_t i0 = (chunks - 1 - c) * qblock[row], nb = std::min<int64_t>(qblock[row], rr[2] - i0);
        const int32_t* blocks = table + rr[0] * table_stride;
        int64_t width = 0;
        for (int64_t h = 0; h < hq; ++h) {
          for (int64_t i = 0; i < nb; ++i) {
            width_of[h * nb + i] = std::clamp<int64_t>(std::min<int64_t>(pos[t0 + i0 + i] + 1, seq_len) - key_start,
                                                       0, std::max<int64_t>(seq_len - key_start, 0));
            width = std::max(width, width_of[h * nb + i]);
          }
        }
        std::fill(m_buf, m_buf + hq * nb, kNegInf);
        std::fill(l_buf, l_buf + hq * nb, 0.f);
        std::fill(acc_buf, acc_buf + hq * nb * dv, 0.f);
        auto slot_of = [&](int64_t s) {
          const int64_t p = key_start + s;
          return static_cast<int64_t>(blocks[p / block_size]) * block_size + p % block_size;
        };
        amx_task(reinterpret_cast<const uint16_t*>(qp) + (t0 + i0) * q_tok, q_tok, q_head,
                 reinterpret_cast<const uint16_t*>(kp), reinterpret_cast<const uint16_t*>(vp), k_head, v_head, k_slot,
                 v_slot, slot_of, width, width_of, nb, hq, hkv, dk, dv, fscale, m_buf, l_buf, acc_buf);
        write_task(op, lp, t0 + i0, nb, hq, dv, o_tok, o_head, m_buf, l_buf, acc_buf);
        continue;
      }
#endif
      const int64_t t0 = rr[1], n = rr[2], seq_len = rr[3], key_start = rr[4];
      const int32_t* blocks = table + rr[0] * table_stride;
      const int64_t lo = key_start + c * chunk, hi = std::min<int64_t>(seq_len, lo + chunk);
      const int64_t nq = hq * n;
      const bool split = chunks > 1;
      float* m = split ? part_m.data() + part_at[row] + c * nq : m_buf;
      float* l = split ? part_l.data() + part_at[row] + c * nq : l_buf;
      float* acc = split ? part_acc.data() + (part_at[row] + c * nq) * dv : acc_buf;
      std::fill(m, m + nq, kNegInf);
      std::fill(l, l + nq, 0.f);
      std::fill(acc, acc + nq * dv, 0.f);
      int64_t width = 0;  // keys of the chunk that any query sees
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          // causal: query i sees the keys up to its own position
          const int64_t w = std::clamp<int64_t>(std::min<int64_t>(pos[t0 + i] + 1, seq_len) - lo, 0,
                                                std::max<int64_t>(hi - lo, 0));
          width_of[h * n + i] = w;
          width = std::max(width, w);
        }
      }
      int64_t* koff = grow(tl_koff, chunk);  // each key's slot as an element offset into kbase and into vbase
      int64_t* voff = grow(tl_voff, chunk);
      auto slot_of = [&](int64_t s) {
        const int64_t p = lo + s;
        return static_cast<int64_t>(blocks[p / block_size]) * block_size + p % block_size;
      };
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
        if (bf16_dot) {
          dot_task(reinterpret_cast<const uint16_t*>(qp) + t0 * q_tok, q_tok, q_head,
                   reinterpret_cast<const uint16_t*>(kp), reinterpret_cast<const uint16_t*>(vp), k_head, v_head,
                   k_slot, v_slot, slot_of, width, width_of, n, hq, hkv, dk, dv, fscale, chunk, m, l, acc);
          if (!split) write_task(op, lp, t0, n, hq, dv, o_tok, o_head, m, l, acc);
          continue;
        }
      }
#endif
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          float* dst = qf + (h * n + i) * dk;
          const float* src = as_float(qp + (t0 + i) * q_tok + h * q_head, dst, dk);
          if (src != dst) std::memcpy(dst, src, dk * sizeof(float));
        }
      }
      // The chunk's keys and values as float32: a float32 cache read in place; another dtype's (bfloat16, float8) converted
      // once a task into per-thread buffers [width, Hkv, D], so both run the same blocked scoring and weighting
      // (converting a key per (key, head) and scoring it query by query cost bf16 1.6x float32's time a prompt)
      const float* kbase;
      const float* vbase;
      int64_t kh, vh;
      if constexpr (std::is_same_v<KV, float>) {
        kbase = kp, vbase = vp, kh = k_head, vh = v_head;
        for (int64_t s = 0; s < width; ++s) {
          koff[s] = slot_of(s) * k_slot;
          voff[s] = slot_of(s) * v_slot;
        }
        // Narrow heads: every cache line of the chunk's keys and values asked for up front (the hardware then
        // fetches them in parallel while the first keys are scored), rather than met one stride at a time: a
        // decode step's KV reads come from DRAM, ~120 KB a row at SmolLM2's shapes, well inside L2 (bounded by
        // kPrefetchBytes so a long chunk does not evict its own first keys). Measured against the kernel without it
        // in one process (32 decode rows x 96 keys, 30 layers' caches in turn, alternating), seven runs: 1.00-1.21x,
        // median 1.09x (e.g. 425 -> 389 us a call), identical outputs
        const int64_t k_bytes = ((hkv - 1) * k_head + dk) * static_cast<int64_t>(sizeof(float));
        const int64_t v_bytes = ((hkv - 1) * v_head + dv) * static_cast<int64_t>(sizeof(float));
        if (dk <= kWideKey && width * (k_bytes + v_bytes) <= kPrefetchBytes) {
          for (int64_t s = 0; s < width; ++s) {
            const char* kr = reinterpret_cast<const char*>(kp + koff[s]);
            const char* vr = reinterpret_cast<const char*>(vp + voff[s]);
            for (int64_t b = 0; b < k_bytes; b += 64) __builtin_prefetch(kr + b);
            for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(vr + b);
          }
        }
      } else {
        float* kf = grow(tl_kf, width * hkv * dk);
        float* vf = grow(tl_vf, width * hkv * dv);
        // A cache whose slots lie whole and back to back (K and V not views into a wider tensor) is converted a run
        // of consecutive slots (a cache block's) at a time: one loop over thousands of values instead of one per
        // (slot, head) of 64. Measured with the vectorized max_of 0.79-0.99x the time of a bf16 call
        // (benchmarks/native_ab.py attention; Xeon with AMX, 2 threads). Reading bf16 in place, widened in registers
        // as it is scored, measured 1.06-1.6x slower than through the buffer (every block of queries widens the keys
        // again).
        const bool k_whole = k_head == dk && k_slot == hkv * dk, v_whole = v_head == dv && v_slot == hkv * dv;
        for (int64_t s = 0; s < width;) {
          const int64_t slot = slot_of(s);
          int64_t run = 1;
          if (k_whole && v_whole) {
            while (s + run < width && slot_of(s + run) == slot + run) ++run;
            as_float(kp + slot * k_slot, kf + s * hkv * dk, run * hkv * dk);
            as_float(vp + slot * v_slot, vf + s * hkv * dv, run * hkv * dv);
          } else {
            for (int64_t g = 0; g < hkv; ++g) {  // as_float converts into the buffer it is given
              as_float(kp + slot * k_slot + g * k_head, kf + (s * hkv + g) * dk, dk);
              as_float(vp + slot * v_slot + g * v_head, vf + (s * hkv + g) * dv, dv);
            }
          }
          for (int64_t e = s; e < s + run; ++e) {
            koff[e] = e * hkv * dk;
            voff[e] = e * hkv * dv;
          }
          s += run;
        }
        kbase = kf, vbase = vf, kh = dk, vh = dv;
      }
      // Each query scores four keys at a time. Wide keys (MLA's 576-wide
      // latents, whose chunk does not fit L1) go four keys at a time past every query of their KV head instead,
      // so those four stay in L1 (measured: 794 -> 659 us, 4 queries x 4 heads x 900 latents; narrow GQA heads
      // measured slower that way, 300 -> 415 us at 32 rows x 130 keys, one thread)
      if (dk <= kWideKey) {
        for (int64_t g = 0; g < hkv; ++g) {
          const float* kg = kbase + g * kh;
          for (int64_t j = g * r * n; j < (g + 1) * r * n; ++j) {
            const float* qj = qf + j * dk;
            float* sj = scores + j * chunk;
            const int64_t w = width_of[j];
            int64_t s = 0;
            for (; s + 4 <= w; s += 4) {
              dot4(qj, kg + koff[s], kg + koff[s + 1], kg + koff[s + 2], kg + koff[s + 3], dk, sj + s);
              for (int64_t e = 0; e < 4; ++e) sj[s + e] *= fscale;
            }
            for (; s < w; ++s) sj[s] = dot(qj, kg + koff[s], dk) * fscale;
          }
        }
      } else {
        for (int64_t g = 0; g < hkv; ++g) {
          const float* kg = kbase + g * kh;
          const int64_t j0 = g * r * n, j1 = (g + 1) * r * n;
          int64_t wg = 0;
          for (int64_t j = j0; j < j1; ++j) wg = std::max(wg, width_of[j]);
          for (int64_t s = 0; s < wg; s += 4) {
            const float* k0 = kg + koff[s];
            const float* k1 = s + 1 < wg ? kg + koff[s + 1] : k0;
            const float* k2 = s + 2 < wg ? kg + koff[s + 2] : k0;
            const float* k3 = s + 3 < wg ? kg + koff[s + 3] : k0;
            int64_t j = j0;
            if constexpr (kBlock4x4) {  // four queries at a time where all four see these four keys
              for (; j + 4 <= j1 && s + 4 <= std::min({width_of[j], width_of[j + 1], width_of[j + 2],
                                                        width_of[j + 3]}); j += 4) {
                float* sj = scores + j * chunk + s;
                dot4x4(qf + j * dk, dk, k0, k1, k2, k3, dk, sj, chunk);
                for (int64_t r = 0; r < 4; ++r) {
                  for (int64_t e = 0; e < 4; ++e) sj[r * chunk + e] *= fscale;
                }
              }
            }
            for (; j < j1; ++j) {
              const float* qj = qf + j * dk;
              float* sj = scores + j * chunk;
              const int64_t w = width_of[j];
              if (s + 4 <= w) {
                dot4(qj, k0, k1, k2, k3, dk, sj + s);
                for (int64_t e = 0; e < 4; ++e) sj[s + e] *= fscale;
              } else {
                for (int64_t e = s; e < w; ++e) sj[e] = dot(qj, kg + koff[e], dk) * fscale;
              }
            }
          }
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t w = width_of[j];
        if (w == 0) continue;  // no key of this chunk is visible to this query
        float* sj = scores + j * chunk;
        const float mx = max_of(sj, w);
        m[j] = mx;
        l[j] = exp_sum(sj, w, mx);
      }
      // 64 output channels at a time, every query of the KV head in turn: the keys' values for those channels
      // stay in L1 across the queries
      for (int64_t g = 0; g < hkv; ++g) {
        const int64_t j0 = g * r * n, j1 = (g + 1) * r * n;
        // queries taken four at a time (wide values): zero each one's probabilities up to the widest of
        // its four, which then all run that many keys
        const int64_t quads = dk > kWideKey && dv >= 64 ? (j1 - j0) / 4 : 0;
        for (int64_t qd = 0; qd < quads; ++qd) {
          const int64_t j = j0 + 4 * qd;
          const int64_t wmax = std::max({width_of[j], width_of[j + 1], width_of[j + 2], width_of[j + 3]});
          for (int64_t e = 0; e < 4; ++e) std::fill(scores + (j + e) * chunk + width_of[j + e],
                                                    scores + (j + e) * chunk + wmax, 0.f);
        }
        for (int64_t d = 0; d < dv;) {
          const int64_t cols = dv - d >= 64 ? 64 : (dv - d >= 16 ? 16 : dv - d);
          int64_t j = j0;
          if (cols == 64) {
            for (int64_t qd = 0; qd < quads; ++qd, j += 4) {
              const int64_t wmax = std::max({width_of[j], width_of[j + 1], width_of[j + 2], width_of[j + 3]});
              weighted_cols4(scores + j * chunk, chunk, vbase + g * vh, voff, wmax, d, acc + j * dv, dv);
            }
          }
          for (; j < j1; ++j) {
            weighted_cols(scores + j * chunk, vbase + g * vh, voff, width_of[j], d, cols, acc + j * dv);
          }
          d += cols;
        }
      }
      if (!split) write_task(op, lp, t0, n, hq, dv, o_tok, o_head, m, l, acc);  // else merged below
    }
  });
  if (parts == 0) return;

  // merge the chunks of each split row's queries: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
  at::parallel_for(0, num_rows * hq, serial ? num_rows * hq + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dv);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t row = rh / hq, h = rh % hq;
      const int64_t chunks = first_task[row + 1] - first_task[row];
      if (chunks == 1 || qblock[row] > 0) continue;  // whole, or written by its query blocks
      const int32_t* rr = rw + 5 * row;
      const int64_t t0 = rr[1], n = rr[2], nq = hq * n;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t qv = h * n + i;
        float big = kNegInf;
        for (int64_t c = 0; c < chunks; ++c) big = std::max(big, part_m[part_at[row] + c * nq + qv]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        if (big != kNegInf) {
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t at = part_at[row] + c * nq + qv;
            if (part_m[at] == kNegInf) continue;
            const float w = std::exp(part_m[at] - big);
            total += w * part_l[at];
            axpy(w, part_acc.data() + at * dv, merged.data(), dv);
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        T* o = op + (t0 + i) * o_tok + h * o_head;
        for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<T>(merged[d] * inv);
        lp[(t0 + i) * hq + h] = total > 0.f ? big + std::log(total) : kNegInf;
      }
    }
  });
}

// The cache's dtype for queries of type T: T's own, or (kv_cache_dtype) bfloat16 or float8 below float32 / float16
template <typename T>
void run_cache_dtype(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& block_table, const torch::Tensor& rows, const torch::Tensor& positions,
                     int64_t block_size, double scale, torch::Tensor& out, torch::Tensor& lse, int64_t isa) {
  const auto kv = k.scalar_type();
  if (kv == q.scalar_type()) {
    run<T, T>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else if (kv == torch::kFloat8_e4m3fn) {
    run<T, c10::Float8_e4m3fn>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else if (kv == torch::kFloat8_e5m2) {
    run<T, c10::Float8_e5m2>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else if (kv == torch::kBFloat16 && !std::is_same_v<T, at::BFloat16>) {
    run<T, at::BFloat16>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else {
    TORCH_CHECK(false, "paged_attention: a ", kv, " cache under ", q.scalar_type(), " queries is not served");
  }
}

void dispatch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& block_table,
              const torch::Tensor& rows, const torch::Tensor& positions, int64_t block_size, double scale,
              torch::Tensor& out, torch::Tensor& lse, int64_t isa) {
  if (q.scalar_type() == torch::kFloat32) {
    run_cache_dtype<float>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run_cache_dtype<at::BFloat16>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else if (q.scalar_type() == torch::kFloat16) {
    run_cache_dtype<at::Half>(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
  } else {
    TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 queries only");
  }
}

}  // namespace

// q: [T, Hq, Dk]; k: [slots, Hkv, Dk]; v: [slots, Hkv, Dv] (a view of k's first Dv channels for MLA's latents);
// block_table: [num_table_rows, max_blocks] int32; rows: [R, 5] int32; positions: [T] int64;
// out: [T, Hq, Dv] (q's dtype), lse: [T, Hq] float32: written at the rows' query tokens only. k and v may be
// narrower than q (kv_cache_dtype bfloat16 / fp8): dequantized chunk by chunk, never as a float copy of the prefix.
// isa (bfloat16 queries over a bfloat16 cache only): 1 the avx512_bf16 loops, 2 those and AMX tiles for rows of
// 33 queries or more (prompt rows), 0 the widening path, -1 the best here.
void paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor block_table,
                     torch::Tensor rows, torch::Tensor positions, int64_t block_size, double scale,
                     torch::Tensor out, torch::Tensor lse, int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= 2,
              "paged_attention: isa is -1 (best), 0 (widening), 1 (avx512_bf16) or 2 (avx512_bf16 and AMX), got ", isa);
  TORCH_CHECK(isa < 1 || kHasBf16Dot, "paged_attention: this CPU has no avx512_bf16 dot products");
  TORCH_CHECK(isa != 2 || amx_ready(), "paged_attention: this CPU has no AMX-BF16 (or the OS refused its state)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged_attention: q, k, v must be 3-D");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_attention: k and v must share a dtype, and q and out another");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: the last dimension must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
              "paged_attention: block_table must be int32 with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == torch::kInt32 && rows.is_contiguous() && rows.dim() == 2 && rows.size(1) == 5,
              "paged_attention: rows must be contiguous int32 [R, 5]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "paged_attention: positions must be contiguous int64");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.is_contiguous(), "paged_attention: lse must be float32");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == v.size(2) &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && positions.size(0) == q.size(0) &&
                  v.size(1) == k.size(1),
              "paged_attention: out [T, Hq, Dv], lse [T, Hq] and positions [T] must match q and v");
  const int32_t* rw = rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {  // a bad row would read or write out of bounds: refuse it
    const int64_t row = rw[5 * i], t0 = rw[5 * i + 1], n = rw[5 * i + 2], seq_len = rw[5 * i + 3];
    const int64_t key_start = rw[5 * i + 4];
    TORCH_CHECK(row >= 0 && row < block_table.size(0) && t0 >= 0 && n >= 1 && t0 + n <= q.size(0) &&
                    key_start >= 0 && seq_len <= block_table.size(1) * block_size,
                "paged_attention: row ", i, " is out of range");
  }
  if (isa == -1) isa = kHasBf16Dot ? (amx_ready() ? 2 : 1) : 0;
  dispatch(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa);
}

TORCH_LIBRARY(tandem_native, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor rows, Tensor positions, "
        "int block_size, float scale, Tensor(a!) out, Tensor(b!) lse, int isa=-1) -> ()");
  m.impl("paged_attention", torch::kCPU, &paged_attention);
}
