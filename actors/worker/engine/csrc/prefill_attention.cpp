// Causal self-attention of a fresh prefill chunk on Intel AMX (bf16 tiles), built with cpu_kernels.cpp.
//
//   out[i, h] = sum_{j <= i} softmax_j(scale * q[i, h] . k[j, g]) v[j, g],   g = h / (H / Hkv)
//
// q, out: [n, H, hd] rows of stride q_rs / o_rs; k, v: [n, Hkv, hd] rows of stride kv_rs (elements,
// bfloat16 stored as uint16); hd = 64.  Flash attention's online softmax (Dao et al. 2022,
// "FlashAttention", alg. 1) over blocks of 32 keys for tiles of 16 queries of one head: S = Q K^T
// and O += P V on the tile unit (TDPBF16PS, float32 accumulation), the running max / sum and the
// rescaling of O in float32 on AVX-512; P is rounded to bf16 for the P V product, as torch's CPU
// flash kernel does for bf16 inputs.  Grouped-query attention (Ainslie et al. 2023) reads each KV
// head once into the VNNI layouts TDPBF16PS needs:
//   kt  per 16 keys and 32-wide half of hd: row r, element 2c + p = K[key0 + c][d0 + 2r + p]
//   vt  per 32 keys and 16-wide quarter of hd: row r, element 2c + p = V[key0 + 2r + p][d0 + c]
// (keys past n zero-filled and masked).  A NaN in V reaches the queries of its 32-key block that
// cannot see it (their weight 0 times NaN); SDPA's math path spreads it to every query.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ACTORSERVE_AMX_ATTN 1
extern "C" __m512 _ZGVeN16v_expf(__m512);
extern "C" int actorserve_amx_available();
extern "C" void actorserve_amx_configure_16x64();
#endif

#if defined(ACTORSERVE_AMX_ATTN)
namespace {

constexpr int kHd = 64;

// 0-1: S (16 queries x 16 keys, f32); 2-3: Q halves (16 x 32 bf16); 4: K^T tile; 5: P (16 x 32
// bf16); 6: V tile; 7: O quarter (16 x 16 f32).  Every tile is 16 rows of 64 bytes.
void configure_attention_tiles() { actorserve_amx_configure_16x64(); }

inline uint32_t pair_at(const uint16_t* row, int d) {  // bf16 elements d, d + 1 as one 32-bit word
  uint32_t w;
  std::memcpy(&w, row + d, 4);
  return w;
}

// K and V of one KV head into the VNNI layouts above (n_pad = n rounded up to 32).
void pack_kv(const uint16_t* k, const uint16_t* v, int64_t kv_rs, int n, int n_pad, uint16_t* kt, uint16_t* vt) {
#pragma omp for schedule(static)
  for (int kb = 0; kb < n_pad / 16; ++kb) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(kt + static_cast<size_t>(kb) * 2 * 512);
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
          const int key = kb * 16 + c;
          dst[half * 256 + r * 16 + c] = key < n ? pair_at(k + key * kv_rs, half * 32 + 2 * r) : 0u;
        }
  }
#pragma omp for schedule(static)
  for (int vb = 0; vb < n_pad / 32; ++vb) {
    uint16_t* dst = vt + static_cast<size_t>(vb) * 4 * 512;
    for (int quarter = 0; quarter < 4; ++quarter)
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
          for (int p = 0; p < 2; ++p) {
            const int key = vb * 32 + 2 * r + p;
            dst[quarter * 512 + r * 32 + 2 * c + p] = key < n ? v[key * kv_rs + quarter * 16 + c] : 0;
          }
  }
}

struct RowState {
  alignas(64) float o[16][kHd];
  alignas(64) float m[16];
  float l[16];
};

// Online-softmax update of the 16 rows for one block of 32 keys starting at ``key0``: S (raw
// scores, [16][32], scaled and masked in place) -> P (bf16, [16][32]); ``alpha`` = exp(m_old - m_new)
// per row, by which the caller rescales O.
void softmax_block(RowState& st, float (*s)[32], uint16_t (*p)[32], int q0, int key0, int n, float scale,
                   float* alpha) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  alignas(64) float m_new[16];
  for (int i = 0; i < 16; ++i) {
    const int limit = std::min(q0 + i, n - 1) - key0;  // last visible key of row i, relative to key0
    const __mmask16 m0 = _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(limit), _MM_CMPINT_LE);
    const __mmask16 m1 = _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(limit - 16), _MM_CMPINT_LE);
    const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, _mm512_load_ps(s[i]), vscale);
    const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, _mm512_load_ps(s[i] + 16), vscale);
    _mm512_store_ps(s[i], s0);
    _mm512_store_ps(s[i] + 16, s1);
    m_new[i] = std::max(st.m[i], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  }
  const __m512 vm_new = _mm512_load_ps(m_new);
  _mm512_storeu_ps(alpha, _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(st.m), vm_new)));  // 0 where m was -inf
  _mm512_storeu_ps(st.m, vm_new);
  for (int i = 0; i < 16; ++i) {
    const __m512 vm = _mm512_set1_ps(m_new[i]);
    const __m512 e0 = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_load_ps(s[i]), vm));
    const __m512 e1 = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_load_ps(s[i] + 16), vm));
    st.l[i] = st.l[i] * alpha[i] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p[i]), (__m256i)_mm512_cvtneps_pbh(e0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p[i] + 16), (__m256i)_mm512_cvtneps_pbh(e1));
  }
}

