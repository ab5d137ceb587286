// Weight-only int4 matrix product on Intel AMX (bf16 tiles), built with cpu_kernels.cpp.
//
//   y[M, N] = x[M, K] @ W^T,   W[n, k] = (q[n, k] - 8) * s[n, k / 32] + z[n, k / 32]
//
// x, y bfloat16 (uint16 storage) with row strides ldx, ldy (elements); q in 0..15, s and z bfloat16
// (quant.py's Int4Linear: asymmetric groups of 32 inputs).  The weight is dequantized on the vector
// units into bf16 tiles in the VNNI layout AMX's TDPBF16PS reads (Intel SDM vol. 2, "TDPBF16PS";
// Intel Optimization Reference Manual, ch. "Intel AMX"), then multiplied on the tile unit with
// float32 accumulation; y is rounded to nearest even.  Dequantization reproduces quant.py's
// ``dequantize()`` bit for bit ((q - 8) * s is exact in float32, so one FMA rounds as torch's
// multiply-then-add does), so this product equals ``F.linear(x, dequantize().bfloat16())`` up to
// float32 summation order.
//
// Packed weight (quant.py ``pack_int4_amx``), tiles ordered [N / 16][K / 32]:
//   qw  256 bytes per tile: row r (k pair, 0..15) is 16 bytes; byte j holds element j in its low
//       nibble and element j + 16 in its high nibble, where element e of row r is
//       W[n0 + e / 2][k0 + 2 r + e % 2] (the VNNI pairing of two consecutive k per column).
//   sz  32 bf16 per tile: the 16 columns' scales, then their 16 zeros.
//
// Work split: strips of two 16-column tiles (32 outputs) over all K; see int4_gemm.  Row tails
// are copied into a thread-local 32-row block.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ACTORSERVE_AMX 1
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec
#endif

#if defined(ACTORSERVE_AMX)
// Loads an AMX tile configuration of 8 tiles, each 16 rows of 64 bytes (palette 1; Intel SDM vol. 2,
// LDTILECFG), into the calling thread.  Shared with prefill_attention.cpp.
// (A constant in memory, not a stack struct: with a local struct, GCC 12 -O3 emitted LDTILECFG on a
// stack slot whose initializing stores it had dropped, and the invalid config faulted: SIGSEGV.)
alignas(64) static const uint8_t kTileConfig16x64[64] = {
    1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,          // palette 1, start row 0, reserved
    64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0,  // colsb[0..7] = 64 (uint16, little endian)
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,          // colsb[8..15] unused
    16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0,  // rows[0..7] = 16
};

extern "C" void actorserve_amx_configure_16x64() { _tile_loadconfig(kTileConfig16x64); }

namespace {

constexpr int kTileBytes = 1024;  // 16 rows x 64 bytes
constexpr int kMaxK = 16384;

// Tiles 0-3: C[m-tile][n-tile] (float32 16 x 16); 4-5: A (x rows, 16 x 32 bf16); 6-7: B (VNNI).
void configure_tiles() { actorserve_amx_configure_16x64(); }

bool request_amx_permission() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// One 16x32 int4 tile -> 1024 bytes of bf16 in VNNI order at ``dst``.
inline void dequant_tile(const uint8_t* q, const uint16_t* sz, uint16_t* dst) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512 s = bf16x16_to_f32(sz), z = bf16x16_to_f32(sz + 16);
  const __m512 s_lo = _mm512_permutexvar_ps(lo_idx, s), s_hi = _mm512_permutexvar_ps(hi_idx, s);
  const __m512 z_lo = _mm512_permutexvar_ps(lo_idx, z), z_hi = _mm512_permutexvar_ps(hi_idx, z);
  const __m512i mask = _mm512_set1_epi32(0xf), eight = _mm512_set1_epi32(8);
  for (int r = 0; r < 16; ++r) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * r)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, mask), eight));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, z_hi), _mm512_fmadd_ps(lo, s_lo, z_lo));
    _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 32 * r), (__m512i)w);
  }
}

// 16 float32 -> bf16, nearest even (NaN kept quiet).
inline void store_bf16(uint16_t* dst, const float* src) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
}

inline __m512 round_bf16(__m512 x) {  // to bf16 (nearest even), widened back to float32
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// SwiGLU epilogue of one output row: gate = c[0:16], up = c[16:32] (each rounded to bf16 as the
// unfused product's output is) -> bf16(bf16(silu(gate)) * up), the expression of cpu_kernels.cpp's
// silu_mul (silu(x) = x / (1 + exp(-x)) in float32), except that VCVTNEPS2BF16 flushes subnormal
// results to zero.
inline void store_swiglu(uint16_t* dst, const float* c) {
  const __m512 g = round_bf16(_mm512_load_ps(c)), u = round_bf16(_mm512_load_ps(c + 16));
  const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 sg = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sg, u)));
}

