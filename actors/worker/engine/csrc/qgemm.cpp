// Block-quantized weight x dynamically quantized int8 activation products (integer dot products),
// built with cpu_kernels.cpp.  The CPU path of quantization "int8" / "int4" where no AMX is found.
//
//   y[M, N] = x[M, K] @ W^T
//
// Weights (quant.py ``QuantLinear``) in blocks of 32 inputs, GGUF-like:
//   bits 8 (Q8_0 form):  W[n, k] = d[n, b] * q[n, k],        q int8 in [-127, 127]
//   bits 4 (Q4_1 form):  W[n, k] = d[n, b] * u[n, k] + m[n, b], u in 0..15
// with b = k / 32 and d, m IEEE half.  Activations are quantized here per row and per block of 32
// (symmetric, as GGUF's Q8_0): dx = max|x| / 127, xq = round_half_even(x * (1 / dx)), and
// xs = sum(xq) over the block.  Per output, blocks are summed in order b = 0, 1, ...:
//   bits 8:  acc += (float(dot(q, xq)) * dx) * d
//   bits 4:  acc += (float(dot(u, xq)) * dx) * d;  acc += m * (dx * xs)
// (each "+=" one fused multiply-add, the products in the bracket rounded as written), so the
// AVX-512 VNNI, AVX2 and portable paths give the same bits (tests/unit/test_qgemm.py).
//
// Packed weight, tiles of 16 outputs ordered [N / 16][K / 32], one tile of bs bytes
// (bits 8: 544, bits 4: 320):
//   bits 8: 8 groups of 4 inputs; group g is 64 bytes: output r's bytes u[r][4g .. 4g + 3], u = q + 128
//   bits 4: 4 chunks of 64 bytes; chunk c byte 4 r + j = u(group c)[r][j] | u(group c + 4)[r][j] << 4
//   then 16 half d (32 bytes), and for bits 4, 16 half m (32 bytes).
// This is the layout VPDPBUSD (Intel SDM vol. 2, "VPDPBUSD") reads with one broadcast dword of x:
// 16 outputs x 4 inputs per instruction, no horizontal sums.  u8 operand = the weight (q + 128 or
// u), s8 operand = x; the +128 offset is removed exactly with xs (bits 8).  AVX2 has no VPDPBUSD:
// VPMADDUBSW + VPMADDWD (pairs then quads), with |w| and sign(x, w) for bits 8 so that no int16
// pair sum saturates (127 * 127 * 2 < 2^15); bits 4 multiply u <= 15 directly.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QG_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_ISA 1
#else
#define QG_ISA 0
#endif

