// The problem (shapes, how heads index the plan) and the plan's tensors, checked before any work.
// Part of kernel.cpp's translation unit (see kernel.cpp for the overview).
#pragma once

#include "entry.h"

namespace sia {
namespace sel {

// Which kernel family runs (the raw ops' `family` argument): unless forced, key-major for blocks of
// KEY_MAJOR_MIN_BLOCK keys and more whose pair partials ([B, Hq, Nq, K] x (D + 2) floats) fit
// MAX_PARTIAL_BYTES, else query-major (selection/cpu/_launch.py applies the same rule).
enum Family : int64_t { AUTO = 0, KEY_MAJOR = 1, QUERY_MAJOR = 2 };
constexpr int64_t KEY_MAJOR_MIN_BLOCK = 16;
constexpr int64_t MAX_PARTIAL_BYTES = int64_t(2) << 30;

static bool key_major_by_default(int64_t bs, int64_t B, int64_t Hq, int64_t Nq, int64_t K, int64_t D) {
  return bs >= KEY_MAJOR_MIN_BLOCK && B * Hq * Nq * K * (D + 2) * int64_t(sizeof(float)) <= MAX_PARTIAL_BYTES;
}

struct Problem : Dims {
  int64_t bs, nkb, K, L;    // block size, key blocks, slots per row, selections stored
  int64_t Gq;               // query heads per kv head
  int64_t hps;              // query heads per selection (head h uses selection b * slb + h / hps)
  int64_t slb;              // selection stride over the batch (0: shared)
  int64_t R;                // heads of a unit: they share one selection and one kv head
  int64_t spk;              // units (selections) per kv head
  bool causal;
  int64_t delta;            // key s allowed for query t iff s <= t + delta
  float c2, sm_scale;       // c2 = sm_scale * log2(e)
  Family family;
  const int32_t* rows = nullptr;       // [L, Nq, K]: the normalised rows
  const int32_t* counts = nullptr;     // [L, Nq]
  const int32_t* col_ptr = nullptr;    // [L, nkb + 1] absolute offsets
  const int32_t* col_query = nullptr;  // query token of each list entry
  const int32_t* col_slot = nullptr;   // its slot in the row
  // Packed variable-length sequences (selection/varlen.py): the block table, block c = keys
  // [blk_start[c], blk_end[c]) (contiguous: blk_start[c + 1] == blk_end[c]), and the causal offset of
  // each query row (key s allowed for query t iff s <= t + row_delta[t]); null: the fixed grid,
  // block c = keys [c bs, min((c + 1) bs, Nk)), offset delta.
  const int32_t* blk_start = nullptr;
  const int32_t* blk_end = nullptr;
  const int32_t* row_delta = nullptr;

  // unit u = (b, kv head, selection inside it): its first query head and its selection
  int64_t units() const { return B * Hkv * spk; }
  int64_t unit_b(int64_t u) const { return u / (Hkv * spk); }
  int64_t unit_kv(int64_t u) const { return (u / spk) % Hkv; }
  int64_t unit_h0(int64_t u) const { return unit_kv(u) * Gq + (u % spk) * R; }
  int64_t unit_l(int64_t u) const { return unit_b(u) * slb + unit_h0(u) / hps; }
  // block c's first key and its number of keys
  int64_t key0(int64_t c) const { return blk_start != nullptr ? blk_start[c] : c * bs; }
  int64_t keys(int64_t c) const { return blk_start != nullptr ? blk_end[c] - blk_start[c] : std::min(bs, Nk - c * bs); }
  // the last key query t may use under causality
  int64_t last_key(int64_t t) const { return t + (row_delta != nullptr ? row_delta[t] : delta); }
  // keys of block c query t may use: the first n of the block (0: none)
  int64_t allowed(int64_t t, int64_t c) const {
    const int64_t n0 = key0(c);
    int64_t n = keys(c);
    if (causal) n = std::min(n, last_key(t) - n0 + 1);
    return std::max<int64_t>(n, 0);
  }
  // whether a row's keys are listed one by one (blocks expanded): always but for single-token blocks
  // of the fixed grid, whose block numbers are the keys
  bool expand_keys() const { return bs > 1 || blk_start != nullptr; }
  explicit Problem(const Dims& d) : Dims(d) {}
};

static void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu(), "sparse_io_attn cpu: ", name,
              " must be a contiguous int32 CPU tensor");
}

