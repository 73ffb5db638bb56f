// bfloat16 linears of a decode batch or its verification (5-128 rows) on Intel AMX tiles, streaming each weight once.
//
// At 32 rows a bf16 linear is memory-bound (32 multiply-adds a weight value; AMX does ~500 a cycle), so its time is
// the weight's bytes over the read bandwidth. oneDNN's AMX GEMM reads SmolLM2-135M's projections at ~19.7 GB/s at 32
// rows where a one-row stream reads ~32 GB/s on the same VM (Intel Xeon with AMX, 2 threads, 425 MB of weights in
// turn, cold). This kernel keeps the rows of x in L1 and walks the weight once, in the order it lies in memory.
//
// The weight is packed once (amx_pack in cpu_gemm.py) into AMX's pair-interleaved (VNNI) layout, [N / 16, K / 2, 16,
// 2]: 16 output columns' weights for one K pair side by side, so the B tile of 16 K pairs x 16 columns is 1 KiB in
// one piece and a thread's share of the columns is one contiguous run. Each pass: 32 columns (two B tiles) against
// up to 32 rows (two A tiles), four float32 accumulator tiles; float32 sums rounded once to bf16, bias added first.
//
// Linux grants a process the AMX state on request (arch_prctl ARCH_REQ_XCOMP_PERM); amx_available() asks once and
// says whether the CPU has AMX-BF16 and the kernel may run. Compiled for AMX alone (the target attribute), called
// only where it runs.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace {

#ifdef __AVX512F__
using amx::kTile;  // rows of an A / C tile, columns of a B / C tile, K pairs of a B tile

// how far ahead of the tiles' loads a pass asks for the weight (prefetcht2): measured over SmolLM2's 120
// projections at 32 rows (the sweep in amx_gemm's docs), ms: none 18.5, 16 KiB 14.8-15.6, 64 KiB 13.6-13.8, 256 KiB
// 14.5-15.6 (prefetcht0 at the same distances 15.3-18.9)
constexpr int64_t kAhead = 64 << 10;

bool request_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// tiles 0-3: C (A row tile a, B column tile b at 2a + b); 4, 5: A; 6, 7: B.
// out[m, n0 .. n0 + 32 * nb) for the 32 rows of xs (padded, row stride k) over the packed weight's column blocks
// nb0 .. nb0 + nb (of 32 columns): C tiles stored to `acc` [32, 32] float32, then rounded
template <bool kTwoRows, bool kTwoCols>
__attribute__((target("amx-tile,amx-bf16"))) void pass(const uint16_t* xs, const uint16_t* wp, int64_t k, float* acc,
                                                      const char* ahead) {
  _tile_zero(0);
  if (kTwoCols) _tile_zero(1);
  if (kTwoRows) _tile_zero(2);
  if (kTwoRows && kTwoCols) _tile_zero(3);
  const int64_t b_tile = k / 2 * kTile * 2;  // elements of one 16-column block's packed weight
  for (int64_t kk = 0; kk < k; kk += 32) {
    // as many bytes as a step reads (2 KiB, 1 with one column tile), kAhead further on in the thread's contiguous
    // run of the weight: the prefetchers alone left the tiles waiting on DRAM (22 GB/s against 31 at 32 rows)
    for (int64_t b = 0; b < (kTwoCols ? 2048 : 1024); b += 64) {
      __builtin_prefetch(ahead + kk * (kTwoCols ? 64 : 32) + b, 0, 1);
    }
    _tile_loadd(4, xs + kk, k * 2);
    if (kTwoRows) _tile_loadd(5, xs + kTile * k + kk, k * 2);
    _tile_loadd(6, wp + kk * kTile, 64);
    if (kTwoCols) _tile_loadd(7, wp + b_tile + kk * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwoCols) _tile_dpbf16ps(1, 4, 7);
    if (kTwoRows) _tile_dpbf16ps(2, 5, 6);
    if (kTwoRows && kTwoCols) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 128);
  if (kTwoCols) _tile_stored(1, acc + kTile, 128);
  if (kTwoRows) _tile_stored(2, acc + kTile * 32, 128);
  if (kTwoRows && kTwoCols) _tile_stored(3, acc + kTile * 32 + kTile, 128);
}

// out[0, cols) = bf16(acc + bias), cols 16 or 32, rounded to nearest even (AMX CPUs have avx512_bf16)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void round_row(const float* acc, const uint16_t* bias, int64_t cols, uint16_t* out) {
  for (int64_t c = 0; c < cols; c += 16) {
    __m512 v = _mm512_loadu_ps(acc + c);
    if (bias != nullptr) {
      const __m512i b = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(bias + c))), 16);
      v = _mm512_add_ps(v, _mm512_castsi512_ps(b));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(v));
  }
}
#endif

}  // namespace

bool amx_ready() {
#ifdef __AVX512F__
  static const bool ready = request_amx();
  return ready;
#else
  return false;
#endif
}

bool amx_available() { return amx_ready(); }


// x: [M, K] bf16 (K contiguous, K % 32 == 0); packed: [N / 16, K / 2, 16, 2] bf16 (amx_pack); bias: [N] or None
// -> a new [M, N] bf16
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "amx_linear: this CPU has no AMX-BF16 (or the OS refused its state)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear: bfloat16 x and weight only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "amx_linear: x [M, K] with K contiguous, packed [N / 16, K / 2, 16, 2] contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * 16;
  TORCH_CHECK(k % 32 == 0 && packed.size(1) * 2 == k, "amx_linear: K must be a multiple of 32 and match the weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n &&
                                    bias->is_contiguous()),
              "amx_linear: bias must be a contiguous bfloat16 [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef __AVX512F__
  // x's rows in groups of 32, zero-padded to whole tiles
  const int64_t groups = (m + 31) / 32;
  std::vector<uint16_t> xs(groups * 32 * k, 0);
  const int64_t x_row = x.stride(0);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t r = 0; r < m; ++r) std::memcpy(xs.data() + r * k, xp + r * x_row, k * 2);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const uint16_t* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t col_blocks = (n + 31) / 32;  // of 32 columns; the last may hold 16
  at::parallel_for(0, col_blocks, 1, [&](int64_t begin, int64_t end) {
    amx::configure();
    alignas(64) float acc[32 * 32];
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t n0 = cb * 32, cols = std::min<int64_t>(32, n - n0);
      const uint16_t* w = wp + n0 * k;  // column block n0 / 16 of the packed weight
      // (the last of the thread's blocks prefetches past it: harmless, prefetches do not fault)
      const char* ahead = reinterpret_cast<const char*>(w) + kAhead;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = std::min<int64_t>(32, m - g * 32);
        const uint16_t* xg = xs.data() + g * 32 * k;
        if (rows > 16) {
          cols > 16 ? pass<true, true>(xg, w, k, acc, ahead) : pass<true, false>(xg, w, k, acc, ahead);
        } else {
          cols > 16 ? pass<false, true>(xg, w, k, acc, ahead) : pass<false, false>(xg, w, k, acc, ahead);
        }
        for (int64_t r = 0; r < rows; ++r) round_row(acc + r * 32, bp == nullptr ? nullptr : bp + n0, cols,
                                                      op + (g * 32 + r) * n + n0);
      }
    }
    amx::release();
  });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("amx_linear", torch::kCPU, &amx_linear);
}
