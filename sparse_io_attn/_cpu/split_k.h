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
// unit's partials in split order through their log-sum-exp (merge_row), so results are bitwise
// identical across runs and thread counts; with S = 1 the merge is the identity.
//
// Memory: per worker a few tiles (rows x CHUNK scores, CHUNK x D keys, D x CHUNK K^T), plus the
// partials (splits x rows x (Dv + 2) floats; Dv the value head dim): nothing proportional to the cache length. Every work
// buffer of a call is tallied (Tally); work_bytes() reports the last decode call's total, for tests.
//
// Scores t = fl(c s) saturated, the row maximum m of those t, p = exp2(t - m): the arithmetic of the
// prefill kernels, so their backward recomputes P exactly from the merged (m, log2 l). Which product
// forms s (a brgemm over K^T, summing D in order; or dots.h's fixed tree) is the caller's choice:
// the one its backward uses.
#pragma once

#include "softmax.h"
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

// A decode call's operands (read in place) and where its rows go.
template <typename T>
struct In {
  Operand<T> q, k, v;
  RowStore<T> store;
  In(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const RowStore<T>& store_)
      : q(q_), k(k_), v(v_), store(store_) {}
};

// The query rows of a unit: heads [h0, h0 + R / nt) x tokens [m0, m0 + nt) of batch b, head-major
// (row i is head h0 + i / nt at token m0 + i % nt).
struct UnitRows {
  int64_t b, h0, m0, nt, R;
  int64_t head(int64_t i) const { return h0 + i / nt; }
  int64_t token(int64_t i) const { return m0 + i % nt; }
};

// One worker's buffers for units of up to R rows (q/k head dim D, v head dim Dv).
struct Work {
  Buf q, kt, kv, s, acc, st;
  std::vector<int32_t> keys;  // gathered key numbers (selection, small blocks)
  float *m, *l;
  Work(int64_t R, int64_t D, int64_t Dv, int64_t nkeys, Tally& tally)
      : q(R * D), kt(D * CHUNK), kv(CHUNK * std::max(D, Dv)), s(R * LDS), acc(R * Dv), st(2 * R), keys(nkeys) {
    for (const Buf* b : {&q, &kt, &kv, &s, &acc, &st}) tally.add(*b);
    tally.bytes.fetch_add(static_cast<int64_t>(nkeys * sizeof(int32_t)));
    m = st.p;
    l = st.p + R;
  }
  void reset(int64_t R, int64_t Dv) {
    std::fill(m, m + R, NEG_INF);
    std::fill(l, l + R, 0.f);
    std::fill(acc.p, acc.p + R * Dv, 0.f);
  }
};

// K^T of nc fp32 key rows (ld) -> kt [D, CHUNK]. Flattened: at::vec's transpose inlined here with
// CHUNK and its whole 16 x 16 tiles constant, whatever the caller's size (an out-of-line 16 x 16
// tile of unknown size and stride cost the block-sparse decode about 15%).
#if defined(__GNUC__)
__attribute__((flatten))
#endif
static inline void transpose_keys(const float* k, int64_t ld, int64_t nc, int64_t D, float* kt) {
  at::vec::transpose_mxn<float>(k, ld, kt, CHUNK, static_cast<int>(nc), static_cast<int>(D));
}

// A task's partial [R] m, [R] l, [R, Dv] acc at `slot`.
static inline void write_partial(float* slot, const Work& w, int64_t R, int64_t Dv) {
  std::memcpy(slot, w.m, R * sizeof(float));
  std::memcpy(slot + R, w.l, R * sizeof(float));
  std::memcpy(slot + 2 * R, w.acc.p, R * Dv * sizeof(float));
}