// A variable-length call's table (int32 [2 nkb + Nq]: block starts, block ends, row offsets) checked
// and set in P: blocks inside [0, Nk], at most bs keys each, contiguous (each starts where the one
// before ends), so nothing is read outside the keys and a run of blocks is a run of keys.
static void check_table(Problem& P, const at::Tensor& table) {
  check_index(table, "the block table");
  const int64_t n = table.numel() - P.Nq;
  TORCH_CHECK(table.dim() == 1 && n >= 0 && n % 2 == 0, "sparse_io_attn cpu: the block table must be int32 ",
              "[2 num_kv_blocks + Nq] with Nq = ", P.Nq, ", got ", table.sizes());
  P.nkb = n / 2;
  P.blk_start = table.data_ptr<int32_t>();
  P.blk_end = P.blk_start + P.nkb;
  P.row_delta = P.blk_end + P.nkb;
  for (int64_t c = 0; c < P.nkb; ++c) {
    const int64_t s = P.blk_start[c], e = P.blk_end[c];
    TORCH_CHECK(0 <= s && s <= e && e <= P.Nk && e - s <= P.bs && (c == 0 || s == P.blk_end[c - 1]),
                "sparse_io_attn cpu: block ", c, " of the block table spans keys [", s, ", ", e, "); blocks must ",
                "lie in [0, ", P.Nk, "], hold at most ", P.bs, " keys and follow each other");
  }
}

