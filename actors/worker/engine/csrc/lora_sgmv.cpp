// LoRA deltas of a step's rows, each row with its own adapter slot, in one call (the SGMV / BGMV product of
// Punica, Chen et al. 2023): y[t] += (x[t] A[s_t]) B[s_t] for every row t with slot s_t >= 0.
// Built with the other kernels by cpu_kernels.py; dtype code 0 = float32, 1 = bfloat16 (uint16, rounded to
// nearest even once, after the delta is added in float32).
//
// Layouts (row-major):
//   x      rows of [in]; row t at x + t * x_stride
//   A      [S, in, R] contiguous (R = n_sub * r_max: the sub-projections' A^T side by side)
//   B      [S, R, out] contiguous, block-diagonal: rank rows [i r_max, (i+1) r_max) of sub-projection i are
//          non-zero only in its output columns [cols[i], cols[i+1]); only those blocks are read
//   y      rows of [out]; row t at y + t * y_stride; slot [T] int32 (-1: no adapter)
// Rows are grouped by slot and the slots split over the OpenMP threads: each slot's weights are widened once
// and used for all its rows; float32 accumulators (R <= 1024).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "bf16.h"

namespace {

using actorserve::store;
using actorserve::to_f32;

constexpr int kMaxRank = 1024;
constexpr int kCols = 256;  // output columns accumulated at once per row

// The rows of one slot: each A row and each B row chunk is widened to float32 once and used for every row
// (weights read once per slot from memory, not once per row).
template <typename T>
void slot_delta(const T* x, int64_t xs, const T* a, const T* b, T* y, int64_t ys, const std::vector<int64_t>& rows,
                int in, int R, int out, int n_sub, int r_max, const int32_t* cols) {
  const size_t n = rows.size();
  std::vector<float> xa(n * R, 0.f), acc(n * kCols);
  float af[kMaxRank], bf[kCols];
  for (int k = 0; k < in; ++k) {
    const T* ar = a + static_cast<int64_t>(k) * R;
    for (int j = 0; j < R; ++j) af[j] = to_f32(ar[j]);
    for (size_t r = 0; r < n; ++r) {
      const float xv = to_f32(x[rows[r] * xs + k]);
      float* xr = xa.data() + r * R;
      for (int j = 0; j < R; ++j) xr[j] += xv * af[j];
    }
  }
  for (int i = 0; i < n_sub; ++i) {
    for (int c0 = cols[i]; c0 < cols[i + 1]; c0 += kCols) {
      const int w = cols[i + 1] - c0 < kCols ? cols[i + 1] - c0 : kCols;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = i * r_max; j < (i + 1) * r_max; ++j) {
        const T* br = b + static_cast<int64_t>(j) * out + c0;
        for (int c = 0; c < w; ++c) bf[c] = to_f32(br[c]);
        for (size_t r = 0; r < n; ++r) {
          const float v = xa[r * R + j];
          float* ar = acc.data() + r * kCols;
          for (int c = 0; c < w; ++c) ar[c] += v * bf[c];
        }
      }
      for (size_t r = 0; r < n; ++r) {
        T* yr = y + rows[r] * ys + c0;
        const float* ar = acc.data() + r * kCols;
        for (int c = 0; c < w; ++c) store(yr + c, to_f32(yr[c]) + ar[c]);
      }
    }
  }
}

template <typename T>
void sgmv(const T* x, int64_t xs, const T* A, const T* B, T* y, int64_t ys, const int32_t* slot, int64_t rows,
          int num_slots, int in, int R, int out, int n_sub, int r_max, const int32_t* cols) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] >= 0 && slot[t] < num_slots) by_slot[slot[t]].push_back(t);
#pragma omp parallel for schedule(dynamic, 1)
  for (int s = 0; s < num_slots; ++s) {
    if (by_slot[s].empty()) continue;
    slot_delta(x, xs, A + static_cast<int64_t>(s) * in * R, B + static_cast<int64_t>(s) * R * out, y, ys, by_slot[s],
               in, R, out, n_sub, r_max, cols);
  }
}

}  // namespace

// Returns 0, or 1 for shapes it refuses (R > 1024, R != n_sub * r_max, no slot, a bad dtype code).
extern "C" int actorserve_lora_sgmv(int dtype, const void* x, int64_t x_stride, const void* A, const void* B, void* y,
                                    int64_t y_stride, const int32_t* slot, int64_t rows, int num_slots, int in, int R,
                                    int out, int n_sub, int r_max, const int32_t* cols) {
  if (R > kMaxRank || R != n_sub * r_max || rows < 0 || num_slots < 1) return 1;
  if (dtype == 0) {
    sgmv(static_cast<const float*>(x), x_stride, static_cast<const float*>(A), static_cast<const float*>(B),
         static_cast<float*>(y), y_stride, slot, rows, num_slots, in, R, out, n_sub, r_max, cols);
  } else if (dtype == 1) {
    sgmv(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(A), static_cast<const uint16_t*>(B),
         static_cast<uint16_t*>(y), y_stride, slot, rows, num_slots, in, R, out, n_sub, r_max, cols);
  } else {
    return 1;
  }
  return 0;
}
