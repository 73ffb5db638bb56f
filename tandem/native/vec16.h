// f32x16: sixteen floats, the unit the kernels' dot products and weighted sums are written in, and hsum, its
// fixed-order horizontal sum.
//
// With avx512 it is one register (GCC's vector extension). Without it, GCC lowers a 64-byte vector extension type
// through the stack: every load, multiply-add and accumulator went through memory, and the paged-attention kernel
// ran at ~5 GFLOPS on an avx2 machine (AMD EPYC, 2 cores; 1.1 ms for one decode row's 4 heads x 960 latents, 60%
// of a batch-1 step). There it is two avx2 registers, lo and hi, holding the same lanes: every operation is the
// same per-lane arithmetic, and hsum folds hi onto lo as the avx512 code does its upper half, so both give the same
// bits.

#pragma once

#include <cstdint>
#include <cstring>

// n bf16 values (their uint16_t bits) -> float32, exactly: bf16 is float32's upper half, a shift the compiler
// vectorizes
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

#ifdef __AVX512F__
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef unsigned short u16x16 __attribute__((vector_size(32)));
typedef unsigned int u32x16 __attribute__((vector_size(64)));

// sixteen bfloat16 values (their bits) widened to float32: a bf16 is a float32's upper half
inline f32x16 load16_bf16(const unsigned short* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline f32x8 fold16(f32x16 v) {  // lanes 0-7 plus lanes 8-15
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
struct f32x16 {
  f32x8 lo = {}, hi = {};  // lanes 0-7, 8-15

  f32x16& operator+=(const f32x16& o) {
    lo += o.lo;
    hi += o.hi;
    return *this;
  }
};

inline f32x16 operator*(const f32x16& a, const f32x16& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline f32x16 operator+(const f32x16& a, float s) { return {a.lo + s, a.hi + s}; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v.lo, p, sizeof(v.lo));
  std::memcpy(&v.hi, p + 8, sizeof(v.hi));
  return v;
}

typedef unsigned short u16x8 __attribute__((vector_size(16)));
typedef unsigned int u32x8 __attribute__((vector_size(32)));

inline f32x8 widen8_bf16(const unsigned short* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// sixteen bfloat16 values (their bits) widened to float32: a bf16 is a float32's upper half
inline f32x16 load16_bf16(const unsigned short* p) { return {widen8_bf16(p), widen8_bf16(p + 8)}; }

inline f32x8 fold16(const f32x16& v) { return v.lo + v.hi; }
#endif

// s in every lane: a broadcast (`f32x16{} + s` computed 0 + s first, a scalar add before each broadcast, since
// -0.0 + 0 is +0; the same lanes for every s but -0.0)
inline f32x16 splat16(float s) {
#ifdef __AVX512F__
  return f32x16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#else
  const f32x8 v = {s, s, s, s, s, s, s, s};
  return {v, v};
#endif
}

static_assert(sizeof(f32x16) == 16 * sizeof(float), "f32x16 is sixteen contiguous floats (kernels memcpy it out)");

inline float hsum(const f32x16& v) {
  const f32x8 h8 = fold16(v);
  const f32x4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