namespace {

constexpr int kBlock = 32;

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept quiet)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float half_to_f32(uint16_t h) {  // IEEE binary16 -> float32 (exact)
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (man << 13);
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    u = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  } else {
    u = sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One block of 32 inputs of one row -> 32 int8, its scale dx and sum xs.  x float32 or bf16.
template <typename T>
inline float load_x(const T* p, int i) {
  if constexpr (sizeof(T) == 4) return p[i];
  else return bf16_to_f32(p[i]);
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float* dx, int32_t* xs) {
  float amax = 0.f, v[kBlock];
  for (int i = 0; i < kBlock; ++i) {
    v[i] = load_x(x, i);
    amax = std::fmax(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
  int32_t s = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int r = int(std::nearbyint(v[i] * inv));  // default rounding mode: half to even
    q[i] = int8_t(r);
    s += r;
  }
  *dx = d;
  *xs = s;
}

template <typename T>
inline void store_y(T* y, float v) {
  if constexpr (sizeof(T) == 4) *y = v;
  else *y = f32_to_bf16(v);
}

struct Acts {  // quantized activations: row r, block b
  const int8_t* q;  // [M, K]
  const float* dx;  // [M, KB]
  const int32_t* xs;  // [M, KB]
  int K, KB;
};

// ---------------------------------------------------------------------------------- portable
template <int BITS, typename T>
void tile_portable(const uint8_t* w, int bs, const Acts& a, int m0, int rows, T* y, int64_t ldy, int n0) {
  const int QB = BITS == 8 ? 512 : 256;
  for (int r = m0; r < m0 + rows; ++r) {
    float acc[16] = {};
    for (int b = 0; b < a.KB; ++b) {
      const uint8_t* blk = w + int64_t(b) * bs;
      const int8_t* xq = a.q + int64_t(r) * a.K + b * kBlock;
      const float dx = a.dx[int64_t(r) * a.KB + b];
      const int32_t xs = a.xs[int64_t(r) * a.KB + b];
      const uint16_t* hd = reinterpret_cast<const uint16_t*>(blk + QB);
      for (int o = 0; o < 16; ++o) {
        int32_t dot = 0;
        for (int g = 0; g < 8; ++g) {
          for (int j = 0; j < 4; ++j) {
            int u;
            if (BITS == 8) {
              u = blk[64 * g + 4 * o + j];
            } else {
              const uint8_t byte = blk[64 * (g & 3) + 4 * o + j];
              u = g < 4 ? byte & 15 : byte >> 4;
            }
            dot += u * xq[4 * g + j];
          }
        }
        if (BITS == 8) dot -= 128 * xs;
        acc[o] = std::fma(float(dot) * dx, half_to_f32(hd[o]), acc[o]);
        if (BITS == 4) acc[o] = std::fma(half_to_f32(hd[16 + o]), dx * float(xs), acc[o]);
      }
    }
    for (int o = 0; o < 16; ++o) store_y(y + int64_t(r) * ldy + n0 + o, acc[o]);
  }
}

#if QG_ISA == 2
// ------------------------------------------------------------------------------ AVX-512 VNNI
template <typename T>
inline void store16(T* y, __m512 v) {
  if constexpr (sizeof(T) == 4) {
    _mm512_storeu_ps(y, v);
  } else {
    alignas(64) float t[16];
    _mm512_store_ps(t, v);
    for (int i = 0; i < 16; ++i) y[i] = f32_to_bf16(t[i]);
  }
}

// R rows (R <= 8) against one tile of 16 outputs over all of K.
template <int BITS, int R, typename T>
void tile_rows(const uint8_t* w, int bs, const Acts& a, int m0, T* y, int64_t ldy, int n0) {
  const int QB = BITS == 8 ? 512 : 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < a.KB; ++b) {
    const uint8_t* blk = w + int64_t(b) * bs;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * bs), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * bs + 64 * 4), _MM_HINT_T0);
    __m512i wv[8];
    if constexpr (BITS == 8) {
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_loadu_si512(blk + 64 * g);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        wv[c] = _mm512_and_si512(v, low);
        wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QB)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (BITS == 4) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QB + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * kBlock);
      const float dx = a.dx[row * a.KB + b];
      const int32_t xs = a.xs[row * a.KB + b];
      __m512i ia = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) ia = _mm512_dpbusd_epi32(ia, wv[g], _mm512_set1_epi32(xq[g]));
      if constexpr (BITS == 8) ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(128 * xs));
      const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(dx));
      acc[r] = _mm512_fmadd_ps(p, d, acc[r]);
      if constexpr (BITS == 4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * float(xs)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + int64_t(m0 + r) * ldy + n0, acc[r]);
}

template <typename T>
void quantize_row(const T* x, int K, int8_t* q, float* dx, int32_t* xs) {
  for (int b = 0; b < K / kBlock; ++b) {
    __m512 v0, v1;
    if constexpr (sizeof(T) == 4) {
      v0 = _mm512_loadu_ps(x + b * kBlock);
      v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    } else {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(x) + b * kBlock;
      v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
      v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16))), 16));
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = d;
    xs[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}
#elif QG_ISA == 1
// -------------------------------------------------------------------------------------- AVX2
template <typename T>
inline void store8(T* y, __m256 v) {
  if constexpr (sizeof(T) == 4) {
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    for (int i = 0; i < 8; ++i) y[i] = f32_to_bf16(t[i]);
  }
}

// R rows (R <= 4) against one tile of 16 outputs (two halves of 8) over all of K.
template <int BITS, int R, typename T>
void tile_rows(const uint8_t* w, int bs, const Acts& a, int m0, T* y, int64_t ldy, int n0) {
  const int QB = BITS == 8 ? 512 : 256;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int b = 0; b < a.KB; ++b) {
    const uint8_t* blk = w + int64_t(b) * bs;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * bs), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * bs + 64 * 4), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
      __m256i wv[8];
      if constexpr (BITS == 8) {  // signed q = u ^ 0x80
        for (int g = 0; g < 8; ++g)
          wv[g] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * h)), flip);
      } else {
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
          wv[c] = _mm256_and_si256(v, low);
          wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QB + 16 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (BITS == 4) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QB + 32 + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * kBlock);
        const float dx = a.dx[row * a.KB + b];
        const int32_t xs = a.xs[row * a.KB + b];
        __m256i ia = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i xb = _mm256_set1_epi32(xq[g]);
          __m256i p16;
          if constexpr (BITS == 8) p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wv[g], wv[g]), _mm256_sign_epi8(xb, wv[g]));
          else p16 = _mm256_maddubs_epi16(wv[g], xb);
          ia = _mm256_add_epi32(ia, _mm256_madd_epi16(p16, ones));
        }
        // bits 8: ia is already dot(q, xq) = dot(u, xq) - 128 xs
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(dx));
        acc[r][h] = _mm256_fmadd_ps(p, d, acc[r][h]);
        if constexpr (BITS == 4) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * float(xs)), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store8(y + int64_t(m0 + r) * ldy + n0, acc[r][0]);
    store8(y + int64_t(m0 + r) * ldy + n0 + 8, acc[r][1]);
  }
}

