// Native CPU kernels of the engine, built at run time by cpu_kernels.py (g++ -O3 -march=native
// -fopenmp) and called through ctypes with raw pointers.  dtype code 0 = float32, 1 = bfloat16
// (stored as uint16, rounded to nearest even).  Each kernel reproduces the PyTorch expression it
// replaces in model.py, roundings included, up to float32 operation order.
//
// 1. Paged decode attention: one query token per sequence against the K/V blocks it owns,
// read in place from the paged cache (no gather copy).
//
// Layouts (row-major, element = float32 or bfloat16 stored as uint16):
//   q      rows of [num_heads, head_dim]; row r starts at q + r * q_row_stride
//   out    rows of [num_heads, head_dim]; row r starts at out + r * out_row_stride
//   k, v   [num_blocks, block_size, num_kv_heads, head_dim] (one layer of the cache)
//   block_tables [num_seqs, table_stride] int32; context_lens, rows [num_seqs] int32
// Query head j uses KV head j / (num_heads / num_kv_heads) (grouped-query attention, Ainslie et
// al. 2023).  Softmax in float32 over scale * q.k, two passes (scores, then the weighted sum of V);
// bf16 output rounded to nearest even.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <omp.h>

#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// glibc's libmvec: 16 float32 exp at once (AVX-512 variant of expf, max error 4 ulp).
extern "C" __m512 _ZGVeN16v_expf(__m512);
#endif

namespace {

using actorserve::store;
using actorserve::to_f32;

// In place over each of the G rows of ``scores`` [G, ctx]: softmax (max-subtracted, float32).
// Scores of the t0 leading tokens (outside a sliding window) set to -inf: softmax gives them 0.
inline void mask_before(float* scores, int rows, int ctx, int t0) {
  for (int r = 0; r < rows && t0 > 0; ++r) std::fill(scores + static_cast<size_t>(r) * ctx, scores + static_cast<size_t>(r) * ctx + t0, -INFINITY);
}

// Attention soft-capping (Gemma 2: Gemma Team 2024, section 2): scores[r][t] -> cap * tanh(scores[r][t] / cap) for
// the unmasked tokens t0 .. ctx - 1 of each of ``rows`` rows (cap <= 0: none).  tanh(x) = sign(x) (1 - e) / (1 + e),
// e = exp(-2|x|): no overflow, and vectorised with the same libmvec expf the softmax uses.
void softcap_rows(float* scores, int rows, int ctx, int t0, float cap) {
  if (!(cap > 0.f)) return;
  const float inv = 1.f / cap;
  for (int r = 0; r < rows; ++r) {
    float* sr = scores + static_cast<size_t>(r) * ctx;
    int t = t0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(-2.f * inv), vcap = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f);
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (; t + 16 <= ctx; t += 16) {
      const __m512 x = _mm512_loadu_ps(sr + t);
      const __m512 e = _ZGVeN16v_expf(_mm512_mul_ps(_mm512_andnot_ps(sign, x), vinv));  // exp(-2|x| / cap)
      const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
      _mm512_storeu_ps(sr + t, _mm512_or_ps(_mm512_mul_ps(th, vcap), _mm512_and_ps(sign, x)));
    }
#endif
    for (; t < ctx; ++t) sr[t] = cap * std::tanh(sr[t] * inv);
  }
}

void softmax_rows(float* scores, int G, int ctx) {
  for (int g = 0; g < G; ++g) {
    float* sg = scores + static_cast<size_t>(g) * ctx;
    float m = -INFINITY, l = 0.f;
    for (int t = 0; t < ctx; ++t) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : l)
    for (int t = 0; t < ctx; ++t) {
      sg[t] = expf(sg[t] - m);
      l += sg[t];
    }
    const float inv = 1.f / l;
#pragma omp simd
    for (int t = 0; t < ctx; ++t) sg[t] *= inv;
  }
}

#if defined(__AVX512F__)
// AVX-512 path for head_dim % 16 == 0 and a query group of G <= 8 heads: 16 lanes of head_dim per
// register, the G accumulators of pass 2 kept in registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 round16(float*, __m512 x) { return x; }
inline __m512 round16(uint16_t*, __m512 x) {  // to bf16 (nearest even), returned widened
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) {  // x already bf16-exact
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}



