// A Llama-family decoder layer (GQA, SwiGLU, RMSNorm, RoPE; Qwen3's per-head q/k norms) in one call, for steps whose
// every row is short (decodes, verification rows): the same kernels as the module path, in the same order, on the
// same tensors, so the same bits (tests/test_fused_decoder_layer.py). Why: at batch 1 a SmolLM2 layer's own work is
// ~0.6 ms of weights streamed and ~20 us of everything else, but the module path makes ~40 PyTorch calls around it,
// each a Python frame and a dispatch (~5-15 us): ~10 ms of a step of 30 layers, a third of it, with the memory bus
// idle. One call a layer leaves the Python of 30 calls a step (tandem/models/fused_decoder_layer.py says when it
// serves).
//
// The linears run whichever native kernel the module path would have run for these rows (the caller's `kinds`):
// the panels (panel_gemm.cpp), the small-row GEMM (small_gemm.cpp) or AMX tiles (amx_gemm.cpp).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

// the kernels' entry points (their files)
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
void paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor block_table,
                     torch::Tensor rows, torch::Tensor positions, int64_t block_size, double scale,
                     torch::Tensor out, torch::Tensor lse, int64_t isa);
namespace tandem_native {
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotary_dim, bool interleaved);
}  // namespace tandem_native

namespace {

constexpr int64_t kPanels = 0, kSmall = 1, kAmx = 2;  // tandem/layers/cpu_gemm.py's PANELS, SMALL, AMX

// x: [T, K] -> [T, n] through the kernel `kind` names; w: its weight as that kernel reads it
at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& w, int64_t n,
                   const c10::optional<at::Tensor>& bias) {
  switch (kind) {
    case kPanels:
      return panel_linear(x, w, n, bias);
    case kSmall:
      return tandem_native::small_linear(x, w, bias);
    case kAmx:
      return amx_linear(x, w, bias);
    default:
      TORCH_CHECK(false, "gqa_decoder_layer: linear kind ", kind, " is not one of 0 (panels), 1 (small), 2 (amx)");
  }
}

// K/V rows [n_write, Hkv, D] (rows and heads strided, D contiguous) into the cache's slots write_slots [n_write]
// of k_flat / v_flat [slots, Hkv, D]: the index_copy_ of the module path as plain copies (two dispatches and their
// narrows cost ~18 us a layer at batch 1, where the copy itself is 2 x 384 bytes)
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& write_slots, const at::Tensor& k_flat,
              const at::Tensor& v_flat) {
  const int64_t n_write = write_slots.size(0), heads = k.size(1), d = k.size(2), slots = k_flat.size(0);
  const int64_t elem = k.element_size();
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_flat.stride(2) == 1 && v_flat.stride(2) == 1 &&
                  k_flat.stride(1) == d && v_flat.stride(1) == d && v.size(1) == heads && v.size(2) == d,
              "gqa_decoder_layer: K/V rows and the cache must have contiguous heads");
  const at::Tensor slots_c = write_slots.contiguous();
  const int64_t* slot = slots_c.data_ptr<int64_t>();
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  auto* kd = static_cast<char*>(k_flat.data_ptr());
  auto* vd = static_cast<char*>(v_flat.data_ptr());
  for (int64_t i = 0; i < n_write; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "gqa_decoder_layer: write slot ", slot[i], " is outside [0, ",
                slots, ")");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kd + (slot[i] * k_flat.stride(0) + h * d) * elem, ks + (i * k.stride(0) + h * k.stride(1)) * elem,
                  d * elem);
      std::memcpy(vd + (slot[i] * v_flat.stride(0) + h * d) * elem, vs + (i * v.stride(0) + h * v.stride(1)) * elem,
                  d * elem);
    }
  }
}

// out += residual, both contiguous [T, H] of one dtype: each sum in float32, rounded once to the dtype (what
// `residual + out` computes) without a dispatch and an allocation (~5 us a layer at batch 1)
void add_into(at::Tensor& out, const at::Tensor& residual) {
  TORCH_CHECK(out.is_contiguous() && residual.is_contiguous() && out.sizes() == residual.sizes() &&
                  out.scalar_type() == residual.scalar_type(),
              "gqa_decoder_layer: the MLP's output and the residual must be contiguous [T, H] of one dtype");
  const int64_t n = out.numel();
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    const float* r = residual.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = r[i] + o[i];
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "gqa_decoder_layer: float32 or bfloat16 hidden states");
    auto* o = out.data_ptr<at::BFloat16>();
    const auto* r = residual.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) o[i] = at::BFloat16(static_cast<float>(r[i]) + static_cast<float>(o[i]));
  }
}