// C tiles of one 32-row block (rows valid) -> y: 32 (or 16) columns, or with ``swiglu`` the 16
// columns of silu(gate) * up of a strip whose tiles are 16 gate then 16 up columns.
void store_block(uint16_t* y, int64_t ldy, int rows, int n_tiles, bool swiglu) {
  alignas(64) float c[32][32];
  _tile_stored(0, &c[0][0], 128);
  if (n_tiles == 2) _tile_stored(1, &c[0][16], 128);
  if (rows > 16) {
    _tile_stored(2, &c[16][0], 128);
    if (n_tiles == 2) _tile_stored(3, &c[16][16], 128);
  }
  for (int r = 0; r < rows; ++r) {
    if (swiglu) {
      store_swiglu(y + r * ldy, c[r]);
      continue;
    }
    store_bf16(y + r * ldy, c[r]);
    if (n_tiles == 2) store_bf16(y + r * ldy + 16, c[r] + 16);
  }
}

// One 32-row block of x (``a`` with row stride lda, ``rows`` valid and >= 16 readable when rows > 16)
// against the dequantized strip ``b`` (kb x n_tiles tiles).
void block_product(const uint16_t* a, int64_t lda, int rows, const uint16_t* b, int kb, int n_tiles) {
  const bool two_m = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int k = 0; k < kb; ++k) {
    const uint16_t* bk = b + static_cast<size_t>(k) * n_tiles * (kTileBytes / 2);
    _tile_loadd(4, a + 32 * k, lda * 2);
    if (two_m) _tile_loadd(5, a + 16 * lda + 32 * k, lda * 2);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_m) _tile_dpbf16ps(2, 5, 6);
    if (n_tiles == 2) {
      _tile_loadd(7, bk + kTileBytes / 2, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two_m) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Software prefetch of the tile 8 ahead (2 KiB of weight, 512 bytes of scales): the packed weight
// is read once per product, and the hardware prefetcher alone left the few-row products at about
// half of DRAM bandwidth (30-layer pass at 1 row: 11.1 -> 6.5 ms).  Prefetches never fault, so
// reading past the end is harmless.
inline void prefetch_ahead(const uint8_t* q, const uint16_t* sz) {
  for (int line = 0; line < 256; line += 64) _mm_prefetch(reinterpret_cast<const char*>(q + 2048 + line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sz + 8 * 32), _MM_HINT_T0);
}

// Dequantize strip ``s`` (tiles 2s and 2s + 1 over all K) into ``dst`` [kb][n_tiles][512].
void dequant_strip(const uint8_t* qw, const uint16_t* sz, int s, int n_tiles, int kb, uint16_t* dst) {
  for (int t = 0; t < n_tiles; ++t)
    for (int k = 0; k < kb; ++k) {
      const size_t tile = static_cast<size_t>(2 * s + t) * kb + k;
      prefetch_ahead(qw + tile * 256, sz + tile * 32);
      dequant_tile(qw + tile * 256, sz + tile * 32, dst + (static_cast<size_t>(k) * n_tiles + t) * 512);
    }
}

inline uint16_t* align64(std::vector<uint16_t>& v, size_t elems) {
  if (v.size() < elems + 32) v.resize(elems + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

struct Problem {
  const uint16_t* x;
  int64_t ldx;
  uint16_t* y;
  int64_t ldy;
  int M, N, K;
  const uint16_t* tail;  // rows [tail_m0, M) zero-padded to 32, or nullptr when M % 32 is 0 or 16
  int tail_m0;
  bool swiglu;  // y [M, N / 2] = silu(gate) * up, strips packed as 16 gate + 16 up rows of W
};

// Rows [m_begin, m_end) of strip ``s`` against its dequantized tiles ``b``.
void strip_rows(const Problem& p, int s, const uint16_t* b, int m_begin, int m_end) {
  const int n_tiles = (2 * s + 1 < p.N / 16) ? 2 : 1;
  for (int m0 = m_begin; m0 < m_end; m0 += 32) {
    const int rows = p.M - m0 < 32 ? p.M - m0 : 32;
    const bool padded = p.tail != nullptr && m0 == p.tail_m0;
    block_product(padded ? p.tail : p.x + m0 * p.ldx, padded ? p.K : p.ldx, rows, b, p.K / 32, n_tiles);
    store_block(p.y + m0 * p.ldy + (p.swiglu ? 16 : 32) * s, p.ldy, rows, n_tiles, p.swiglu);
  }
}

// Up to kChunkRows rows: each thread dequantizes a strip into its own buffer (L1/L2) and runs every
// row block against it.  More rows: the whole weight is dequantized once into a buffer shared by
// the threads (at most 3.5 MiB here), then (row chunk, strip) pairs are shared out, so the chunk
// of x each strip re-reads stays in L2 (512 x 576 bf16 = 576 KiB) and no strip is dequantized
// twice.  Measured per 30-layer pass of this model's 4 shapes (ms, min of 5, 2 threads): 512 rows
// 76.7 with one chunk against 86.6 with 256-row chunks; 2048 rows 334.6 with 512-row chunks,
// 339.3 with 256, 463.4 unchunked (oneDNN on a dense bf16 copy: ~250-280).
constexpr int kChunkRows = 512;

void int4_gemm(const uint16_t* x, int64_t ldx, const uint8_t* qw, const uint16_t* sz, uint16_t* y, int64_t ldy,
               int M, int N, int K, bool swiglu) {
  const int kb = K / 32, strips = (N / 16 + 1) / 2, chunks = (M + kChunkRows - 1) / kChunkRows;
  const size_t strip_elems = static_cast<size_t>(kb) * 1024;
  static thread_local std::vector<uint16_t> shared_buf;  // the caller's; read by the team below
  uint16_t* shared = chunks > 1 ? align64(shared_buf, strip_elems * strips) : nullptr;
  const int tail_m0 = M / 32 * 32, tail_rows = M - tail_m0;
#pragma omp parallel
  {
    configure_tiles();
    static thread_local std::vector<uint16_t> strip_buf, tail_buf;  // kept across calls
    Problem p{x, ldx, y, ldy, M, N, K, nullptr, tail_m0, swiglu};
    if (tail_rows != 0 && tail_rows != 16) {  // rows past the tail are never stored: left as they are
      uint16_t* t = align64(tail_buf, static_cast<size_t>(32) * K);
      for (int r = 0; r < tail_rows; ++r)
        std::memcpy(t + static_cast<size_t>(r) * K, x + (tail_m0 + r) * ldx, 2 * static_cast<size_t>(K));
      p.tail = t;
    }
    if (shared == nullptr) {
      uint16_t* strip = align64(strip_buf, strip_elems);
#pragma omp for schedule(static)
      for (int s = 0; s < strips; ++s) {
        dequant_strip(qw, sz, s, (2 * s + 1 < N / 16) ? 2 : 1, kb, strip);
        strip_rows(p, s, strip, 0, M);
      }
    } else {
#pragma omp for schedule(static)
      for (int s = 0; s < strips; ++s) dequant_strip(qw, sz, s, (2 * s + 1 < N / 16) ? 2 : 1, kb, shared + s * strip_elems);
#pragma omp for schedule(static) collapse(2)
      for (int c = 0; c < chunks; ++c)
        for (int s = 0; s < strips; ++s)
          strip_rows(p, s, shared + s * strip_elems, c * kChunkRows, std::min(M, (c + 1) * kChunkRows));
    }
    _tile_release();
  }
}

// ---- One or two rows (M <= kSmallRows): no AMX, no dequantized copy.  The group's scale and zero are
// factored out of the sum (y = sum_g s_g * sum_{k in g} x_k (q_k - 8) + z_g * sum_{k in g} x_k),
// q - 8 (an integer in -8..7, exact in bf16) is looked up 32 lanes at a time (VPERMW), and
// VDPBF16PS sums x * (q - 8) over each k pair.  Per weight: 4 vector ops for 32 weights plus one
// VDPBF16PS per row of x, against ~11 ops and a store + tile load on the AMX path, which at these
// sizes is bound by dequantization.  Weights are thus not rounded to bf16 first: results differ
// from the AMX path by float32 summation order and that rounding (tests: 2 bf16 steps).  30-layer
// pass, ms, min of 5 (this path / AMX): 1 row 6.3 / 9.4; 2 rows 7.7 / 9.4; 3 rows 9.6 / 9.8;
// 4 rows 10.9 / 9.7.
constexpr int kSmallRows = 2;

// acc[m] (16 columns of tile ``tile``) for the M rows of x; xsum [M][K / 32] group sums of x.
void small_tile(const uint16_t* x, int64_t ldx, const float* xsum, const uint8_t* qw, const uint16_t* sz, int tile,
                int M, int kb, __m512* acc) {
  // lanes 0-15 take their byte's low nibble, lanes 16-31 (the same bytes) its high nibble; VPERMW
  // reads only an index's low 5 bits, so the table repeats over i & 16.
  const __m512i shift4 = _mm512_mask_blend_epi16(0xffff0000u, _mm512_setzero_si512(), _mm512_set1_epi16(4));
  alignas(64) static const int16_t table_bits[32] = {
      // bf16 of (i & 15) - 8 for i in 0..31
      static_cast<int16_t>(0xc100), static_cast<int16_t>(0xc0e0), static_cast<int16_t>(0xc0c0),
      static_cast<int16_t>(0xc0a0), static_cast<int16_t>(0xc080), static_cast<int16_t>(0xc040),
      static_cast<int16_t>(0xc000), static_cast<int16_t>(0xbf80), 0, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
      0x40e0, static_cast<int16_t>(0xc100), static_cast<int16_t>(0xc0e0), static_cast<int16_t>(0xc0c0),
      static_cast<int16_t>(0xc0a0), static_cast<int16_t>(0xc080), static_cast<int16_t>(0xc040),
      static_cast<int16_t>(0xc000), static_cast<int16_t>(0xbf80), 0, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
      0x40e0};
  const __m512i table = _mm512_load_si512(table_bits);
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int k = 0; k < kb; ++k) {
    const size_t t = static_cast<size_t>(tile) * kb + k;
    const uint8_t* q = qw + t * 256;
    prefetch_ahead(q, sz + t * 32);
    // kChains independent sums per row of x (rows r of the tile round-robin): VDPBF16PS's latency,
    // not its throughput, would bound one chain of 16.
    constexpr int kChains = 4;
    __m512 part[kSmallRows][kChains];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kChains; ++c) part[m][c] = _mm512_setzero_ps();
    for (int r = 0; r < 16; ++r) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * r))));
      const __m512i w = _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shift4), table);
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * ldx + 32 * k + 2 * r, 4);
        part[m][r % kChains] =
            _mm512_dpbf16_ps(part[m][r % kChains], (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
      }
    }
    const __m512 s = bf16x16_to_f32(sz + t * 32), z = bf16x16_to_f32(sz + t * 32 + 16);
    for (int m = 0; m < M; ++m) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[m][0], part[m][1]), _mm512_add_ps(part[m][2], part[m][3]));
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * kb + k]), z, _mm512_fmadd_ps(sum, s, acc[m]));
    }
  }
}