// One tile of 16 queries [q0, q0 + 16) of head ``h`` against its KV head's packed keys/values.
void query_tile(const uint16_t* q, int64_t q_rs, uint16_t* out, int64_t o_rs, const uint16_t* kt, const uint16_t* vt,
                int n, int h, int q0, float scale) {
  alignas(64) uint16_t qpad[16][kHd];
  alignas(64) float s[16][32], o_part[16][16];
  alignas(64) uint16_t p[16][32];
  float alpha[16];
  RowState st;
  const int rows = std::min(16, n - q0);
  const uint16_t* qrow = q + q0 * q_rs + h * kHd;
  int64_t stride = q_rs;
  if (rows < 16) {  // past n: zero queries (finite scores, never stored)
    std::memset(qpad, 0, sizeof(qpad));
    for (int i = 0; i < rows; ++i) std::memcpy(qpad[i], qrow + i * q_rs, 2 * kHd);
    qrow = &qpad[0][0];
    stride = kHd;
  }
  _tile_loadd(2, qrow, stride * 2);
  _tile_loadd(3, qrow + 32, stride * 2);
  for (int i = 0; i < 16; ++i) st.m[i] = -INFINITY, st.l[i] = 0.f;
  std::memset(st.o, 0, sizeof(st.o));
  const int kend = std::min(n, q0 + 16);
  for (int key0 = 0; key0 < kend; key0 += 32) {
    const uint16_t* kb = kt + static_cast<size_t>(key0 / 16) * 2 * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, kb, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(4, kb + 512, 64);
    _tile_dpbf16ps(0, 3, 4);
    _tile_loadd(4, kb + 1024, 64);
    _tile_dpbf16ps(1, 2, 4);
    _tile_loadd(4, kb + 1536, 64);
    _tile_dpbf16ps(1, 3, 4);
    _tile_stored(0, &s[0][0], 128);
    _tile_stored(1, &s[0][16], 128);
    softmax_block(st, s, p, q0, key0, n, scale, alpha);
    _tile_loadd(5, &p[0][0], 64);
    const uint16_t* vb = vt + static_cast<size_t>(key0 / 32) * 4 * 512;
    for (int quarter = 0; quarter < 4; ++quarter) {
      _tile_zero(7);
      _tile_loadd(6, vb + quarter * 512, 64);
      _tile_dpbf16ps(7, 5, 6);
      _tile_stored(7, &o_part[0][0], 64);
      for (int i = 0; i < 16; ++i) {
        float* o = st.o[i] + quarter * 16;
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), _mm512_set1_ps(alpha[i]), _mm512_load_ps(o_part[i])));
      }
    }
  }
  for (int i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / st.l[i]);
    uint16_t* orow = out + (q0 + i) * o_rs + h * kHd;
    for (int c = 0; c < kHd; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(st.o[i] + c), inv)));
  }
}

}  // namespace
#endif

// 0: done; 1: shapes refused (head_dim != 64, H % Hkv); 2: no AMX on this build or CPU.
extern "C" int actorserve_prefill_attention(const void* q, int64_t q_rs, const void* k, const void* v, int64_t kv_rs,
                                            void* out, int64_t o_rs, int n, int H, int Hkv, int hd, float scale) {
#if defined(ACTORSERVE_AMX_ATTN)
  if (actorserve_amx_available() != 1) return 2;
  if (hd != kHd || Hkv <= 0 || H % Hkv != 0 || n < 1) return 1;
  const int n_pad = (n + 31) / 32 * 32, G = H / Hkv, q_tiles = (n + 15) / 16;
  static thread_local std::vector<uint16_t> kt_buf, vt_buf;  // the caller's; read by the team below
  const size_t per_head = static_cast<size_t>(n_pad) * kHd;
  if (kt_buf.size() < per_head * Hkv) kt_buf.resize(per_head * Hkv), vt_buf.resize(per_head * Hkv);
  const auto* qq = static_cast<const uint16_t*>(q);
  const auto* kk = static_cast<const uint16_t*>(k);
  const auto* vv = static_cast<const uint16_t*>(v);
  auto* oo = static_cast<uint16_t*>(out);
  uint16_t* kt = kt_buf.data();  // (thread_local names the calling thread's buffers only out here)
  uint16_t* vt = vt_buf.data();
#pragma omp parallel
  {
    configure_attention_tiles();
    for (int g = 0; g < Hkv; ++g)
      pack_kv(kk + g * kHd, vv + g * kHd, kv_rs, n, n_pad, kt + g * per_head, vt + g * per_head);
    // Tasks (head, query tile), longest (last tiles: most keys) first.
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < H * q_tiles; ++t) {
      const int tile = q_tiles - 1 - t / H, h = t % H;
      query_tile(qq, q_rs, oo, o_rs, kt + (h / G) * per_head, vt + (h / G) * per_head, n, h, tile * 16, scale);
    }
    _tile_release();
  }
  return 0;
#else
  (void)q, (void)q_rs, (void)k, (void)v, (void)kv_rs, (void)out, (void)o_rs, (void)n, (void)H, (void)Hkv, (void)hd,
      (void)scale;
  return 2;
#endif
}