template <typename T>
void quantize_row(const T* x, int K, int8_t* q, float* dx, int32_t* xs) {
  for (int b = 0; b < K / kBlock; ++b) quantize_block(x + b * kBlock, q + b * kBlock, dx + b, xs + b);
}
#else
template <typename T>
void quantize_row(const T* x, int K, int8_t* q, float* dx, int32_t* xs) {
  for (int b = 0; b < K / kBlock; ++b) quantize_block(x + b * kBlock, q + b * kBlock, dx + b, xs + b);
}
#endif

#if QG_ISA >= 1
// Rows of x per pass over a tile's weights (their accumulators stay in registers: 32 zmm, 16 ymm).
constexpr int kMaxR = QG_ISA == 2 ? 8 : 4;

template <int BITS, int R, typename T>
void tail_rows(const uint8_t* w, int bs, const Acts& a, int m0, int rows, T* y, int64_t ldy, int n0) {
  if constexpr (R > 0) {
    if (rows == R) tile_rows<BITS, R>(w, bs, a, m0, y, ldy, n0);
    else tail_rows<BITS, R - 1>(w, bs, a, m0, rows, y, ldy, n0);
  }
}
#endif

template <int BITS, typename T>
void tile(const uint8_t* w, int bs, const Acts& a, int m0, int rows, T* y, int64_t ldy, int n0) {
#if QG_ISA >= 1
  int r = 0;
  for (; r + kMaxR <= rows; r += kMaxR) tile_rows<BITS, kMaxR>(w, bs, a, m0 + r, y, ldy, n0);
  tail_rows<BITS, kMaxR - 1>(w, bs, a, m0 + r, rows - r, y, ldy, n0);
#else
  tile_portable<BITS>(w, bs, a, m0, rows, y, ldy, n0);
#endif
}

constexpr int kRowChunk = 64;  // rows of x per task: their int8 copy stays in L2 across tiles

template <int BITS, typename T>
void qgemm(const T* x, int64_t ldx, const uint8_t* w, T* y, int64_t ldy, int M, int N, int K) {
  const int KB = K / kBlock, bs = BITS == 8 ? 544 : 320, nt = N / 16, mc = (M + kRowChunk - 1) / kRowChunk;
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> dbuf;
  thread_local std::vector<int32_t> sbuf;
  qbuf.resize(size_t(M) * K);
  dbuf.resize(size_t(M) * KB);
  sbuf.resize(size_t(M) * KB);
  int8_t* q = qbuf.data();
  float* dx = dbuf.data();
  int32_t* xs = sbuf.data();
  const Acts a{q, dx, xs, K, KB};
  const int64_t tasks = int64_t(mc) * nt;
#pragma omp parallel if (tasks > 1)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < M; ++r)
      quantize_row(x + r * ldx, K, q + int64_t(r) * K, dx + int64_t(r) * KB, xs + int64_t(r) * KB);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int c = int(t / nt), n = int(t % nt), m0 = c * kRowChunk;
      const int rows = M - m0 < kRowChunk ? M - m0 : kRowChunk;
      tile<BITS>(w + int64_t(n) * KB * bs, bs, a, m0, rows, y, ldy, 16 * n);
    }
  }
}

}  // namespace

extern "C" {

// Which path this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 portable C++.
int actorserve_qgemm_isa() { return QG_ISA; }

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T for the packed weight w (layout above).
// dtype 0: x, y float32; 1: bfloat16 (uint16 storage).  Returns 0, or 1 on a shape it cannot run
// (N % 16, K % 32, bits not 4 or 8, negative sizes).
int actorserve_qgemm(int dtype, int bits, const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int M,
                     int N, int K) {
  if (M < 0 || N <= 0 || K <= 0 || N % 16 || K % kBlock || (bits != 4 && bits != 8) || (dtype != 0 && dtype != 1))
    return 1;
  if (M == 0) return 0;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (dtype == 0) {
    const auto* xf = static_cast<const float*>(x);
    auto* yf = static_cast<float*>(y);
    bits == 8 ? qgemm<8>(xf, ldx, wb, yf, ldy, M, N, K) : qgemm<4>(xf, ldx, wb, yf, ldy, M, N, K);
  } else {
    const auto* xh = static_cast<const uint16_t*>(x);
    auto* yh = static_cast<uint16_t*>(y);
    bits == 8 ? qgemm<8>(xh, ldx, wb, yh, ldy, M, N, K) : qgemm<4>(xh, ldx, wb, yh, ldy, M, N, K);
  }
  return 0;
}

}  // extern "C"
