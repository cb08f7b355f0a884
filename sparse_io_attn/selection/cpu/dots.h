// Small-block building blocks: 16 dot products of one row with 16 gathered rows at once, and row
// updates acc[0..D) += sum_j w[j] y_j over gathered rows y_j (rows base + idx[j] * ld).
// Part of kernel.cpp's translation unit (see kernel.cpp for the overview).
//
// dot(x, y_i) accumulates 16 lane sums along D (one fused multiply-add per 16 elements, in order;
// the tail zero-padded), then adds the lanes in one fixed tree,
// ((l0 + l8) + (l4 + l12)) + ((l2 + l10) + (l6 + l14)) + (the odd lanes alike): a product's value
// depends on its two rows only (never on the other products, their order, or which of the two rows
// is the shared one), so the forward and every backward pass compute bitwise the same scores.
// Kern<NC> is the AVX-512 code for D <= 16 NC (the rows' chunks in registers); Kern<0> the same
// sums for any D and instruction set, one lane at a time (correct, not fast).
#pragma once

#include "tiles.h"

namespace sia {
namespace sel {

constexpr int64_t DOTS = 16;  // dot products per call

static inline float tree16(const float* x) {  // the lane tree, one product
  float y[8], z[4];
  for (int k = 0; k < 8; ++k) y[k] = x[k] + x[k + 8];
  for (int k = 0; k < 4; ++k) z[k] = y[k] + y[k + 4];
  return (z[0] + z[2]) + (z[1] + z[3]);
}

template <int NC>
struct Kern;

// Rows are addressed as base + idx[i] * ld (idx: int32 row numbers, e.g. the plan's own lists).
template <>
struct Kern<0> {
  static void dots(const float* x, const float* base, int64_t ld, const int32_t* idx, int64_t D, float* out) {
    for (int i = 0; i < DOTS; ++i) {
      const float* y = base + idx[i] * ld;
      float lanes[16] = {0.f};
      for (int64_t d = 0; d < D; d += 16)
        for (int64_t k = 0; k < 16 && d + k < D; ++k) lanes[k] = std::fma(x[d + k], y[d + k], lanes[k]);
      out[i] = tree16(lanes);
    }
  }
  static void axpy(float* acc, const float* w, int64_t n, const float* base, int64_t ld, const int32_t* idx,
                   int64_t D) {
    for (int64_t d = 0; d < D; ++d) {
      float a = acc[d], b = 0.f;
      int64_t j = 0;
      for (; j + 1 < n; j += 2) {
        a = std::fma(w[j], base[idx[j] * ld + d], a);
        b = std::fma(w[j + 1], base[idx[j + 1] * ld + d], b);
      }
      if (j < n) a = std::fma(w[j], base[idx[j] * ld + d], a);
      acc[d] = a + b;
    }
  }
  static void prefetch(const float*, int64_t, const int32_t*, int64_t) {}
};

#if defined(CPU_CAPABILITY_AVX512)
// lanes k + 8, k + 4, k + 2, k + 1 of 16 lane-sum vectors: lane i of the result is product i
__attribute__((always_inline)) static inline __m512 tree16(__m512* x) {
  __m512 y[8];
  for (int i = 0; i < 8; ++i)  // y[i]: product i (8 lanes), then product i + 8
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44), _mm512_shuffle_f32x4(x[i], x[i + 8], 0xEE));
  __m512 z[4];
  for (int i = 0; i < 4; ++i)  // z[i]'s quarters: products i, i + 8, i + 4, i + 12
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[i], y[i + 4], 0x88), _mm512_shuffle_f32x4(y[i], y[i + 4], 0xDD));
  __m512 w[2];
  for (int i = 0; i < 2; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(z[i]), _mm512_castps_pd(z[i + 2]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(z[i]), _mm512_castps_pd(z[i + 2]));
    w[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // lane 4q + s holds product [0, 2, 1, 3][s] + [0, 8, 4, 12][q]
  const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), v);
}