// hidden: [T, H] the residual stream into the layer -> [T, H] out of it (hidden + attention, then + MLP).
// norms: [input_layernorm, post_attention_layernorm] weights, + [q_norm, k_norm] for Qwen3's per-head norms;
// weights / kinds / sizes / biases: qkv_proj, o_proj, gate_up_proj, down_proj (o_proj's and down_proj's biases are
// added after their GEMMs, where the module path adds them after the TP reduction). positions: [T] int64 (rotary);
// attn_positions: [T] int64 contiguous (the kernel's); kv_cache: [2, num_blocks, block_size, Hkv, D] of hidden's
// dtype; write_slots: [n_write] int64, the slots of the first n_write tokens' K/V; block_table, rows: the native rows
// (paged_attention.cpp), covering the step's tokens. attn_input: [T, K] qkv_proj's input where it is not the input
// norm of hidden (an EAGLE-3 head's layer: its embedded tokens' norm beside its hidden norm, [T, 2H]); norms[0] is
// then unused.
at::Tensor gqa_decoder_layer(const at::Tensor& hidden, const at::Tensor& positions,
                             const std::vector<at::Tensor>& norms, double eps, const std::vector<at::Tensor>& weights,
                             const std::vector<int64_t>& kinds, const std::vector<int64_t>& sizes,
                             const std::vector<c10::optional<at::Tensor>>& biases,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, bool interleaved,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& kv_cache,
                             const at::Tensor& write_slots, const at::Tensor& block_table, const at::Tensor& rows,
                             const at::Tensor& attn_positions, double scale,
                             const c10::optional<at::Tensor>& attn_input) {
  TORCH_CHECK((norms.size() == 2 || norms.size() == 4) && weights.size() == 4 && kinds.size() == 4 &&
                  sizes.size() == 4 && biases.size() == 4,
              "gqa_decoder_layer: two norms (four with q_norm and k_norm) and four linears (qkv, o, gate_up, down)");
  TORCH_CHECK(hidden.dim() == 2 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.scalar_type() == hidden.scalar_type() && kv_cache.size(3) == num_kv_heads &&
                  kv_cache.size(4) == head_dim,
              "gqa_decoder_layer: hidden [T, H] and a kv_cache [2, blocks, block_size, ", num_kv_heads, ", ", head_dim,
              "] of its dtype");
  const int64_t t = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(sizes[0] == q_size + 2 * kv_size, "gqa_decoder_layer: qkv_proj's output must be q + 2 kv wide");
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && write_slots.dim() == 1 && write_slots.size(0) <= t,
              "gqa_decoder_layer: write_slots must be int64 [<= T]");

  // attention: qkv, one rotation for q's and k's heads side by side, K/V into the cache, the kernel over the rows
  const bool own_input = attn_input.has_value() && attn_input->defined();
  TORCH_CHECK(!own_input || (attn_input->dim() == 2 && attn_input->size(0) == t &&
                             attn_input->scalar_type() == hidden.scalar_type()),
              "gqa_decoder_layer: attn_input must be [T, K] of hidden's dtype");
  const at::Tensor qkv = project(own_input ? *attn_input : tandem_native::rms_norm(hidden, norms[0], eps), kinds[0],
                                 weights[0], sizes[0], biases[0]);  // [T, q + 2 kv]
  at::Tensor q, k;  // [T, Hq, D], [T, Hkv, D] rotated
  if (norms.size() == 4) {  // Qwen3: each head RMS-normed (q_norm, k_norm) before the rotation
    q = tandem_native::rotary(tandem_native::rms_norm(qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim}),
                                                      norms[2], eps),
                              positions, cos, sin, rotary_dim, interleaved);
    k = tandem_native::rotary(tandem_native::rms_norm(qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim}),
                                                      norms[3], eps),
                              positions, cos, sin, rotary_dim, interleaved);
  } else {  // q's and k's heads side by side in the fused projection: one rotation serves both
    const at::Tensor qk = tandem_native::rotary(
        qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads + num_kv_heads, head_dim}), positions, cos, sin,
        rotary_dim, interleaved);  // [T, Hq + Hkv, D]
    q = qk.narrow(1, 0, num_heads);
    k = qk.narrow(1, num_heads, num_kv_heads);
  }
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
  const at::Tensor k_flat = kv_cache.select(0, 0).flatten(0, 1), v_flat = kv_cache.select(0, 1).flatten(0, 1);
  const int64_t n_write = write_slots.size(0);
  if (n_write) write_kv(k, v, write_slots, k_flat, v_flat);
  // the kernel merges into out and lse (a row's key ranges by log-sum-exp): zero sums, -inf maxima to start
  at::Tensor attn = at::empty({t, num_heads, head_dim}, hidden.options());
  at::Tensor lse = at::empty({t, num_heads}, hidden.options().dtype(at::kFloat));
  std::memset(attn.data_ptr(), 0, attn.nbytes());  // all-zero bits are 0.0 in float32 and bfloat16
  std::fill_n(lse.data_ptr<float>(), lse.numel(), -std::numeric_limits<float>::infinity());
  paged_attention(q, k_flat, v_flat, block_table, rows, attn_positions, kv_cache.size(2), scale, attn, lse, -1);
  at::Tensor o = project(attn.view({t, q_size}), kinds[1], weights[1], sizes[1], c10::nullopt);
  if (biases[1].has_value() && biases[1]->defined()) o = o + *biases[1];  // after the GEMM, as the module path

  // MLP on the post-attention norm of the new residual stream
  auto [normed, summed] = tandem_native::add_rms_norm(o, hidden, norms[1], eps);
  const at::Tensor gate_up = project(normed, kinds[2], weights[2], sizes[2], biases[2]);
  at::Tensor down = project(tandem_native::silu_and_mul(gate_up), kinds[3], weights[3], sizes[3], c10::nullopt);
  if (biases[3].has_value() && biases[3]->defined()) down = down + *biases[3];
  add_into(down, summed);  // the layer's output: the residual stream plus the MLP
  return down;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_native, m) {
  m.def("gqa_decoder_layer(Tensor hidden, Tensor positions, Tensor[] norms, float eps, Tensor[] weights, int[] kinds, "
        "int[] sizes, Tensor?[] biases, Tensor cos, Tensor sin, int rotary_dim, bool interleaved, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor(a!) kv_cache, Tensor write_slots, Tensor block_table, Tensor rows, "
        "Tensor attn_positions, float scale, Tensor? attn_input=None) -> Tensor");
  m.impl("gqa_decoder_layer", torch::kCPU, &gqa_decoder_layer);
}
