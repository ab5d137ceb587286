// The whole-step decode (issue [24] item 3; engine/whole_step.py): every layer of a small all-decode step in one
// call, on buffers the caller preallocates. Each layer runs exactly the native path of model.py
// `_layers_native` -- residual add + RMSNorm, the fused QKV product, RoPE with the K/V cache write, paged decode
// attention, the output product, residual add + RMSNorm, the gate/up product, SwiGLU, the down product -- through
// the same entry points, so the logits are bit-identical to it; what goes is the ~9 Python calls a layer (argument
// checks, tensor allocations, ctypes conversions: ~1-2 ms of host time a token at one row, decision 0053).
//
// The four products are block products (csrc/qgemm.cpp) given as function pointers: each projection runs the
// build its row table picked for the step's row count (engine/row_kernels.py), which may be another library's
// (the AVX2 build at one row, the AVX-512 one above).
#include <cstdint>

#include "bf16.h"

using namespace actorserve;

extern "C" int actorserve_add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t rows,
                                       int d, float eps);
extern "C" int actorserve_rope_kv(int dtype, void* qkv, int64_t row_stride, int64_t n, int H, int Hkv, int hd,
                                  const int64_t* pos, const float* cos, const float* sin, const int64_t* slots,
                                  void* kc, void* vc);
extern "C" int actorserve_paged_decode_attention(int dtype, const void* q, int64_t q_row_stride, void* out,
                                                 int64_t out_row_stride, const void* k, const void* v,
                                                 const int32_t* rows, const int32_t* tables, int64_t table_stride,
                                                 const int32_t* lens, int num_seqs, int H, int Hkv, int hd, int bs,
                                                 float scale, int window, float softcap);
extern "C" int actorserve_silu_mul(int dtype, const void* gu, void* out, int64_t rows, int f);

typedef int (*QgemmFn)(int dtype, int bits, const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int M,
                       int N, int K);

extern "C" {

// One block-quantized projection: y [T, n] = x [T, k] @ W^T by `fn` (an actorserve_qgemm of some build).
struct DecodeProj {
  QgemmFn fn;
  const void* w;  // the pack (uint8 [n / 16, k / 32, block bytes])
  int32_t bits;   // 4 (Q4_1 form) or 8 (Q8_0 form)
  int32_t n;      // output features
};

// One layer's weights and KV cache (K and V [num_blocks, bs, Hkv, hd], contiguous, the model's dtype).
struct DecodeLayer {
  const void* attn_norm;  // [d]
  const void* ffn_norm;   // [d]
  DecodeProj qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
};

// The step: its rows, the model's shape, the attention plan and the scratch buffers (each [T, width] contiguous).
struct DecodeStep {
  int32_t T, d, H, Hkv, hd, f, bs, window;
  float eps, scale;
  const int64_t* pos;    // [T] positions
  const int64_t* slots;  // [T] KV slots written
  const float* cos;      // [max_pos, hd] float32
  const float* sin;
  const int32_t* rows;    // [T] attention rows (decodes)
  const int32_t* tables;  // [T, table_stride] block tables
  int64_t table_stride;
  const int32_t* lens;  // [T] context lengths
  void* qkv;            // [T, (H + 2 Hkv) hd]
  void* attn;           // [T, H hd]
  void* x;              // [T, d]
  void* gu;             // [T, 2 f]
  void* act;            // [T, f]
  void* delta;          // [T, d]
};

}  // extern "C"

namespace {

template <typename T>
void add_rows(T* h, const T* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(&h[i], to_f32(h[i]) + to_f32(delta[i]));  // torch's h.add_(delta)
}

int product(int dtype, const DecodeProj& p, const void* x, int k, void* y, int T) {
  return p.fn(dtype, p.bits, x, k, p.w, y, p.n, T, p.n, k);
}

int layer(int dtype, void* h, const void* delta, const DecodeLayer& L, const DecodeStep& s) {
  const int nqkv = (s.H + 2 * s.Hkv) * s.hd, na = s.H * s.hd;
  int rc = actorserve_add_rms_norm(dtype, h, delta, L.attn_norm, s.x, s.T, s.d, s.eps);
  if (!rc) rc = product(dtype, L.qkv, s.x, s.d, s.qkv, s.T);
  if (!rc) rc = actorserve_rope_kv(dtype, s.qkv, nqkv, s.T, s.H, s.Hkv, s.hd, s.pos, s.cos, s.sin, s.slots,
                                   L.k_cache, L.v_cache);
  if (!rc) rc = actorserve_paged_decode_attention(dtype, s.qkv, nqkv, s.attn, na, L.k_cache, L.v_cache, s.rows,
                                                  s.tables, s.table_stride, s.lens, s.T, s.H, s.Hkv, s.hd, s.bs,
                                                  s.scale, s.window, 0.f);
  if (!rc) rc = product(dtype, L.o, s.attn, na, s.delta, s.T);
  if (!rc) rc = actorserve_add_rms_norm(dtype, h, s.delta, L.ffn_norm, s.x, s.T, s.d, s.eps);
  if (!rc) rc = product(dtype, L.gate_up, s.x, s.d, s.gu, s.T);
  if (!rc) rc = actorserve_silu_mul(dtype, s.gu, s.act, s.T, s.f);
  if (!rc) rc = product(dtype, L.down, s.act, s.f, s.delta, s.T);
  return rc;
}

}  // namespace

// Every layer of the step on the hidden states h [T, d] (updated in place: h after the last layer's residual
// add). dtype 0 float32, 1 bfloat16. Returns 0; 1 on bad sizes; else the failing kernel's code + 10 * (layer + 1).
extern "C" int actorserve_decode_layers(int dtype, void* h, int n_layers, const DecodeLayer* layers,
                                        const DecodeStep* s) {
  if ((dtype != 0 && dtype != 1) || n_layers <= 0 || s->T <= 0 || s->d <= 0 || s->f <= 0) return 1;
  for (int i = 0; i < n_layers; ++i) {
    int rc = layer(dtype, h, i ? s->delta : nullptr, layers[i], *s);
    if (rc) return rc + 10 * (i + 1);
  }
  const int64_t n = static_cast<int64_t>(s->T) * s->d;
  if (dtype == 0) add_rows(static_cast<float*>(h), static_cast<const float*>(s->delta), n);
  else add_rows(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(s->delta), n);
  return 0;
}
