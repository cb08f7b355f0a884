// Forward: one task per (batch, query head, query tile), online softmax over the kept key blocks.
// Part of kernel.cpp's single translation unit (see kernel.cpp for the overview).
#pragma once

#include "schedule.h"
#include "softmax.h"

namespace sia {

// ------------------------------------------------------------------------------ forward
struct Seg {                // one key chunk of a softmax group
  int64_t k0, nc, col, j0;  // first key, keys, column in S, offset inside its block
  int64_t i0, i1;           // the tile rows that can have an allowed element here
  int32_t mid;              // element mask id (-1: none)
  bool partial;
  const float* kt;          // K^T columns of the chunk (leading dimension bk)
};

struct FwdState {
  Buf s, acc, rows;
  std::vector<Seg> segs;
  explicit FwdState(const Problem& P) : s(P.BM * P.lds_f), acc(P.BM * P.Dv), rows(6 * P.BMv) { segs.reserve(64); }
};

template <typename T>
static void fwd_task(const Problem& P, const Lists& L, const Rows& Q, const float* KT, const Rows& V,
                     const RowStore<T>& store, int64_t task, FwdState& w) {
  int64_t t = task;
  const int64_t sub = t % P.nsubq;
  t /= P.nsubq;
  const int64_t r = P.nqb - 1 - (t % P.nqb);  // last query blocks first (the longest rows under causal)
  t /= P.nqb;
  const int64_t h = t % P.Hq, b = t / P.Hq, hk = h / P.G;
  const int64_t m0 = r * P.bq + sub * P.BM;
  const int64_t mend = std::min(r * P.bq + std::min((sub + 1) * P.BM, P.bq), P.Nq);
  const int64_t mrows = mend - m0;
  if (mrows <= 0) return;
  const int64_t D = P.D, Dv = P.Dv, lds = P.lds_f, BMv = P.BMv, rq = m0 - r * P.bq;
  const float* q = Q.at(b, h, m0);
  float* acc = w.acc.p;
  float* S = w.s.p;
  float* mi = w.rows.p;   // running row maximum (base 2)
  float* li = mi + BMv;   // running row sum
  float* mn = li + BMv;   // new maximum
  float* ms = mn + BMv;   // new maximum, 0 where -inf
  float* al = ms + BMv;   // rescale factor
  float* rs = al + BMv;   // row sum of the group
  std::fill(acc, acc + mrows * Dv, 0.f);
  std::fill(mi, mi + BMv, NEG_INF);
  std::fill(li, li + BMv, 0.f);
  std::fill(mn, mn + BMv, NEG_INF);
  // Scores are scaled first (t = fl(c s)), the row maximum is the maximum of the scaled scores and
  // p = exp2(t - m) subtracts that same value, so the row's largest t gives exactly exp2(0) = 1
  // however large the logits are (a fused fma(s, c, -m) would keep fl(c s)'s rounding error, which
  // exp2 amplifies past float range once |t| passes about 2^32). backward.h repeats the same
  // operations. c > 0: the max pass reads raw scores and m = fl(c max(s)), which equals
  // max(fl(c s)) because rounding is monotonic; otherwise the max pass stores fl(c s) itself.
  // t saturates at the largest finite float (saturate), as the other backends' scores do: past it
  // the row's largest scores share its probability and m, hence lse, stays finite.
  const bool fast = P.c2 > 0.f;
  const Vec vc(P.c2), vf(fast ? P.c2 : 1.f);
  std::vector<Seg>& segs = w.segs;
  segs.clear();
  int64_t used = 0;

  auto run_group = [&]() {
    if (segs.empty()) return;
    for (const Seg& g : segs)
      gemm(g.i1 - g.i0, g.nc, D, Q.ld, P.bk, lds, false, q + g.i0 * Q.ld, g.kt, S + g.i0 * lds + g.col);
    // pass 1: masks, row maximum
    for (int64_t i = 0; i < mrows; ++i) {
      float* srow = S + i * lds;
      Vec vmax(NEG_INF);
      for (const Seg& g : segs) {
        if (i < g.i0 || i >= g.i1) continue;
        float* s = srow + g.col;
        const int64_t ncv = round_up(g.nc, VL);
        if (g.partial) {
          int64_t nallow = g.nc;
          if (P.causal) nallow = std::min(nallow, m0 + i + P.delta - g.k0 + 1);
          const int32_t* bits =
              g.mid >= 0 ? P.masks + (static_cast<int64_t>(g.mid) * P.bq + rq + i) * P.W : nullptr;
          for (int64_t jv = 0; jv < ncv; jv += VL) {
            uint32_t kb = len_bits(nallow - jv);
            if (bits != nullptr && kb) kb &= word_bits(bits, g.j0 + jv);
            Vec x = Vec::loadu(s + jv);
            if (!fast) x = saturate(x * vc);
            x = keep_bits(x, kb);
            x.store(s + jv);
            vmax = at::vec::maximum(vmax, x);
          }
        } else if (fast) {
          int64_t jv = 0;
          for (; jv + VL <= g.nc; jv += VL) vmax = at::vec::maximum(vmax, Vec::loadu(s + jv));
          if (jv < g.nc) {
            const Vec x = keep_bits(Vec::loadu(s + jv), len_bits(g.nc - jv));
            x.store(s + jv);
            vmax = at::vec::maximum(vmax, x);
          }
        } else {
          for (int64_t jv = 0; jv < ncv; jv += VL) {
            Vec x = saturate(Vec::loadu(s + jv) * vc);
            if (jv + VL > g.nc) x = keep_bits(x, len_bits(g.nc - jv));
            x.store(s + jv);
            vmax = at::vec::maximum(vmax, x);
          }
        }
      }
      float mx = hmax(vmax);
      if (fast) mx = std::min(mx * P.c2, FLT_MAX_F);
      mn[i] = std::max(mi[i], mx);
    }
    // rescale factors of all rows at once
    for (int64_t i = 0; i < mrows; i += VL) {
      const Vec vn = Vec::loadu(mn + i);
      const Vec vs = Vec::blendv(vn, Vec(0.f), vn == Vec(NEG_INF));
      vs.store(ms + i);
      vexp2(Vec::loadu(mi + i) - vs).store(al + i);
    }
    // pass 2: p = exp2(fl(c s) - m), row sums (vf = 1 when pass 1 already stored fl(c s))
    for (int64_t i = 0; i < mrows; ++i) {
      float* srow = S + i * lds;
      const Vec vm(ms[i]);
      Vec vsum(0.f);
      for (const Seg& g : segs) {
        if (i < g.i0 || i >= g.i1) continue;
        float* s = srow + g.col;
        const int64_t ncv = round_up(g.nc, VL);
        for (int64_t jv = 0; jv < ncv; jv += VL) {
          const Vec p = vexp2(saturate(Vec::loadu(s + jv) * vf) - vm);
          p.store(s + jv);
          vsum = vsum + p;
        }
      }
      rs[i] = hsum(vsum);
    }
    for (int64_t i = 0; i < mrows; ++i) {
      const float a = al[i];
      li[i] = li[i] * a + rs[i];
      if (a != 1.f && mi[i] != NEG_INF) scale_row(acc + i * Dv, Dv, a);
      mi[i] = mn[i];
    }
    for (const Seg& g : segs)
      gemm(g.i1 - g.i0, Dv, g.nc, lds, V.ld, Dv, true, S + g.i0 * lds + g.col, V.at(b, hk, g.k0), acc + g.i0 * Dv);
    segs.clear();
    used = 0;
  };

  auto add_block = [&](int64_t c, int32_t mid, bool partial) {
    const int64_t n0 = c * P.bk;
    const int64_t nblk = std::min(P.bk, P.Nk - n0);
    const float* kt = KT + ((b * P.Hkv + hk) * P.nkb + c) * D * P.bk;
    for (int64_t j0 = 0; j0 < nblk; j0 += P.BN) {
      int64_t a = j0, e = std::min(j0 + P.BN, nblk);  // chunk columns [a, e) and rows [i0, i1)
      int64_t i0 = 0, i1 = mrows;
      if (partial) {  // trim to the rows/columns that can hold an allowed element
        if (mid >= 0) {
          const int32_t* box = P.boxes.data() + static_cast<int64_t>(mid) * 4;
          i0 = std::max<int64_t>(i0, box[0] - rq);
          i1 = std::min<int64_t>(i1, box[1] - rq);
          a = std::max<int64_t>(a, box[2]);
          e = std::min<int64_t>(e, box[3]);
        }
        if (P.causal) {  // key n0 + j allowed for query m0 + i iff n0 + j <= m0 + i + delta
          i0 = std::max<int64_t>(i0, n0 + a - P.delta - m0);
          e = std::min<int64_t>(e, m0 + i1 - 1 + P.delta - n0 + 1);
        }
        if (i0 >= i1 || a >= e) continue;
        a = std::max<int64_t>(j0, a / 16 * 16);  // mask words are read from multiples of 16
      }
      const int64_t nc = e - a;
      const int64_t width = round_up(nc, VL);
      if (used + width > P.gcols) run_group();
      segs.push_back(Seg{n0 + a, nc, used, a, i0, i1, mid, partial, kt + a});
      used += width;
    }
  };

  const int64_t lid = b * P.slb + h * P.slh;
  const int64_t row = lid * (P.nqb + 1) + r;
  for (int64_t e = L.part_ptr[row]; e < L.part_ptr[row + 1]; ++e) add_block(L.part_idx[e], L.part_mask[e], true);
  for (int64_t e = L.full_ptr[row]; e < L.full_ptr[row + 1]; ++e) add_block(L.full_idx[e], -1, false);
  run_group();

  const int64_t rbase = (b * P.Hq + h) * P.Nq + m0;
  for (int64_t i = 0; i < mrows; ++i) store.put(rbase + i, h, acc + i * Dv, mi[i], li[i]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& full_ptr,
    const at::Tensor& full_idx, const at::Tensor& part_ptr, const at::Tensor& part_idx,
    const at::Tensor& part_mask, const at::Tensor& masks, int64_t block_q, int64_t block_k, int64_t stride_lb,
    int64_t stride_lh, std::optional<int64_t> causal_offset, double sm_scale, const std::optional<at::Tensor>& sinks,
    bool residual) {
  const Problem P = make_problem(check_qkv(q, k, v), block_q, block_k, stride_lb, stride_lh, causal_offset, sm_scale,
                                 masks);
  const Lists L = lists_of(P, true, full_ptr, full_idx, part_ptr, part_idx, part_mask);
  const float* sinks2 = sinks_of(sinks, P.Hq);
  const int64_t B = P.B, Hq = P.Hq, Nq = P.Nq, D = P.D;

  Results res = forward_results(q, v, residual);
  if (B * Hq * Nq * D == 0) return res.tuple();

  std::unique_ptr<Buf> q_store, v_store;
  const Rows Q = as_rows(q, P.nqb * P.bq, q_store);
  const Rows V = as_rows(v, P.nkb * P.bk, v_store);
  Buf kt(B * P.Hkv * P.nkb * D * P.bk);
  pack_transposed(k, P.bk, P.nkb, kt.p);

  const int64_t ntasks = B * Hq * P.nqb * P.nsubq;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const RowStore<scalar_t> store = row_store<scalar_t>(res, sinks2);
    run_tasks(ntasks, [&] { return std::make_unique<FwdState>(P); },
              [&](int64_t t, FwdState& w) { fwd_task<scalar_t>(P, L, Q, kt.p, V, store, t, w); });
  });
  return res.tuple();
}

}  // namespace sia
