// Paged attention's prompt rows (33 queries or more) on Intel AMX tiles, bfloat16 queries over a bfloat16 cache.
//
// A prompt row of ~100 queries scored one (query, key) pair at a time cost ~8 cycles a pair with avx512_bf16
// (attention_bf16.h), a quarter of SmolLM2-135M's bf16 prefill. As tiles: S = Q K^T a 16-query x 16-key block per
// tdpbf16ps of 32 channels, and O = P V a 16-query x 16-channel block per 32 keys. The keys and values of a KV head
// are laid out once a task in the tiles' pair-interleaved form (B tiles) and serve every query head of the group and
// every block of 16 queries; queries go in as A tiles as they lie. Scores are float32 (bf16 products summed in
// float32), the softmax runs per query as the other paths' does, and the probabilities enter P V rounded to bf16.
// Callers configure the tiles (amx::configure) and release them.

#pragma once

#ifdef __AVX512F__

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"

#define TANDEM_AMX __attribute__((target("amx-tile,amx-bf16")))
#define TANDEM_AMX_LAYOUT __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace amx_attention {

// keys s in [0, n), n <= 16, of one KV head (key s at base + off[s], dk channels) as the B tiles of S = Q K^T, one a
// 32-channel chunk: out[c][p][s] = the pair of key s's channels 32c + 2p, 32c + 2p + 1 (zeros for missing keys and
// channels past dk): a 16 x 16 transpose of 32-bit pairs a chunk, in registers (unpacks, then 128-bit shuffles).
// out: [ceil(dk / 32)][16][16] pairs
TANDEM_AMX_LAYOUT inline void keys_as_b(const uint16_t* base, const int64_t* off, int64_t n, int64_t dk,
                                        uint32_t* out) {
  for (int64_t c = 0; c < dk; c += 32) {
    const __mmask32 m = dk - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (dk - c)) - 1);
    __m512i r[16];
    for (int s = 0; s < 16; ++s) r[s] = s < n ? _mm512_maskz_loadu_epi16(m, base + off[s] + c) : _mm512_setzero_si512();
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {  // lane L: pairs 4L, 4L + 1 (t[2i]) or 4L + 2, 4L + 3 (t[2i + 1]) of keys 2i, 2i + 1
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int j = 0; j < 4; ++j) {  // u[4j + e], lane L: pair 4L + e of keys 4j .. 4j + 3
      u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
      u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
      u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
      u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
    uint32_t* o = out + c / 32 * 256;
    for (int e = 0; e < 4; ++e) {  // pair 4L + e of keys 0 .. 15: lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
      const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
      const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
      const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
      _mm512_storeu_si512(o + (0 + e) * 16, _mm512_shuffle_i32x4(v0, w0, 0x88));
      _mm512_storeu_si512(o + (4 + e) * 16, _mm512_shuffle_i32x4(v1, w1, 0x88));
      _mm512_storeu_si512(o + (8 + e) * 16, _mm512_shuffle_i32x4(v0, w0, 0xDD));
      _mm512_storeu_si512(o + (12 + e) * 16, _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
  }
}

// values s in [0, n), n <= 32, of one KV head as the B tiles of O = P V, one a 16-channel chunk: out[t][p][2e + j] =
// channel 16t + e of value 2p + j (zeros for missing values and channels past dv): two value rows' 16 channels
// interleaved a tile row. out: [ceil(dv / 16)][16][32]
TANDEM_AMX_LAYOUT inline void values_as_b(const uint16_t* base, const int64_t* off, int64_t n, int64_t dv,
                                          uint16_t* out) {
  for (int64_t d = 0; d < dv; d += 16) {
    const __mmask16 m = dv - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (dv - d)) - 1);
    uint16_t* o = out + d / 16 * 512;
    for (int64_t p = 0; p < 16; ++p) {
      const __m256i x = 2 * p < n ? _mm256_maskz_loadu_epi16(m, base + off[2 * p] + d) : _mm256_setzero_si256();
      const __m256i y = 2 * p + 1 < n ? _mm256_maskz_loadu_epi16(m, base + off[2 * p + 1] + d)
                                      : _mm256_setzero_si256();
      // per 128-bit lane: channels 0-3 (lo) and 4-7 (hi) of the lane's 8, paired
      const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 32), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 32 + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}

// 16 queries (q: [16, dkp] bf16, dkp a multiple of 32) x 16 keys (keys_as_b's tiles) -> out [16, 16] float32 rows
// `out_stride` bytes apart. Uses tiles 0 (C), 4 (A), 6 (B).
TANDEM_AMX inline void score_block(const uint16_t* q, int64_t dkp, const uint32_t* keys, float* out,
                                   int64_t out_stride) {
  _tile_zero(0);
  for (int64_t c = 0; c < dkp / 32; ++c) {
    _tile_loadd(4, q + c * 32, dkp * 2);
    _tile_loadd(6, keys + c * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, out, out_stride);
}

// 16 queries' probabilities (p: rows of `p_stride` bf16, keys 32 a block) x values_as_b's tiles of `blocks` 32-key
// blocks ([blocks][chunks][16][32]) for channel chunks t0 .. t0 + nt - 1 (nt <= 4) -> out [16, 16 nt] float32 rows
// `out_stride` bytes apart. Uses tiles 0-3 (C), 4 (A), 5 (B).
TANDEM_AMX inline void weigh_block(const uint16_t* p, int64_t p_stride, const uint16_t* values, int64_t blocks,
                                   int64_t chunks, int64_t t0, int64_t nt, float* out, int64_t out_stride) {
  _tile_zero(0);
  if (nt > 1) _tile_zero(1);
  if (nt > 2) _tile_zero(2);
  if (nt > 3) _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(4, p + b * 32, p_stride * 2);
    const uint16_t* v = values + (b * chunks + t0) * 512;
    _tile_loadd(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (nt > 1) {
      _tile_loadd(5, v + 512, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (nt > 2) {
      _tile_loadd(5, v + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (nt > 3) {
      _tile_loadd(5, v + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, out_stride);
  if (nt > 1) _tile_stored(1, out + 16, out_stride);
  if (nt > 2) _tile_stored(2, out + 32, out_stride);
  if (nt > 3) _tile_stored(3, out + 48, out_stride);
}

}  // namespace amx_attention

#endif  // __AVX512F__
