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

namespace amx_attention {

// keys s in [0, n), n <= 16, of one KV head (key s at base + off[s], dk channels) as the B tiles of S = Q K^T, one a
// 32-channel chunk: out[c][p][s] = the pair of key s's channels 32c + 2p, 32c + 2p + 1 (zeros for missing keys and
// channels past dk). out: [ceil(dk / 32)][16][16] pairs
inline void keys_as_b(const uint16_t* base, const int64_t* off, int64_t n, int64_t dk, uint32_t* out) {
  std::memset(out, 0, (dk + 31) / 32 * 1024);
  for (int64_t s = 0; s < n; ++s) {
    const uint16_t* key = base + off[s];
    int64_t d = 0;
    for (; d + 1 < dk; d += 2) {
      uint32_t pair;
      std::memcpy(&pair, key + d, sizeof(pair));
      out[(d / 32) * 256 + (d % 32) / 2 * 16 + s] = pair;
    }
    if (d < dk) out[(d / 32) * 256 + (d % 32) / 2 * 16 + s] = key[d];
  }
}

// values s in [0, n), n <= 32, of one KV head as the B tiles of O = P V, one a 16-channel chunk: out[t][p][2e + j] =
// channel 16t + e of value 2p + j (zeros for missing values and channels past dv). out: [ceil(dv / 16)][16][32]
inline void values_as_b(const uint16_t* base, const int64_t* off, int64_t n, int64_t dv, uint16_t* out) {
  std::memset(out, 0, (dv + 15) / 16 * 1024);
  for (int64_t s = 0; s < n; ++s) {
    const uint16_t* value = base + off[s];
    uint16_t* o = out + s / 2 * 32 + s % 2;
    for (int64_t d = 0; d < dv; ++d) o[(d / 16) * 512 + (d % 16) * 2] = value[d];
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
