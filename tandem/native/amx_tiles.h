// Intel AMX tiles as tandem's kernels use them: eight 16-row x 64-byte tiles (palette 1), loaded per thread before
// a kernel's passes and released after. amx_ready() (amx_gemm.cpp) says whether this CPU has AMX-BF16 and Linux
// granted the process its register state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once).

#pragma once

#include <cstdint>

bool amx_ready();

#ifdef __AVX512F__
#include <immintrin.h>

namespace amx {

constexpr int64_t kTile = 16;  // rows of a tile; 64 bytes a row: 32 bf16 or 16 float32

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes
__attribute__((target("amx-tile,amx-bf16"))) inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 drops the stores above: ldtilecfg's read is not modelled
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void release() { _tile_release(); }

}  // namespace amx
#endif