// Row i of the merged partials of a unit's S splits (slots `stride` floats apart), in split order:
// M = max m_s, L = sum l_s 2^(m_s - M), acc = sum acc_s 2^(m_s - M) (in tmp [Dv]); then the row's
// output, lse and stats (RowStore::put, at `row` of head h).
template <typename T>
static inline void merge_row(const float* part, int64_t S, int64_t stride, int64_t R, int64_t Dv, int64_t i,
                             float* tmp, const RowStore<T>& store, int64_t row, int64_t h) {
  float M = NEG_INF;
  for (int64_t s = 0; s < S; ++s) {
    const float* p = part + s * stride;
    if (p[R + i] != 0.f) M = std::max(M, p[i]);
  }
  float L = 0.f;
  std::fill(tmp, tmp + Dv, 0.f);
  for (int64_t s = 0; s < S; ++s) {
    const float* p = part + s * stride;
    const float l = p[R + i];
    if (l == 0.f) continue;  // no allowed key in this split
    const float a = S == 1 ? 1.f : std::exp2(p[i] - M);
    L += l * a;
    const float* acc = p + 2 * R + i * Dv;
    if (a == 1.f) {
      add_row(tmp, acc, Dv);
    } else {
      const Vec va(a);
      int64_t d = 0;
      for (; d + VL <= Dv; d += VL) (Vec::loadu(tmp + d) + Vec::loadu(acc + d) * va).store(tmp + d);
      for (; d < Dv; ++d) tmp[d] += acc[d] * a;
    }
  }
  store.put(row, h, tmp, M, L);
}

// A call's tasks: unit u's splits are tasks [task0[u], task0[u] + splits), its partials (splits x
// rows x (Dv + 2) floats) start at part0[u]; units are added in order.
struct Tasks {
  std::vector<int64_t> task0, part0;
  int64_t tasks = 0, partial_floats = 0;
  void add_unit(int64_t splits, int64_t rows, int64_t Dv) {
    task0.push_back(tasks);
    part0.push_back(partial_floats);
    tasks += splits;
    partial_floats += splits * rows * (Dv + 2);
  }
  // task t -> (unit, split)
  std::pair<int64_t, int64_t> of(int64_t t) const {
    const int64_t u = std::upper_bound(task0.begin(), task0.end(), t) - task0.begin() - 1;
    return {u, t - task0[u]};
  }
};

// A call's partials and, per unit, how many of its tasks have finished.
struct Partials {
  Buf buf;
  std::vector<std::atomic<int64_t>> done;
  Partials(const Tasks& t, Tally& tally) : buf(t.partial_floats), done(t.task0.size()) {
    tally.add(buf);
    for (auto& d : done) d.store(0);
  }
};

// A task's start: the unit's query rows in fp32 (w.q), the running maximum, sum and accumulator reset.
template <typename T>
static inline void start_split(const In<T>& in, const UnitRows& u, int64_t D, int64_t Dv, Work& w) {
  for (int64_t i = 0; i < u.R; ++i) to_f32(in.q.row(u.b, u.head(i), u.token(i)), in.q.sd, D, w.q.p + i * D);
  w.reset(u.R, Dv);
}

// A task's end: its partial at split s of unit `unit`; the unit's last task to finish merges the
// unit's S splits in order into the results' rows (of Hq heads x Nq tokens per batch).
template <typename T>
static inline void finish_split(const In<T>& in, const UnitRows& u, int64_t Hq, int64_t Nq, int64_t Dv,
                                const Tasks& tasks, Partials& pp, int64_t unit, int64_t s, int64_t S, Work& w) {
  const int64_t R = u.R, stride = R * (Dv + 2);
  float* part = pp.buf.p + tasks.part0[unit];
  write_partial(part + s * stride, w, R, Dv);
  if (pp.done[unit].fetch_add(1, std::memory_order_acq_rel) + 1 != S) return;
  for (int64_t i = 0; i < R; ++i) {  // the unit's last task: merge its splits in order
    const int64_t row = (u.b * Hq + u.head(i)) * Nq + u.token(i);
    merge_row(part, S, stride, R, Dv, i, w.kv.p, in.store, row, u.head(i));
  }
}

// Items [lo, hi) of split s of a unit with `items` items in S splits.
static inline std::pair<int64_t, int64_t> split_items(int64_t items, int64_t S, int64_t s) {
  return {s * items / S, (s + 1) * items / S};
}

}  // namespace dec
}  // namespace sia
