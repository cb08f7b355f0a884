// Backward: one task per (batch, kv head, key segment), then the dQ reduction.
// Part of kernel.cpp's single translation unit (see kernel.cpp for the overview).
#pragma once

#include "schedule.h"

namespace sia {

// ------------------------------------------------------------------------------ backward
struct BwdIn : OperandRows {  // Q, K, V, dO: fp32 rows (views or packed copies)
  using OperandRows::OperandRows;
  const float *QT, *dOT;      // [B, Hq, nqb, D, bq], [B, Hq, nqb, Dv, bq]
  const float* KT;            // [B, Hkv, nkb, D, bk]
  const float *m, *l2, *dl;   // [B*Hq, ldst]: row max (+inf on padding), log2 row sum, delta
  int64_t ldst;
  int64_t Sk;                 // key segments per (batch, kv head)
  float* dqt;                 // [Sk, B, Hq, nqb, D, bq]: per-segment dQ^T partial sums
  int32_t* qrange;            // [B*Hq, Sk, 2]: query blocks [lo, hi] a segment touched (hi < lo: none)
};

struct BwdState {
  Buf s, dp, dk, dv;
  std::vector<int64_t> cost;
  explicit BwdState(const Problem& P)
      : s(P.BNK * P.lds_b), dp(P.BNK * P.lds_b), dk(P.BNK * P.D), dv(P.BNK * P.Dv) {}
};

// The key tiles [lo, hi) of segment s of (b, g): cut at equal shares of the schedule entries
// (plus one per tile) of the group's query heads. Depends on the layout only.
static std::pair<int64_t, int64_t> segment_tiles(const Problem& P, const Lists& L, const BwdIn& in, int64_t b,
                                                 int64_t g, int64_t s, std::vector<int64_t>& cost) {
  const int64_t NT = P.nkb * P.nsubk;
  if (in.Sk == 1) return {0, NT};
  cost.assign(NT + 1, 0);
  for (int64_t t = 0; t < NT; ++t) {
    const int64_t c = t / P.nsubk;
    int64_t n = 1;
    for (int64_t jh = 0; jh < P.G; ++jh) {
      const int64_t h = g * P.G + jh;
      n += L.count((b * P.slb + h * P.slh) * (P.nkb + 1) + c);
    }
    cost[t + 1] = cost[t] + n;
  }
  const int64_t total = cost[NT];
  // tile t belongs to segment floor(cost[t] * Sk / total)
  int64_t lo = NT, hi = NT;
  for (int64_t t = 0; t < NT; ++t) {
    const int64_t seg = cost[t] * in.Sk / total;
    if (seg == s && lo == NT) lo = t;
    if (seg > s) {
      hi = t;
      break;
    }
  }
  if (lo == NT) return {0, 0};
  return {lo, hi};
}

template <typename T>
static void bwd_task(const Problem& P, const Lists& L, const BwdIn& in, T* dk, T* dv, int64_t task, BwdState& w) {
  const int64_t BH = P.B * P.Hkv;
  const int64_t s = task / BH, b = (task % BH) / P.Hkv, g = task % P.Hkv;
  const auto [t_lo, t_hi] = segment_tiles(P, L, in, b, g, s, w.cost);
  const int64_t D = P.D, Dv = P.Dv, lds = P.lds_b, bq = P.bq;

  // query blocks this segment touches, per query head: zero their dQ^T partial sums
  for (int64_t jh = 0; jh < P.G; ++jh) {
    const int64_t h = g * P.G + jh;
    const int64_t lid = b * P.slb + h * P.slh;
    int64_t lo = P.nqb, hi = -1;
    for (int64_t c = (t_lo / P.nsubk); t_lo < t_hi && c <= (t_hi - 1) / P.nsubk; ++c) {
      const int64_t col = lid * (P.nkb + 1) + c;
      for (int64_t e = L.part_ptr[col]; e < L.part_ptr[col + 1]; ++e) {
        lo = std::min<int64_t>(lo, L.part_idx[e]);
        hi = std::max<int64_t>(hi, L.part_idx[e]);
      }
      for (int64_t e = L.full_ptr[col]; e < L.full_ptr[col + 1]; ++e) {
        lo = std::min<int64_t>(lo, L.full_idx[e]);
        hi = std::max<int64_t>(hi, L.full_idx[e]);
      }
    }
    int32_t* rg = in.qrange + ((b * P.Hq + h) * in.Sk + s) * 2;
    rg[0] = static_cast<int32_t>(lo);
    rg[1] = static_cast<int32_t>(hi);
    if (hi >= lo) {
      float* base = in.dqt + (((s * P.B + b) * P.Hq + h) * P.nqb + lo) * D * bq;
      std::fill(base, base + (hi - lo + 1) * D * bq, 0.f);
    }
  }

  const Vec vc(P.c2);
  float* S = w.s.p;    // S^T, then P^T
  float* dP = w.dp.p;  // dP^T, then dS^T
  float* dK = w.dk.p;
  float* dV = w.dv.p;

  for (int64_t tile = t_lo; tile < t_hi; ++tile) {
    const int64_t c = tile / P.nsubk, kt = tile % P.nsubk;
    const int64_t n0 = c * P.bk + kt * P.BNK;
    const int64_t nk = std::min({P.BNK, P.bk - kt * P.BNK, P.Nk - n0});
    if (nk <= 0) continue;
    const float* kp = in.K.at(b, g, n0);
    const float* vp = in.V.at(b, g, n0);
    const float* ktp = in.KT + ((b * P.Hkv + g) * P.nkb + c) * D * P.bk + kt * P.BNK;
    std::fill(dK, dK + nk * D, 0.f);
    std::fill(dV, dV + nk * Dv, 0.f);

    for (int64_t jh = 0; jh < P.G; ++jh) {
      const int64_t h = g * P.G + jh;
      const float* mbase = in.m + (b * P.Hq + h) * in.ldst;
      const float* lbase = in.l2 + (b * P.Hq + h) * in.ldst;
      const float* dbase = in.dl + (b * P.Hq + h) * in.ldst;

      auto qblock = [&](int64_t r, int32_t mid, bool partial) {
        const int64_t boff = ((b * P.Hq + h) * P.nqb + r) * D * bq, boff_v = boff / D * Dv;
        float* dq_blk = in.dqt + (((s * P.B + b) * P.Hq + h) * P.nqb + r) * D * bq;
        for (int64_t sub = 0; sub < P.nsubq; ++sub) {
          const int64_t i0 = sub * P.BM;  // query offset inside the block
          const int64_t m0 = r * bq + i0;
          const int64_t mq = std::min({P.BM, bq - i0, P.Nq - m0});
          if (mq <= 0) break;
          // S^T rows (keys) [ja, je) and columns (queries) [ia, ie) that can hold an allowed element
          int64_t ja = 0, je = nk, ia = 0, ie = mq;
          if (partial) {
            if (mid >= 0) {
              const int32_t* box = P.boxes.data() + static_cast<int64_t>(mid) * 4;
              ia = std::max<int64_t>(ia, box[0] - i0);
              ie = std::min<int64_t>(ie, box[1] - i0);
              ja = std::max<int64_t>(ja, box[2] - kt * P.BNK);
              je = std::min<int64_t>(je, box[3] - kt * P.BNK);
            }
            if (P.causal) {  // key n0 + j allowed for query m0 + i iff n0 + j <= m0 + i + delta
              je = std::min<int64_t>(je, m0 + ie - 1 + P.delta - n0 + 1);
              ia = std::max<int64_t>(ia, n0 + ja - P.delta - m0);
            }
            if (ja >= je || ia >= ie) continue;
            ia = ia / 16 * 16;  // mask words are read from multiples of 16
          }
          const int64_t nj = je - ja, ni = ie - ia;
          float* S0 = S + ja * lds + ia;
          float* dP0 = dP + ja * lds + ia;
          gemm(nj, ni, D, in.K.ld, bq, lds, false, kp + ja * in.K.ld, in.QT + boff + i0 + ia, S0);
          gemm(nj, ni, Dv, in.V.ld, bq, lds, false, vp + ja * in.V.ld, in.dOT + boff_v + i0 + ia, dP0);
          const int64_t niv = round_up(ni, VL);
          const float* mr = mbase + m0 + ia;
          const float* lr = lbase + m0 + ia;
          const float* dr = dbase + m0 + ia;
          for (int64_t j = ja; j < je; ++j) {
            float* srow = S + j * lds + ia;
            float* prow = dP + j * lds + ia;
            if (partial) {
              // key n0 + j is allowed for query m0 + ia + i iff n0 + j <= m0 + ia + i + delta, i.e. i >= lo
              const int64_t lo = P.causal ? n0 + j - P.delta - m0 - ia : std::numeric_limits<int32_t>::min();
              const int32_t* bits = mid >= 0
                  ? P.masks_t + (static_cast<int64_t>(mid) * P.bk + (kt * P.BNK + j)) * P.WT : nullptr;
              for (int64_t iv = 0; iv < niv; iv += VL) {
                uint32_t kb = len_bits(mq - ia - iv) & ~len_bits(lo - iv);
                if (bits != nullptr && kb) kb &= word_bits(bits, i0 + ia + iv);
                // the forward's exact arithmetic: fl(c s) - m
                const Vec x = keep_bits(saturate(Vec::loadu(srow + iv) * vc), kb) - Vec::loadu(mr + iv);
                const Vec p = vexp2(x - Vec::loadu(lr + iv));
                p.store(srow + iv);
                (p * (Vec::loadu(prow + iv) - Vec::loadu(dr + iv))).store(prow + iv);
              }
            } else {
              for (int64_t iv = 0; iv < niv; iv += VL) {
                const Vec p = vexp2((saturate(Vec::loadu(srow + iv) * vc) - Vec::loadu(mr + iv)) - Vec::loadu(lr + iv));
                p.store(srow + iv);
                (p * (Vec::loadu(prow + iv) - Vec::loadu(dr + iv))).store(prow + iv);
              }
            }
          }
          gemm(nj, Dv, ni, lds, in.dO.ld, Dv, true, S0, in.dO.at(b, h, m0 + ia), dV + ja * Dv);  // dV += P^T dO
          gemm(nj, D, ni, lds, in.Q.ld, D, true, dP0, in.Q.at(b, h, m0 + ia), dK + ja * D);   // dK += dS^T Q
          gemm(D, ni, nj, P.bk, lds, bq, true, ktp + ja, dP0, dq_blk + i0 + ia);             // dQ^T += K^T dS^T
        }
      };

      const int64_t lid = b * P.slb + h * P.slh;
      const int64_t col = lid * (P.nkb + 1) + c;
      for (int64_t e = L.part_ptr[col]; e < L.part_ptr[col + 1]; ++e) qblock(L.part_idx[e], L.part_mask[e], true);
      for (int64_t e = L.full_ptr[col]; e < L.full_ptr[col + 1]; ++e) qblock(L.full_idx[e], -1, false);
    }

    const int64_t orow = (b * P.Hkv + g) * P.Nk + n0;
    store_dkv(dK, nk * D, dV, nk * Dv, P.sm_scale, dk + orow * D, dv + orow * Dv);
  }
}

// dQ of one query block: the segments' dQ^T partial sums added in segment order, transposed
template <typename T>
static void dq_reduce_task(const Problem& P, const BwdIn& in, T* dq, int64_t task, Buf& acc) {
  const int64_t r = task % P.nqb, bh = task / P.nqb;
  const int64_t b = bh / P.Hq, h = bh % P.Hq;
  const int64_t D = P.D, bq = P.bq;
  const int64_t m0 = r * bq, nr = std::min(bq, P.Nq - m0);
  T* o = dq + (bh * P.Nq + m0) * D;
  bool any = false;
  for (int64_t s = 0; s < in.Sk; ++s) {
    const int32_t* rg = in.qrange + (bh * in.Sk + s) * 2;
    if (!(rg[0] <= r && r <= rg[1])) continue;
    const float* src = in.dqt + (((s * P.B + b) * P.Hq + h) * P.nqb + r) * D * bq;
    if (!any) {
      std::memcpy(acc.p, src, D * bq * sizeof(float));
      any = true;
    } else {
      add_row(acc.p, src, D * bq);
    }
  }
  if (!any) {
    for (int64_t i = 0; i < nr * D; ++i) o[i] = static_cast<T>(0.f);
    return;
  }
  const float sc = P.sm_scale;
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t d = 0; d < D; ++d) o[i * D + d] = static_cast<T>(acc.p[d * bq + i] * sc);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& stats, const at::Tensor& full_ptr, const at::Tensor& full_idx, const at::Tensor& part_ptr,
    const at::Tensor& part_idx, const at::Tensor& part_mask, const at::Tensor& masks, const at::Tensor& masks_t,
    int64_t block_q, int64_t block_k, int64_t stride_lb, int64_t stride_lh, std::optional<int64_t> causal_offset,
    double sm_scale, const std::optional<at::Tensor>& delta) {
  const Dims dims = check_qkv(q, k, v);
  check_grad_inputs(q, v, dout, out, stats);
  Problem P = make_problem(dims, block_q, block_k, stride_lb, stride_lh, causal_offset, sm_scale, masks);
  TORCH_CHECK(masks_t.scalar_type() == at::kInt && masks_t.is_contiguous() && masks_t.dim() == 3 &&
                  masks_t.size(0) == masks.size(0) && masks_t.size(1) == block_k && masks_t.size(2) == P.WT,
              "sparse_io_attn cpu: masks_t must be transpose_masks(masks)");
  P.masks_t = masks_t.data_ptr<int32_t>();
  const Lists C = lists_of(P, false, full_ptr, full_idx, part_ptr, part_idx, part_mask);
  const int64_t B = P.B, Hq = P.Hq, Hkv = P.Hkv, Nq = P.Nq, Nk = P.Nk, D = P.D;
  const int64_t NqP = P.nqb * P.bq, NkP = P.nkb * P.bk;

  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = grad_results(q, k, v);
  if (B * Hq * Nq * D == 0 || B * Hkv * Nk == 0) return {dq, dk, dv};

  BwdIn in(q, k, v, dout, NqP, NkP);
  Buf qt(B * Hq * NqP * D), dot(B * Hq * NqP * P.Dv), kt(B * Hkv * NkP * D);
  pack_transposed(q, P.bq, P.nqb, qt.p);
  pack_transposed(dout, P.bq, P.nqb, dot.p);
  pack_transposed(k, P.bk, P.nkb, kt.p);
  in.QT = qt.p;
  in.dOT = dot.p;
  in.KT = kt.p;

  // per-row statistics, padded with +inf (m) / 0 so that padded query rows get P = 0
  in.ldst = round_up(NqP, VL) + VL;
  Buf mbuf(B * Hq * in.ldst), lbuf(B * Hq * in.ldst), dbuf(B * Hq * in.ldst);
  in.m = mbuf.p;
  in.l2 = lbuf.p;
  in.dl = dbuf.p;
  deltas_into(delta, out, dout, dbuf.p, in.ldst, 1);
  {
    const auto st = stats.contiguous();
    const float* sm = st.data_ptr<float>();
    const float* sl = sm + B * Hq * Nq;
    const int64_t ldst = in.ldst;
    for (int64_t bh = 0; bh < B * Hq; ++bh) {
      std::copy(sm + bh * Nq, sm + (bh + 1) * Nq, mbuf.p + bh * ldst);
      std::copy(sl + bh * Nq, sl + (bh + 1) * Nq, lbuf.p + bh * ldst);
      std::fill(mbuf.p + bh * ldst + Nq, mbuf.p + (bh + 1) * ldst, POS_INF);
      std::fill(lbuf.p + bh * ldst + Nq, lbuf.p + (bh + 1) * ldst, 0.f);
      std::fill(dbuf.p + bh * ldst + Nq, dbuf.p + (bh + 1) * ldst, 0.f);
    }
  }

  // key segments: about TARGET_TASKS tasks in all (a function of the shapes only)
  // (and at most MAX_DQ_PARTIAL_BYTES of dQ^T partial sums)
  const int64_t NT = P.nkb * P.nsubk;
  const int64_t dq_bytes = B * Hq * NqP * D * static_cast<int64_t>(sizeof(float));
  in.Sk = std::max<int64_t>(1, std::min({NT, cdiv(TARGET_TASKS, B * Hkv), MAX_DQ_PARTIAL_BYTES / dq_bytes}));
  Buf dqt(in.Sk * B * Hq * NqP * D);
  std::vector<int32_t> qrange(B * Hq * in.Sk * 2);
  in.dqt = dqt.p;
  in.qrange = qrange.data();

  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* dq_p = dq.data_ptr<scalar_t>();
    scalar_t* dk_p = dk.data_ptr<scalar_t>();
    scalar_t* dv_p = dv.data_ptr<scalar_t>();
    run_tasks(B * Hkv * in.Sk, [&] { return std::make_unique<BwdState>(P); },
              [&](int64_t t, BwdState& w) { bwd_task<scalar_t>(P, C, in, dk_p, dv_p, t, w); });
    run_tasks(B * Hq * P.nqb, [&] { return std::make_unique<Buf>(D * P.bq); },
              [&](int64_t t, Buf& acc) { dq_reduce_task<scalar_t>(P, in, dq_p, t, acc); });
  });
  return {dq, dk, dv};
}

}  // namespace sia