template <int NC>
struct Kern {
  static inline __m512 load(const float* p, int c, __mmask16 tail) {
    return c + 1 < NC ? _mm512_loadu_ps(p + 16 * c) : _mm512_maskz_loadu_ps(tail, p + 16 * c);
  }
  static inline __mmask16 tail_mask(int64_t D) {
    const int64_t r = D - 16 * (NC - 1);
    return static_cast<__mmask16>(r >= 16 ? 0xFFFFu : (1u << r) - 1u);
  }
  __attribute__((always_inline)) static inline void dots(const float* x, const float* base, int64_t ld,
                                                         const int32_t* idx, int64_t D, float* out) {
    const __mmask16 tail = tail_mask(D);
    __m512 xr[NC], acc[16];
    for (int c = 0; c < NC; ++c) xr[c] = load(x, c, tail);
    for (int i = 0; i < 16; ++i) {  // row by row: one row address live at a time
      const float* yi = base + idx[i] * ld;
      acc[i] = _mm512_mul_ps(xr[0], load(yi, 0, tail));
      for (int c = 1; c < NC; ++c) acc[i] = _mm512_fmadd_ps(xr[c], load(yi, c, tail), acc[i]);
    }
    _mm512_storeu_ps(out, tree16(acc));
  }
  // acc += sum_j w[j] y_j as (acc + sum over even j) + (sum over odd j): two dependency chains
  __attribute__((always_inline)) static inline void axpy(float* acc, const float* w, int64_t n, const float* base,
                                                         int64_t ld, const int32_t* idx, int64_t D) {
    const __mmask16 tail = tail_mask(D);
    __m512 a[NC], b[NC];
    for (int c = 0; c < NC; ++c) {
      a[c] = load(acc, c, tail);
      b[c] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      const float* y0 = base + idx[j] * ld;
      const float* y1 = base + idx[j + 1] * ld;
      const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[j + 1]);
      for (int c = 0; c < NC; ++c) {
        a[c] = _mm512_fmadd_ps(w0, load(y0, c, tail), a[c]);
        b[c] = _mm512_fmadd_ps(w1, load(y1, c, tail), b[c]);
      }
    }
    if (j < n) {
      const float* y0 = base + idx[j] * ld;
      const __m512 w0 = _mm512_set1_ps(w[j]);
      for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(w0, load(y0, c, tail), a[c]);
    }
    for (int c = 0; c + 1 < NC; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(a[c], b[c]));
    _mm512_mask_storeu_ps(acc + 16 * (NC - 1), tail, _mm512_add_ps(a[NC - 1], b[NC - 1]));
  }
  // every other cache line of each row (the adjacent-line prefetcher brings the one beside it)
  static void prefetch(const float* base, int64_t ld, const int32_t* idx, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      for (int c = 0; c < NC; c += 2) _mm_prefetch(reinterpret_cast<const char*>(base + idx[i] * ld + 16 * c), _MM_HINT_T0);
  }
};

// f(Kern<NC>{}) for the head dims: the AVX-512 code up to 128 when q/k's and v's head dims take the
// same NC, else the generic one (bitwise the same sums)
template <typename F>
static void dispatch_dim(int64_t D, int64_t Dv, F&& f) {
  if ((D + 15) / 16 != (Dv + 15) / 16) {
    f(Kern<0>{});
    return;
  }
  switch ((D + 15) / 16) {
    case 1: f(Kern<1>{}); break;
    case 2: f(Kern<2>{}); break;
    case 3: f(Kern<3>{}); break;
    case 4: f(Kern<4>{}); break;
    case 5: f(Kern<5>{}); break;
    case 6: f(Kern<6>{}); break;
    case 7: f(Kern<7>{}); break;
    case 8: f(Kern<8>{}); break;
    default: f(Kern<0>{});
  }
}
#else
template <typename F>
static void dispatch_dim(int64_t, int64_t, F&& f) {
  f(Kern<0>{});
}
#endif

}  // namespace sel
}  // namespace sia
