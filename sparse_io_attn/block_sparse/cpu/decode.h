// Decode forward (Nq <= dec::MAX_QUERIES: decoding, speculative verification): split-K over the kept
// blocks of the decoded rows, K/V read in place. Part of kernel.cpp's single translation unit; the
// engine (units, splits, the fixed-order merge) is _cpu/split_k.h.
//
// A unit is (batch, kv head, query block, a run of consecutive query heads of the GQA group whose
// row lists are equal): its rows are those heads x the block's tokens, one small matrix that shares
// every K/V tile. Its entries are the row's partial blocks, then its full blocks (the CSR lists of
// the plan); an item is a chunk of at most CHUNK keys of one entry. Per item: the K rows (in place,
// or converted to fp32), K^T in a tile, S = Q K^T by brgemm (D summed in order, as the prefill
// backward recomputes it), masks for a partial block (ragged end, the causal test, the element-mask
// bits, the chunk trimmed to the mask's bounding box and the causal limit first), the online
// softmax, then acc += P V by brgemm (V in place or converted). Nothing is read or packed outside
// the kept blocks; the work buffers depend on the rows, the head dim and the kept blocks only.
#pragma once

#include "schedule.h"
#include "split_k.h"

namespace sia {

struct DecUnit {
  int64_t b, kv, h0, nh;  // batch, kv head, first query head, query heads
  int64_t r, m0, nt;      // query block, first token, tokens
  int64_t row;            // the list row of the unit's heads (lid * (nqb + 1) + r)
  int64_t np, ne;         // partial entries, entries (partial then full)
  int64_t pre;            // offset of the unit's item prefix [ne + 1] in DecPlan::pre
  int64_t items, splits;
  int64_t rows() const { return nh * nt; }
};

struct DecPlan : dec::Tasks {
  std::vector<DecUnit> units;
  std::vector<int64_t> pre;  // per unit: items before each entry
  int64_t max_rows = 0;
};

// Whether list rows x and y hold the same entries.
static bool same_list(const Lists& L, int64_t x, int64_t y) {
  const int64_t np = L.part_ptr[x + 1] - L.part_ptr[x], nf = L.full_ptr[x + 1] - L.full_ptr[x];
  if (np != L.part_ptr[y + 1] - L.part_ptr[y] || nf != L.full_ptr[y + 1] - L.full_ptr[y]) return false;
  const int64_t px = L.part_ptr[x], py = L.part_ptr[y], fx = L.full_ptr[x], fy = L.full_ptr[y];
  for (int64_t e = 0; e < np; ++e)
    if (L.part_idx[px + e] != L.part_idx[py + e] || L.part_mask[px + e] != L.part_mask[py + e]) return false;
  for (int64_t e = 0; e < nf; ++e)
    if (L.full_idx[fx + e] != L.full_idx[fy + e]) return false;
  return true;
}

static DecPlan decode_plan(const Problem& P, const Lists& L) {
  DecPlan dp;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t kv = 0; kv < P.Hkv; ++kv)
      for (int64_t r = 0; r < P.nqb; ++r) {
        const int64_t m0 = r * P.bq, nt = std::min(P.bq, P.Nq - m0);
        for (int64_t h = kv * P.G; h < (kv + 1) * P.G;) {
          const int64_t row = (b * P.slb + h * P.slh) * (P.nqb + 1) + r;
          int64_t h1 = h + 1;
          while (h1 < (kv + 1) * P.G && same_list(L, row, (b * P.slb + h1 * P.slh) * (P.nqb + 1) + r)) ++h1;
          const int64_t np = L.part_ptr[row + 1] - L.part_ptr[row], nf = L.full_ptr[row + 1] - L.full_ptr[row];
          dp.units.push_back(DecUnit{b, kv, h, h1 - h, r, m0, nt, row, np, np + nf,
                                     static_cast<int64_t>(dp.pre.size()), 0, 1});
          DecUnit& u = dp.units.back();
          int64_t items = 0;
          dp.pre.push_back(0);
          for (int64_t e = 0; e < u.ne; ++e) {
            const int64_t c = e < np ? L.part_idx[L.part_ptr[row] + e] : L.full_idx[L.full_ptr[row] + e - np];
            items += cdiv(std::max<int64_t>(1, std::min(P.bk, P.Nk - c * P.bk)), dec::CHUNK);
            dp.pre.push_back(items);
          }
          u.items = items;
          h = h1;
        }
      }
  const int64_t U = static_cast<int64_t>(dp.units.size());
  for (DecUnit& u : dp.units) {
    u.splits = dec::num_splits(u.ne * P.bk, u.items, U);
    dp.add_unit(u.splits, u.rows(), P.Dv);
    dp.max_rows = std::max(dp.max_rows, u.rows());
  }
  return dp;
}

