// Decoding (one query token, or a few, against a long KV cache): the split-K engine shared by the
// block-sparse and selection decode kernels (block_sparse/cpu/decode.h, selection/cpu/decode.h).
//
// A *unit* is a small matrix of query rows that read the same keys (the query heads of one KV head
// that share a list, times the unit's tokens). Its keys (kept blocks, selected blocks) are cut into
// *items* (chunks of at most CHUNK keys), and the items into S contiguous *splits*, S decided by the
// unit's key count and the number of units only (num_splits: never by the thread count). A task is
// one (unit, split): an online softmax over its items, K and V read where they live (strided views
// of a cache, any dtype: a chunk is converted to fp32 only when it is not fp32 with a unit head-dim
// stride), leaving a partial (m, l, acc) per row. The last task of a unit to finish merges the
// unit's partials in split order through their log-sum-exp (merge_unit), so results are bitwise
// identical across runs and thread counts; with S = 1 the merge is the identity.
//
// Memory: per worker a few tiles (rows x CHUNK scores, CHUNK x D keys, D x CHUNK K^T), plus the
// partials (splits x rows x (D + 2) floats): nothing proportional to the cache length. Every work
// buffer of a call is tallied (Tally); work_bytes() reports the last decode call's total, for tests.
//
// Scores t = fl(c s) saturated, the row maximum m of those t, p = exp2(t - m): the arithmetic of the
// prefill kernels, so their backward recomputes P exactly from the merged (m, log2 l). Which product
// forms s (a brgemm over K^T, summing D in order; or dots.h's fixed tree) is the caller's choice:
// the one its backward uses.
#pragma once

#include "tiles.h"

#include <type_traits>

namespace sia {
namespace dec {

constexpr int64_t MAX_QUERIES = 16;   // query tokens up to which the decode kernels run (_launch.py)
constexpr int64_t CHUNK = 64;         // keys per item (a K/V tile)
constexpr int64_t LDS = CHUNK + 16;   // score tile leading dimension
constexpr int64_t SPLIT_KEYS = 256;   // keys a split holds at least (when the unit has that many)
constexpr int64_t TARGET_TASKS = 64;  // splits aimed at over all units of a call

// Bytes of work buffers the last decode call allocated (both ops; a debug counter for the tests).
inline std::atomic<int64_t>& work_bytes() {
  static std::atomic<int64_t> bytes{0};
  return bytes;
}

struct Tally {  // a call's work-buffer bytes, published at the end of the call
  std::atomic<int64_t> bytes{0};
  void add(const Buf& b) { bytes.fetch_add(static_cast<int64_t>(b.bytes)); }
  ~Tally() { work_bytes().store(bytes.load()); }
};

// Splits of a unit holding `keys` keys in `items` items, when the call has `units` units.
static inline int64_t num_splits(int64_t keys, int64_t items, int64_t units) {
  const int64_t cap = std::max<int64_t>(1, cdiv(TARGET_TASKS, std::max<int64_t>(units, 1)));
  return std::max<int64_t>(1, std::min({cap, items, cdiv(keys, SPLIT_KEYS)}));
}

// A [B, H, N, D] operand read in place (element strides).
template <typename T>
struct Operand {
  const T* p;
  int64_t sb, sh, sn, sd;
  explicit Operand(const at::Tensor& x)
      : p(reinterpret_cast<const T*>(x.data_ptr())), sb(x.stride(0)), sh(x.stride(1)), sn(x.stride(2)),
        sd(x.stride(3)) {}
  const T* row(int64_t b, int64_t h, int64_t n) const { return p + b * sb + h * sh + n * sn; }
  // fp32 rows usable directly (a unit head-dim stride, rows at least D apart)
  bool direct(int64_t D) const { return std::is_same<T, float>::value && (sd == 1 || D == 1) && sn >= D; }
};

// n elements (stride sd) -> fp32 (exact for every supported dtype)
template <typename T>
static inline void to_f32(const T* src, int64_t sd, int64_t n, float* dst) {
  int64_t d = 0;
  if (sd == 1) {
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(dst, src, n * sizeof(float));
      return;
    }
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      for (; d + 16 <= n; d += 16) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
      }
    } else if constexpr (std::is_same<T, c10::Half>::value) {
      for (; d + 16 <= n; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
    }
#endif
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d * sd]);
}

// fp32 rows of keys [k0, k0 + n) of (b, h): the operand itself when direct, else converted into buf
// (ld D). Returns the rows and sets ld.
template <typename T>
static inline const float* rows_f32(const Operand<T>& x, int64_t b, int64_t h, int64_t k0, int64_t n, int64_t D,
                                    float* buf, int64_t& ld) {
  if (x.direct(D)) {
    ld = x.sn;
    return reinterpret_cast<const float*>(x.row(b, h, k0));
  }
  for (int64_t j = 0; j < n; ++j) to_f32(x.row(b, h, k0 + j), x.sd, D, buf + j * D);
  ld = D;
  return buf;
}