// softmax_rows with 16 lanes at a time (tail lanes masked: they read -inf, contribute exp = 0).
void softmax_rows_avx512(float* scores, int G, int ctx) {
  for (int g = 0; g < G; ++g) {
    float* sg = scores + static_cast<size_t>(g) * ctx;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < ctx; t += 16) {
      const __mmask16 m = ctx - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (ctx - t)) - 1);
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, sg + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 lv = _mm512_setzero_ps();
    for (int t = 0; t < ctx; t += 16) {
      const __mmask16 m = ctx - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (ctx - t)) - 1);
      const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_mask_loadu_ps(mx, m, sg + t), mx));
      const __m512 ez = _mm512_maskz_mov_ps(m, e);
      lv = _mm512_add_ps(lv, ez);
      _mm512_mask_storeu_ps(sg + t, m, ez);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lv));
    for (int t = 0; t < ctx; t += 16) {
      const __mmask16 m = ctx - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (ctx - t)) - 1);
      _mm512_mask_storeu_ps(sg + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sg + t), inv));
    }
  }
}

// Heads h0 .. h0 + nh - 1 of one sequence.  Both passes walk the tokens in order and read each
// token's nh heads as one contiguous run (the whole row when nh = Hkv), so a block is streamed
// front to back; the next token's row is prefetched.  qf [nh][G][hd] (pre-scaled), scores
// [nh * G][ctx], acc [nh * G][hd] (float32).
// Tokens ahead whose K (pass 1) or V (pass 2) row is prefetched: the next row alone left 64 sequences x
// 200 tokens x 30 layers at 33.8 ms; 8 ahead 29.4 ms (16: 29.2).  Blocks are scattered, so the
// hardware prefetcher cannot run ahead across them.
constexpr int kPrefetchTokens = 8;

template <typename T, int G>
void heads_avx512(const float* qf, const T* k, const T* v, const int32_t* table, int ctx, int t0, int hd, int bs,
                  int64_t tok_stride, int h0, int nh, float* scores, float* acc, float cap) {
  const int C = hd / 16;
  mask_before(scores, nh * G, ctx, t0);
  auto row = [&](const T* base, int t) {
    return base + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * tok_stride + static_cast<int64_t>(h0) * hd;
  };
  const int run_bytes = nh * hd * static_cast<int>(sizeof(T));
  for (int t = t0; t < ctx; ++t) {  // pass 1: scores[hh * G + g][t] = q_g . k_t
    if (t + kPrefetchTokens < ctx)
      for (int off = 0; off < run_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row(k, t + kPrefetchTokens)) + off, _MM_HINT_T0);
    const T* kt = row(k, t);
    for (int hh = 0; hh < nh; ++hh) {
      __m512 a[G];
      for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m512 kk = load16(kt + hh * hd + 16 * c);
        for (int g = 0; g < G; ++g)
          a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (hh * G + g) * hd + 16 * c), kk, a[g]);
      }
      for (int g = 0; g < G; ++g) scores[static_cast<size_t>(hh * G + g) * ctx + t] = _mm512_reduce_add_ps(a[g]);
    }
  }
  softcap_rows(scores, nh * G, ctx, t0, cap);
  softmax_rows_avx512(scores, nh * G, ctx);
  for (int i = 0; i < nh * G * hd; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int t = t0; t < ctx; ++t) {  // pass 2: acc[hh * G + g] += p[hh * G + g][t] * v_t
    if (t + kPrefetchTokens < ctx)
      for (int off = 0; off < run_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row(v, t + kPrefetchTokens)) + off, _MM_HINT_T0);
    const T* vt = row(v, t);
    for (int hh = 0; hh < nh; ++hh) {
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[static_cast<size_t>(hh * G + g) * ctx + t]);
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load16(vt + hh * hd + 16 * c);
        for (int g = 0; g < G; ++g) {
          float* ag = acc + (hh * G + g) * hd + 16 * c;
          _mm512_storeu_ps(ag, _mm512_fmadd_ps(p[g], vv, _mm512_loadu_ps(ag)));
        }
      }
    }
  }
}

template <typename T>
bool heads_fast(int G, const float* qf, const T* k, const T* v, const int32_t* table, int ctx, int t0, int hd, int bs,
                int64_t tok_stride, int h0, int nh, float* scores, float* acc, float cap) {
  if (hd % 16 != 0) return false;
  switch (G) {
#define AS_CASE(n) \
    case n: heads_avx512<T, n>(qf, k, v, table, ctx, t0, hd, bs, tok_stride, h0, nh, scores, acc, cap); return true;
    AS_CASE(1) AS_CASE(2) AS_CASE(3) AS_CASE(4) AS_CASE(5) AS_CASE(6) AS_CASE(7) AS_CASE(8)
#undef AS_CASE
    default: return false;
  }
}
#else
template <typename T>
bool heads_fast(int, const float*, const T*, const T*, const int32_t*, int, int, int, int, int64_t, int, int, float*,
                float*, float) {
  return false;
}
#endif