// Task (unit u, split s): the online softmax over the split's items, then its partial; the unit's
// last task merges.
template <typename T>
static void decode_task(const Problem& P, const Lists& L, const DecPlan& dp, const dec::In<T>& in,
                        dec::Partials& pp, int64_t task, dec::Work& w) {
  const auto [ui, s] = dp.of(task);
  const DecUnit& u = dp.units[ui];
  const int64_t D = P.D, Dv = P.Dv, R = u.rows(), nt = u.nt;
  const dec::UnitRows rows{u.b, u.h0, u.m0, nt, R};
  dec::start_split(in, rows, D, Dv, w);
  const auto [lo, hi] = dec::split_items(u.items, u.splits, s);
  const int64_t* pre = dp.pre.data() + u.pre;
  int64_t e = std::upper_bound(pre, pre + u.ne + 1, lo) - pre - 1;
  const int64_t m_last = u.m0 + nt - 1;
  for (int64_t it = lo; it < hi; ++it) {
    while (pre[e + 1] <= it) ++e;
    const bool partial = e < u.np;
    const int64_t c = partial ? L.part_idx[L.part_ptr[u.row] + e] : L.full_idx[L.full_ptr[u.row] + e - u.np];
    const int32_t mid = partial ? L.part_mask[L.part_ptr[u.row] + e] : -1;
    const int64_t n0 = c * P.bk, nblk = std::min(P.bk, P.Nk - n0);
    const int64_t j0 = (it - pre[e]) * dec::CHUNK;
    int64_t a = j0, end = std::min(j0 + dec::CHUNK, nblk);  // the chunk's columns [a, end) of the block
    if (partial) {  // trim to the columns that can hold an allowed element
      if (mid >= 0) {
        const int32_t* box = P.boxes.data() + static_cast<int64_t>(mid) * 4;
        a = std::max<int64_t>(a, box[2]);
        end = std::min<int64_t>(end, box[3]);
      }
      if (P.causal) end = std::min<int64_t>(end, m_last + P.delta - n0 + 1);
      if (a >= end) continue;
      a = std::max<int64_t>(j0, a / 16 * 16);  // mask words are read from multiples of 16
    }
    const int64_t nc = end - a, k0 = n0 + a;
    int64_t ldk, ldv;
    const float* kr = dec::rows_f32(in.k, u.b, u.kv, k0, nc, D, w.kv.p, ldk);
    dec::transpose_keys(kr, ldk, nc, D, w.kt.p);
    gemm(R, nc, D, D, dec::CHUNK, dec::LDS, false, w.q.p, w.kt.p, w.s.p);  // S = Q K^T  [R, nc]
    for (int64_t i = 0; i < R; ++i) {
      float* srow = w.s.p + i * dec::LDS;
      if (!partial) {
        softmax_step(srow, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * Dv, Dv, AllBits{});
        continue;
      }
      const int64_t m = rows.token(i);
      const int64_t nallow = P.causal ? std::min(nc, m + P.delta - k0 + 1) : nc;
      const int32_t* bits = mid >= 0 ? P.masks + (static_cast<int64_t>(mid) * P.bq + (m - u.r * P.bq)) * P.W : nullptr;
      softmax_step(srow, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * Dv, Dv, [&](int64_t jv) {
        const uint32_t kb = len_bits(nallow - jv);
        return bits != nullptr && kb ? kb & word_bits(bits, a + jv) : kb;
      });
    }
    const float* vr = dec::rows_f32(in.v, u.b, u.kv, k0, nc, Dv, w.kv.p, ldv);
    gemm(R, Dv, nc, dec::LDS, ldv, Dv, true, w.s.p, vr, w.acc.p);  // acc += P V  [R, Dv]
  }
  dec::finish_split(in, rows, P.Hq, P.Nq, Dv, dp, pp, ui, s, u.splits, w);
}

// The decode forward op: fwd's arguments and results (see kernel.cpp), for any Nq (meant for
// Nq <= dec::MAX_QUERIES).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_decode(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& full_ptr,
    const at::Tensor& full_idx, const at::Tensor& part_ptr, const at::Tensor& part_idx,
    const at::Tensor& part_mask, const at::Tensor& masks, int64_t block_q, int64_t block_k, int64_t stride_lb,
    int64_t stride_lh, std::optional<int64_t> causal_offset, double sm_scale, const std::optional<at::Tensor>& sinks,
    bool residual) {
  const Dims d = check_qkv(q, k, v);
  dec::Tally tally;
  const Problem P = make_problem(d, block_q, block_k, stride_lb, stride_lh, causal_offset, sm_scale, masks);
  const Lists L = lists_of(P, true, full_ptr, full_idx, part_ptr, part_idx, part_mask);
  const float* sinks2 = sinks_of(sinks, P.Hq);
  Results res = forward_results(q, v, residual);
  if (P.B * P.Hq * P.Nq * P.D == 0) return res.tuple();
  const DecPlan dp = decode_plan(P, L);
  dec::Partials pp(dp, tally);
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const dec::In<scalar_t> in(q, k, v, row_store<scalar_t>(res, sinks2));
    run_tasks(dp.tasks, [&] { return std::make_unique<dec::Work>(dp.max_rows, P.D, P.Dv, 0, tally); },
              [&](int64_t t, dec::Work& w) { decode_task<scalar_t>(P, L, dp, in, pp, t, w); });
  });
  return res.tuple();
}

int64_t decode_work_bytes() { return dec::work_bytes().load(); }

}  // namespace sia