void small_gemm(const uint16_t* x, int64_t ldx, const uint8_t* qw, const uint16_t* sz, uint16_t* y, int64_t ldy,
                int M, int N, int K, bool swiglu) {
  const int kb = K / 32, tiles = N / 16;
  float xsum[kSmallRows * (kMaxK / 32)];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < kb; ++k) {
      const uint16_t* g = x + m * ldx + 32 * k;
      xsum[m * kb + k] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_f32(g), bf16x16_to_f32(g + 16)));
    }
  const int units = swiglu ? tiles / 2 : tiles;  // swiglu: a unit is a gate tile and its up tile
#pragma omp parallel for schedule(static)
  for (int u = 0; u < units; ++u) {
    __m512 acc[kSmallRows], acc_up[kSmallRows];
    alignas(64) float c[32];
    small_tile(x, ldx, xsum, qw, sz, swiglu ? 2 * u : u, M, kb, acc);
    if (swiglu) small_tile(x, ldx, xsum, qw, sz, 2 * u + 1, M, kb, acc_up);
    for (int m = 0; m < M; ++m) {
      _mm512_store_ps(c, acc[m]);
      if (swiglu) {
        _mm512_store_ps(c + 16, acc_up[m]);
        store_swiglu(y + m * ldy + 16 * u, c);
      } else {
        store_bf16(y + m * ldy + 16 * u, c);
      }
    }
  }
}

}  // namespace
#endif