// One head of one sequence, portable C++ (no AVX-512, or a head_dim / group size it does not cover).
template <typename T>
void head_scalar(const float* qf, const T* k, const T* v, const int32_t* table, int ctx, int t0, int G, int hd,
                 int bs, int64_t tok_stride, int h, float* scores, float* acc, float cap) {
  mask_before(scores, G, ctx, t0);
  for (int t = t0; t < ctx; ++t) {  // pass 1: scores[g][t] = q_g . k_t
    const T* kt = k + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * tok_stride + h * hd;
    for (int g = 0; g < G; ++g) {
      const float* qg = qf + g * hd;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < hd; ++d) dot += qg[d] * to_f32(kt[d]);
      scores[static_cast<size_t>(g) * ctx + t] = dot;
    }
  }
  softcap_rows(scores, G, ctx, t0, cap);
  softmax_rows(scores, G, ctx);
  std::fill(acc, acc + G * hd, 0.f);
  for (int t = t0; t < ctx; ++t) {  // pass 2: acc_g += p_g[t] * v_t
    const T* vt = v + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * tok_stride + h * hd;
    for (int g = 0; g < G; ++g) {
      const float p = scores[static_cast<size_t>(g) * ctx + t];
      float* ag = acc + g * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) ag[d] += p * to_f32(vt[d]);
    }
  }
}

// A task is one sequence (all its KV heads: blocks read front to back) when there are enough
// sequences to keep every thread busy, else one (sequence, KV head) pair.
template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, T* out, int64_t out_row_stride, const T* k,
                      const T* v, const int32_t* rows, const int32_t* tables, int64_t table_stride,
                      const int32_t* lens, int num_seqs, int H, int Hkv, int hd, int bs, float scale, int window,
                      float cap) {
  const int G = H / Hkv;
  const int64_t tok_stride = static_cast<int64_t>(Hkv) * hd;  // elements between tokens of a block
  const int nh = num_seqs >= 2 * omp_get_max_threads() ? Hkv : 1;
  const int tasks_per_seq = Hkv / nh;
#pragma omp parallel
  {
    std::vector<float> qf(static_cast<size_t>(nh) * G * hd), acc(static_cast<size_t>(nh) * G * hd), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < static_cast<int64_t>(num_seqs) * tasks_per_seq; ++task) {
      const int s = static_cast<int>(task / tasks_per_seq), h0 = static_cast<int>(task % tasks_per_seq) * nh;
      // Sliding window (decision 0046): keys at positions >= lens[s] - window.  The table starts at the block
      // holding the first of them; t0 (< bs) leading tokens of that block are masked out.
      const int start = window > 0 && lens[s] > window ? lens[s] - window : 0;
      const int ctx = lens[s] - (start / bs) * bs, t0 = start % bs;
      const int32_t* table = tables + s * table_stride + start / bs;
      const T* qrow = q + rows[s] * q_row_stride + static_cast<int64_t>(h0) * G * hd;
      for (int i = 0; i < nh * G * hd; ++i) qf[i] = to_f32(qrow[i]) * scale;
      scores.resize(static_cast<size_t>(nh) * G * ctx);
      if (!heads_fast(G, qf.data(), k, v, table, ctx, t0, hd, bs, tok_stride, h0, nh, scores.data(), acc.data(), cap)) {
        for (int hh = 0; hh < nh; ++hh)
          head_scalar(qf.data() + hh * G * hd, k, v, table, ctx, t0, G, hd, bs, tok_stride, h0 + hh,
                      scores.data() + static_cast<size_t>(hh) * G * ctx, acc.data() + hh * G * hd, cap);
      }
      T* orow = out + rows[s] * out_row_stride + static_cast<int64_t>(h0) * G * hd;
      for (int i = 0; i < nh * G * hd; ++i) store(orow + i, acc[i]);
    }
  }
}

}  // namespace