// Checks the plan's rows (counts in [0, K], the first `count` entries strictly ascending in [0, nkb))
// and, when given, the key lists (offsets non-decreasing inside the storage, tokens in [0, Nq)
// strictly ascending per list, slots below their row's count, as many entries per selection as its
// rows hold, and for key-major work each entry naming its own block: rows[l, t, j] == c, so every
// pair slot is written exactly once). d: the operands' sizes (check_qkv's).
static Problem make_problem(const Dims& d, const at::Tensor& rows, const at::Tensor& row_counts,
                            const std::optional<at::Tensor>& col_ptr, const std::optional<at::Tensor>& col_query,
                            const std::optional<at::Tensor>& col_slot, const std::optional<at::Tensor>& table,
                            int64_t block_size, int64_t stride_lb, int64_t heads_per_selection,
                            std::optional<int64_t> causal_offset, double sm_scale, int64_t family, bool need_lists) {
  Problem P(d);
  P.Gq = P.Hq / P.Hkv;
  TORCH_CHECK(block_size >= 1, "sparse_io_attn cpu: block_size must be >= 1, got ", block_size);
  P.bs = block_size;
  P.nkb = cdiv(P.Nk, P.bs);
  if (table.has_value()) check_table(P, *table);
  TORCH_CHECK(family >= 0 && family <= 2, "sparse_io_attn cpu: family must be 0 (auto), 1 (key-major) or 2 ",
              "(query-major), got ", family);
  check_index(rows, "rows");
  check_index(row_counts, "row_counts");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == P.Nq && row_counts.dim() == 2 &&
                  row_counts.size(0) == rows.size(0) && row_counts.size(1) == P.Nq,
              "sparse_io_attn cpu: rows must be [L, Nq, K] and row_counts [L, Nq] with Nq = ", P.Nq, ", got ",
              rows.sizes(), " and ", row_counts.sizes());
  P.L = rows.size(0);
  P.K = rows.size(2);
  P.family = family != AUTO ? static_cast<Family>(family)
             : key_major_by_default(P.bs, P.B, P.Hq, P.Nq, P.K, P.D) ? KEY_MAJOR : QUERY_MAJOR;
  TORCH_CHECK(P.L >= 1, "sparse_io_attn cpu: the plan holds no selection");
  const int64_t hps = heads_per_selection;
  TORCH_CHECK(hps >= 1 && P.Hq % hps == 0 && (P.Gq % hps == 0 || hps % P.Gq == 0),
              "sparse_io_attn cpu: heads_per_selection ", hps, " must divide Hq = ", P.Hq,
              " and divide or be a multiple of Hq / Hkv = ", P.Gq);
  P.hps = hps;
  P.R = std::min(P.Gq, hps);
  P.spk = P.Gq / P.R;
  TORCH_CHECK(stride_lb >= 0, "sparse_io_attn cpu: stride_lb must be >= 0, got ", stride_lb);
  P.slb = stride_lb;
  if (P.B * P.Hq > 0) {
    const int64_t lid_max = (P.B - 1) * P.slb + (P.Hq - 1) / hps;
    TORCH_CHECK(lid_max < P.L, "sparse_io_attn cpu: stride_lb ", P.slb, " and heads_per_selection ", hps,
                " reach selection ", lid_max, " but the plan holds ", P.L);
  }
  P.causal = causal_offset.has_value();
  P.delta = causal_offset.value_or(0);
  P.sm_scale = static_cast<float>(sm_scale);
  P.c2 = static_cast<float>(sm_scale * LOG2E);
  P.rows = rows.data_ptr<int32_t>();
  P.counts = row_counts.data_ptr<int32_t>();

  // rows: counts and the kept entries; per selection, the pairs it holds
  const int64_t LN = P.L * P.Nq, K = P.K, nkb = P.nkb;
  std::vector<int64_t> pairs(static_cast<size_t>(P.L), 0);
  {
    std::atomic<int64_t> bad{-1};
    at::parallel_for(0, LN, 2048, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t m = P.counts[r];
        const int32_t* row = P.rows + r * K;
        bool ok = m >= 0 && m <= K;
        for (int64_t j = 0; ok && j < m; ++j) ok = row[j] >= 0 && row[j] < nkb && (j == 0 || row[j - 1] < row[j]);
        if (!ok) {
          int64_t expect = -1;
          bad.compare_exchange_strong(expect, r);
        }
      }
    });
    TORCH_CHECK(bad.load() < 0, "sparse_io_attn cpu: row ", bad.load(), " of the plan is not normalised (count in [0, ",
                K, "], blocks strictly ascending in [0, ", nkb, "))");
    for (int64_t l = 0; l < P.L; ++l) {
      int64_t s = 0;
      for (int64_t t = 0; t < P.Nq; ++t) s += P.counts[l * P.Nq + t];
      pairs[l] = s;
    }
  }
  if (!need_lists) return P;
  TORCH_CHECK(col_ptr.has_value() && col_query.has_value() && col_slot.has_value(),
              "sparse_io_attn cpu: this call needs the plan's key lists (col_ptr, col_query, col_slot)");
  check_index(*col_ptr, "col_ptr");
  check_index(*col_query, "col_query");
  check_index(*col_slot, "col_slot");
  TORCH_CHECK(col_ptr->dim() == 2 && col_ptr->size(0) == P.L && col_ptr->size(1) == nkb + 1,
              "sparse_io_attn cpu: col_ptr must be [L, nkb + 1] = [", P.L, ", ", nkb + 1, "], got ", col_ptr->sizes());
  TORCH_CHECK(col_query->numel() == col_slot->numel(), "sparse_io_attn cpu: col_query and col_slot differ in length");
  const int64_t cap = col_query->numel();
  P.col_ptr = col_ptr->data_ptr<int32_t>();
  P.col_query = col_query->data_ptr<int32_t>();
  P.col_slot = col_slot->data_ptr<int32_t>();
  for (int64_t l = 0; l < P.L; ++l) {
    const int32_t* p = P.col_ptr + l * (nkb + 1);
    TORCH_CHECK(p[0] >= 0 && p[nkb] <= cap, "sparse_io_attn cpu: key lists of selection ", l, " span [", p[0], ", ",
                p[nkb], "], expected inside [0, ", cap, "]");
    for (int64_t c = 0; c < nkb; ++c)
      TORCH_CHECK(p[c] <= p[c + 1], "sparse_io_attn cpu: key-list offsets of selection ", l, " decrease at block ", c);
    TORCH_CHECK(p[nkb] - p[0] == pairs[l], "sparse_io_attn cpu: the key lists of selection ", l, " hold ",
                p[nkb] - p[0], " entries but its rows ", pairs[l]);
  }
  const bool slots = P.family == KEY_MAJOR;
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, P.L * nkb, 16, [&](int64_t lo, int64_t hi) {
    const int64_t Nq = P.Nq;
    const int32_t *query = P.col_query, *slot = P.col_slot;
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t l = x / nkb, c = x % nkb;
      const int32_t* p = P.col_ptr + l * (nkb + 1) + c;
      const int32_t* count = P.counts + l * Nq;  // selection l's rows
      const int32_t* row = P.rows + l * Nq * K;
      int64_t prev = -1;
      for (int64_t e = p[0], end = p[1]; e < end; ++e) {
        const int64_t t = query[e], j = slot[e];
        bool ok = t > prev && t < Nq && j >= 0 && j < count[t];
        if (ok && slots) ok = row[t * K + j] == c;
        prev = t;
        if (!ok) {
          int64_t expect = -1;
          bad.compare_exchange_strong(expect, e);
          break;
        }
      }
    }
  });
  TORCH_CHECK(bad.load() < 0, "sparse_io_attn cpu: key-list entry ", bad.load(), " is inconsistent with the rows ",
              "(token outside [0, Nq) or not ascending, slot outside its row's count, or naming another block)");
  return P;
}

}  // namespace sel
}  // namespace sia
