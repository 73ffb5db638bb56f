// Paged attention's inner loops for bfloat16 queries over a bfloat16 cache on a CPU with avx512_bf16: keys and values
// read in place, no float32 copy of the chunk.
//
// Scores: vdpbf16ps multiplies 32 bf16 pairs and adds each two adjacent products into one of 16 float32 lanes, so a
// query . key of 64 channels is two instructions and one 16-lane sum. Those sums, one a (query, key), were most of
// the widening path's time (an hsum is ~8 dependent shuffles and adds for four FMAs of work at SmolLM2's 64-wide
// heads); here 16 keys' accumulators are summed together by a transpose-and-add tree (45 instructions for 16 sums).
// The products of two bf16 are exact in float32, so a score differs from the widening path's only in the order its
// float32 sums round.
//
// Values: each pair of keys' value rows interleaved (vpunpck{l,h}wd) so vdpbf16ps weighs two keys a lane with their
// probabilities rounded to bf16, as Hugging Face's bf16 attention rounds its softmax before the values' matmul. The
// interleave permutes the output channels within each 128-bit lane; they are put back once a task.
//
// A query's result depends on its own keys alone (16-key blocks and key pairs start at the chunk's first key,
// whatever the other queries of its row): decode and verification rows of the same query give the same bits.
// Compiled for avx512_bf16 alone (the target attribute) and called only where the CPU has it.

#pragma once

#ifdef __AVX512F__

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#define TANDEM_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace bf16_attention {

inline __mmask32 first_lanes(int64_t n) {  // the first n (0-32) of 32 16-bit lanes
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
}

// lane e of the result = the sum of a[e]'s 16 lanes (a fixed tree: pairs within 128-bit lanes, then across them)
TANDEM_BF16_DOT inline __m512 sum16(const __m512* a) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i) {
    // 128-bit lane L: (a2i[0] + a2i[2], a2i+1[0] + a2i+1[2], a2i[1] + a2i[3], a2i+1[1] + a2i+1[3]) of lane L
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 t[4];
  for (int i = 0; i < 4; ++i) {
    // lane L: accumulators 4i .. 4i + 3, each summed over its lane L
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // lanes (0 + 1, 2 + 3) of t[2i] and of t[2i + 1]
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// scores[s] = scale * (q . key s), s in [0, w) (keys at base + off[s], dk channels each), written up to w rounded up
// to 16 (the padding repeats key w - 1; its scores are not read)
TANDEM_BF16_DOT inline void score_keys(const uint16_t* q, const uint16_t* base, const int64_t* off, int64_t w,
                                       int64_t dk, float scale, float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t s = 0; s < w; s += 16) {
    const uint16_t* key[16];
    for (int e = 0; e < 16; ++e) key[e] = base + off[std::min<int64_t>(s + e, w - 1)];
    __m512 acc[16];
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dk; c += 32) {
      const __mmask32 m = first_lanes(dk - c);  // zeros past dk add nothing
      const __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(m, q + c);
#pragma GCC unroll 16
      for (int e = 0; e < 16; ++e) {
        acc[e] = _mm512_dpbf16_ps(acc[e], qc, (__m512bh)_mm512_maskz_loadu_epi16(m, key[e] + c));
      }
    }
    _mm512_storeu_ps(scores + s, _mm512_mul_ps(sum16(acc), vscale));
  }
}

// max(x[0, n)), n >= 1: whole vectors and one masked tail (the compiler's vectorized loops finish a row of a few dozen
// scores with up to 15 scalar steps, most of a short row's softmax)
TANDEM_BF16_DOT inline float max_of(const float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, m, x + i));
  }
  return _mm512_reduce_max_ps(mx);
}

// out[i] = bf16(2^((x[i] - mx) * factor)) for x[i] <= mx, i in [0, n) (round to nearest even); returns the float32
// sum of the unrounded values. factor: log2(e) times the scores' scale. The polynomial of paged_attention.cpp's
// exp_sum (2^f by Cephes' exp2f, f in [-1/2, 1/2]), 16 lanes a step with a masked tail; the probabilities go out as
// bf16 in the same pass (a second pass over the float32 values cost ~8% of a long prompt row's softmax).
TANDEM_BF16_DOT inline float exp_sum(const float* x, int64_t n, float mx, float factor, uint16_t* out) {
  const __m512 vmx = _mm512_set1_ps(mx), vfactor = _mm512_set1_ps(factor), floor = _mm512_set1_ps(-126.f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_mask_loadu_ps(vmx, m, x + i), vmx), vfactor),
                                   floor);
    const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, k);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(e));
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// acc[j][0, dv) = sum_s p[j][s] * value s, s in [0, w), for NB queries: value s at base + off[s]; p[j] bf16 with a
// zero at p[j][w] when w is odd (that key's partner is key w - 1 again)
template <int NB>
TANDEM_BF16_DOT void weigh_values(const uint16_t* const* p, const uint16_t* base, const int64_t* off, int64_t w,
                                  int64_t dv, float* const* acc) {
  // the interleaved pairs' output lanes -> channels: lo holds channels 8L .. 8L + 3 of each 128-bit lane L, hi 8L + 4
  // .. 8L + 7
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t d = 0; d < dv; d += 32) {
    const __mmask32 m = first_lanes(dv - d);
    __m512 lo[NB], hi[NB];  // every loop over them unrolled, or GCC keeps them in memory
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < w; s += 2) {
      const uint16_t* x = base + off[s] + d;
      const uint16_t* y = s + 1 < w ? base + off[s + 1] + d : x;
      const __m512i vx = _mm512_maskz_loadu_epi16(m, x), vy = _mm512_maskz_loadu_epi16(m, y);
      const __m512bh a = (__m512bh)_mm512_unpacklo_epi16(vx, vy), b = (__m512bh)_mm512_unpackhi_epi16(vx, vy);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        int32_t pair;  // p[j][s], p[j][s + 1]
        std::memcpy(&pair, p[j] + s, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
        lo[j] = _mm512_dpbf16_ps(lo[j], a, pp);
        hi[j] = _mm512_dpbf16_ps(hi[j], b, pp);
      }
    }
    const int64_t cols = std::min<int64_t>(32, dv - d);
    const __mmask16 m0 = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      _mm512_mask_storeu_ps(acc[j] + d, m0, _mm512_permutex2var_ps(lo[j], first16, hi[j]));
      _mm512_mask_storeu_ps(acc[j] + d + 16, m1, _mm512_permutex2var_ps(lo[j], next16, hi[j]));
    }
  }
}

TANDEM_BF16_DOT inline void weigh_values_any(int64_t nb, const uint16_t* const* p, const uint16_t* base,
                                             const int64_t* off, int64_t w, int64_t dv, float* const* acc) {
  switch (nb) {
    case 1: weigh_values<1>(p, base, off, w, dv, acc); break;
    case 2: weigh_values<2>(p, base, off, w, dv, acc); break;
    case 3: weigh_values<3>(p, base, off, w, dv, acc); break;
    default: weigh_values<4>(p, base, off, w, dv, acc); break;
  }
}

}  // namespace bf16_attention

#endif  // __AVX512F__