extern "C" int actorserve_paged_decode_attention(
    int dtype, const void* q, int64_t q_row_stride, void* out, int64_t out_row_stride, const void* k,
    const void* v, const int32_t* rows, const int32_t* tables, int64_t table_stride, const int32_t* lens,
    int num_seqs, int H, int Hkv, int hd, int bs, float scale, int window, float softcap) {
  if (Hkv <= 0 || H % Hkv != 0 || hd <= 0 || bs <= 0 || window < 0 || softcap < 0.f) return 1;
  if (dtype == 0) {
    decode_attention(static_cast<const float*>(q), q_row_stride, static_cast<float*>(out), out_row_stride,
                     static_cast<const float*>(k), static_cast<const float*>(v), rows, tables, table_stride,
                     lens, num_seqs, H, Hkv, hd, bs, scale, window, softcap);
  } else if (dtype == 1) {
    decode_attention(static_cast<const uint16_t*>(q), q_row_stride, static_cast<uint16_t*>(out),
                     out_row_stride, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), rows,
                     tables, table_stride, lens, num_seqs, H, Hkv, hd, bs, scale, window, softcap);
  } else {
    return 2;
  }
  return 0;
}

namespace {

inline float round_to(float, float x) { return x; }
inline float round_to(uint16_t, float x) {
  uint16_t b;
  store(&b, x);
  return to_f32(b);
}

// 2. h += delta (if given, rounded to T), then out = w * T(h * rsqrt(mean(h^2) + eps)) per row
// (RMSNorm, Zhang & Sennrich 2019, in the Hugging Face Llama form: statistics in float32, weight
// multiplied after the cast back).  h, delta, out: [rows, d] contiguous; w: [d].
#if defined(__AVX512F__)
// Vector part of one row (16 lanes at a time; returns how many elements it covered).
template <typename T>
int add_row(T* hr, const T* dr, int d) {
  int i = 0;
  for (; i + 16 <= d; i += 16) store16(hr + i, round16(hr, _mm512_add_ps(load16(hr + i), load16(dr + i))));
  return i;
}
template <typename T>
int sum_squares(const T* hr, int d, float* ss) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(load16(hr + i), load16(hr + i), acc);
  *ss = _mm512_reduce_add_ps(acc);
  return i;
}
template <typename T>
int scale_row(const T* hr, const T* w, T* orow, float inv, int d) {
  int i = 0;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= d; i += 16)
    store16(orow + i, round16(orow, _mm512_mul_ps(load16(w + i), round16(orow, _mm512_mul_ps(load16(hr + i), vinv)))));
  return i;
}
#else
template <typename T> int add_row(T*, const T*, int) { return 0; }
template <typename T> int sum_squares(const T*, int, float* ss) { *ss = 0.f; return 0; }
template <typename T> int scale_row(const T*, const T*, T*, float, int) { return 0; }
#endif

// 2. h += delta (if given, rounded to T), then out = w * T(h * rsqrt(mean(h^2) + eps)) per row
// (RMSNorm, Zhang & Sennrich 2019, in the Hugging Face Llama form: statistics in float32, weight
// multiplied after the cast back).  h, delta, out: [rows, d] contiguous; w: [d].
template <typename T>
void add_rms_norm(T* h, const T* delta, const T* w, T* out, int64_t rows, int d, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 4)
  for (int64_t r = 0; r < rows; ++r) {
    T* hr = h + r * d;
    if (delta != nullptr) {
      const T* dr = delta + r * d;
      for (int i = add_row(hr, dr, d); i < d; ++i) store(hr + i, to_f32(hr[i]) + to_f32(dr[i]));
    }
    float ss = 0.f;
    for (int i = sum_squares(hr, d, &ss); i < d; ++i) ss += to_f32(hr[i]) * to_f32(hr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    T* orow = out + r * d;
    for (int i = scale_row(hr, w, orow, inv, d); i < d; ++i)
      store(orow + i, to_f32(w[i]) * round_to(T{}, to_f32(hr[i]) * inv));
  }
}

// 3. RoPE (Su et al. 2021; HF rotate_half layout) on the Q and K heads of each packed QKV row, in
// place, then K and V written to their cache slot.  qkv: [T, (H + 2 Hkv) * hd] rows of row_stride;
// cos, sin: float32 [max_pos, hd]; positions, slots: int64 [T]; caches: [slots, Hkv, hd].
#if defined(__AVX512F__)
// One head in place, 16 lanes at a time, the same float32 expressions as the scalar loop below
// (two products, then the sum; -ffp-contract=off keeps them unfused).  False if half % 16 != 0.
template <typename T>
bool rotate_head_vec(T* x, const float* c, const float* s, int half) {
  if (half % 16 != 0) return false;
  for (int i = 0; i < half; i += 16) {
    const __m512 a = load16(x + i), b = load16(x + half + i);
    const __m512 ya = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + i)), _mm512_mul_ps(b, _mm512_loadu_ps(s + i)));
    const __m512 yb =
        _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + i)), _mm512_mul_ps(a, _mm512_loadu_ps(s + half + i)));
    store16(x + i, round16(x, ya));
    store16(x + half + i, round16(x, yb));
  }
  return true;
}
#else
template <typename T>
bool rotate_head_vec(T*, const float*, const float*, int) { return false; }
#endif