// One worker's buffers for units of up to R rows.
struct Work {
  Buf q, kt, kv, s, acc, st;
  std::vector<int32_t> keys;  // gathered key numbers (selection, small blocks)
  float *m, *l;
  Work(int64_t R, int64_t D, int64_t nkeys, Tally& tally)
      : q(R * D), kt(D * CHUNK), kv(CHUNK * D), s(R * LDS), acc(R * D), st(2 * R), keys(nkeys) {
    for (const Buf* b : {&q, &kt, &kv, &s, &acc, &st}) tally.add(*b);
    tally.bytes.fetch_add(static_cast<int64_t>(nkeys * sizeof(int32_t)));
    m = st.p;
    l = st.p + R;
  }
  void reset(int64_t R, int64_t D) {
    std::fill(m, m + R, NEG_INF);
    std::fill(l, l + R, 0.f);
    std::fill(acc.p, acc.p + R * D, 0.f);
  }
};

// K^T of nc fp32 key rows (ld) -> kt [D, CHUNK]
static inline void transpose_keys(const float* k, int64_t ld, int64_t nc, int64_t D, float* kt) {
  at::vec::transpose_mxn<float>(k, ld, kt, CHUNK, static_cast<int>(nc), static_cast<int>(D));
}

// Online-softmax step of row i over one tile of nc raw scores s (the row's LDS-wide slice): t =
// fl(c s) saturated, lanes whose `bits(jv)` are 0 (and past nc) -inf, the running maximum and sum
// updated, acc rescaled; s becomes p = exp2(t - m) (0 where masked).
template <typename Bits>
static inline void softmax_row(float* s, int64_t nc, float c2, float& m, float& l, float* acc, int64_t D,
                               Bits&& bits) {
  const int64_t ncv = round_up(nc, VL);
  const Vec vc(c2);
  Vec vmax(NEG_INF);
  for (int64_t jv = 0; jv < ncv; jv += VL) {
    const Vec x = keep_bits(saturate(Vec::loadu(s + jv) * vc), bits(jv) & len_bits(nc - jv));
    x.store(s + jv);
    vmax = at::vec::maximum(vmax, x);
  }
  const float mo = m, mn = std::max(mo, hmax(vmax));
  if (mn > mo && mo != NEG_INF) {  // the running maximum grew: rescale
    const float alpha = std::exp2(mo - mn);
    l *= alpha;
    scale_row(acc, D, alpha);
  }
  const Vec vm(mn == NEG_INF ? 0.f : mn);
  Vec vsum(0.f);
  for (int64_t jv = 0; jv < ncv; jv += VL) {
    const Vec p = vexp2(Vec::loadu(s + jv) - vm);
    p.store(s + jv);
    vsum = vsum + p;
  }
  l += hsum(vsum);
  m = mn;
}

struct AllBits {
  uint32_t operator()(int64_t) const { return FULL_BITS; }
};

// A task's partial [R] m, [R] l, [R, D] acc at `slot`.
static inline void write_partial(float* slot, const Work& w, int64_t R, int64_t D) {
  std::memcpy(slot, w.m, R * sizeof(float));
  std::memcpy(slot + R, w.l, R * sizeof(float));
  std::memcpy(slot + 2 * R, w.acc.p, R * D * sizeof(float));
}

// Row i of the merged partials of a unit's S splits (slots `stride` floats apart), in split order:
// M = max m_s, L = sum l_s 2^(m_s - M), o = sum acc_s 2^(m_s - M) / L; then the row's output (q's
// dtype), lse (natural log) and stats (M, log2 L): output 0, lse -inf, stats (+inf, 0) when L = 0.
template <typename T>
static inline void merge_row(const float* part, int64_t S, int64_t stride, int64_t R, int64_t D, int64_t i,
                             float* tmp, T* o, float* lse, float* st_m, float* st_l) {
  float M = NEG_INF;
  for (int64_t s = 0; s < S; ++s) {
    const float* p = part + s * stride;
    if (p[R + i] != 0.f) M = std::max(M, p[i]);
  }
  float L = 0.f;
  std::fill(tmp, tmp + D, 0.f);
  for (int64_t s = 0; s < S; ++s) {
    const float* p = part + s * stride;
    const float l = p[R + i];
    if (l == 0.f) continue;  // no allowed key in this split
    const float a = S == 1 ? 1.f : std::exp2(p[i] - M);
    L += l * a;
    const float* acc = p + 2 * R + i * D;
    if (a == 1.f) {
      add_row(tmp, acc, D);
    } else {
      const Vec va(a);
      int64_t d = 0;
      for (; d + VL <= D; d += VL) (Vec::loadu(tmp + d) + Vec::loadu(acc + d) * va).store(tmp + d);
      for (; d < D; ++d) tmp[d] += acc[d] * a;
    }
  }
  if (L == 0.f) {
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(0.f);
    *lse = NEG_INF;
    *st_m = POS_INF;
    *st_l = 0.f;
    return;
  }
  for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(tmp[d] / L);
  const float log2l = std::log2(L);
  *lse = (M + log2l) * LN2;
  *st_m = M;
  *st_l = log2l;
}

// Task t -> (unit, split) over units whose first tasks are task0[0..U) (ascending).
static inline std::pair<int64_t, int64_t> task_of(const std::vector<int64_t>& task0, int64_t t) {
  const int64_t u = std::upper_bound(task0.begin(), task0.end(), t) - task0.begin() - 1;
  return {u, t - task0[u]};
}

// Items [lo, hi) of split s of a unit with `items` items in S splits.
static inline std::pair<int64_t, int64_t> split_items(int64_t items, int64_t S, int64_t s) {
  return {s * items / S, (s + 1) * items / S};
}

}  // namespace dec
}  // namespace sia