// 1 where this build has AMX-BF16 and Linux granted the process AMX tile data, else 0.
extern "C" int actorserve_amx_available() {
#if defined(ACTORSERVE_AMX)
  static const bool permitted = request_amx_permission();
  return permitted ? 1 : 0;
#else
  return 0;
#endif
}

// 0: done; 1: shapes refused (N % 16, K % 32, K > 16384); 2: no AMX on this build or CPU.
// ``swiglu`` 1: y [M, N / 2] = silu(gate) * up (store_swiglu), N % 32 == 0, W's rows in strips of
// 16 gate rows then the 16 matching up rows (quant.py AmxInt4Linear(swiglu=True)).
extern "C" int actorserve_int4_linear(const void* x, int64_t ldx, const void* qw, const void* sz, void* y, int64_t ldy,
                                      int M, int N, int K, int swiglu) {
#if defined(ACTORSERVE_AMX)
  if (actorserve_amx_available() != 1) return 2;
  if (N % 16 != 0 || K % 32 != 0 || K > kMaxK || M < 1 || (swiglu && N % 32 != 0)) return 1;
  auto* product = M <= kSmallRows ? small_gemm : int4_gemm;
  product(static_cast<const uint16_t*>(x), ldx, static_cast<const uint8_t*>(qw), static_cast<const uint16_t*>(sz),
          static_cast<uint16_t*>(y), ldy, M, N, K, swiglu != 0);
  return 0;
#else
  (void)x, (void)ldx, (void)qw, (void)sz, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)swiglu;
  return 2;
#endif
}