template <typename T>
void rope_kv(T* qkv, int64_t row_stride, int64_t n, int H, int Hkv, int hd, const int64_t* pos, const float* cos,
             const float* sin, const int64_t* slots, T* kc, T* vc) {
  const int half = hd / 2;
#pragma omp parallel for schedule(static) if (n >= 4)
  for (int64_t t = 0; t < n; ++t) {
    T* row = qkv + t * row_stride;
    const float* c = cos + pos[t] * hd;
    const float* s = sin + pos[t] * hd;
    for (int head = 0; head < H + Hkv; ++head) {
      T* x = row + static_cast<int64_t>(head) * hd;
      if (rotate_head_vec(x, c, s, half)) continue;
      float y[512];
      for (int i = 0; i < half; ++i) y[i] = to_f32(x[i]) * c[i] - to_f32(x[i + half]) * s[i];
      for (int i = half; i < hd; ++i) y[i] = to_f32(x[i]) * c[i] + to_f32(x[i - half]) * s[i];
      for (int i = 0; i < hd; ++i) store(x + i, y[i]);
    }
    const int64_t kv = static_cast<int64_t>(Hkv) * hd;
    std::memcpy(kc + slots[t] * kv, row + static_cast<int64_t>(H) * hd, kv * sizeof(T));
    std::memcpy(vc + slots[t] * kv, row + static_cast<int64_t>(H + Hkv) * hd, kv * sizeof(T));
  }
}

// 4. SwiGLU activation (Shazeer 2020): out = T(silu(g)) * u per element, g and u the two halves
// of each [2f] row of gu (silu(x) = x / (1 + exp(-x)), float32, rounded to T as torch does).
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

template <typename T>
void silu_mul_row_scalar(const T* g, const T* u, T* o, int from, int f) {
  for (int i = from; i < f; ++i) store(o + i, round_to(T{}, silu(to_f32(g[i]))) * to_f32(u[i]));
}

#if defined(__AVX512F__)
template <typename T>
int silu_mul_row(const T* g, const T* u, T* o, int f) {
  int i = 0;
  for (; i + 16 <= f; i += 16) {
    const __m512 x = load16(g + i);
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 sx = round16(o, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(o + i, round16(o, _mm512_mul_ps(sx, load16(u + i))));
  }
  return i;
}
#else
template <typename T>
int silu_mul_row(const T*, const T*, T*, int) { return 0; }
#endif

template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int f) {
#pragma omp parallel for schedule(static) if (rows >= 2)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * f;
    T* o = out + r * f;
    silu_mul_row_scalar(g, g + f, o, silu_mul_row(g, g + f, o, f), f);
  }
}

}  // namespace

extern "C" int actorserve_add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t rows,
                                       int d, float eps) {
  if (dtype == 0) {
    add_rms_norm(static_cast<float*>(h), static_cast<const float*>(delta), static_cast<const float*>(w),
                 static_cast<float*>(out), rows, d, eps);
  } else if (dtype == 1) {
    add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta), static_cast<const uint16_t*>(w),
                 static_cast<uint16_t*>(out), rows, d, eps);
  } else {
    return 2;
  }
  return 0;
}

extern "C" int actorserve_rope_kv(int dtype, void* qkv, int64_t row_stride, int64_t n, int H, int Hkv, int hd,
                                  const int64_t* pos, const float* cos, const float* sin, const int64_t* slots,
                                  void* kc, void* vc) {
  if (hd > 512 || hd % 2 != 0) return 1;
  if (dtype == 0) {
    rope_kv(static_cast<float*>(qkv), row_stride, n, H, Hkv, hd, pos, cos, sin, slots, static_cast<float*>(kc),
            static_cast<float*>(vc));
  } else if (dtype == 1) {
    rope_kv(static_cast<uint16_t*>(qkv), row_stride, n, H, Hkv, hd, pos, cos, sin, slots,
            static_cast<uint16_t*>(kc), static_cast<uint16_t*>(vc));
  } else {
    return 2;
  }
  return 0;
}

extern "C" int actorserve_silu_mul(int dtype, const void* gu, void* out, int64_t rows, int f) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gu), static_cast<float*>(out), rows, f);
  } else if (dtype == 1) {
    silu_mul(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), rows, f);
  } else {
    return 2;
  }
  return 0;
}
