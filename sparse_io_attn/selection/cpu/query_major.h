// Query-major family (small blocks): forward and dQ per (unit, chunk of query tokens) over each
// token's gathered keys, 16 keys at a time (online softmax in the forward); dK/dV per (b, kv head,
// run of key blocks) over the gathered query rows that chose them (the plan's key lists), 16 rows at
// a time, so every key's gradient is summed by one task and no accumulator is shared.
// Part of kernel.cpp's translation unit (see kernel.cpp for the overview).
#pragma once

#include "dots.h"
#include "problem.h"

namespace sia {
namespace sel {

constexpr int64_t QM_TOKENS = 16;  // query tokens per query-major task (and per merge/reduce task)
constexpr int64_t QM_KEYS = 64;    // keys per dK/dV task (whole blocks, at least one)

struct Inputs {        // fp32 rows of the operands (views or packed copies)
  Rows Q, K, V, dO;
  const float* st = nullptr;  // [B*Hq*Nq, 4]: per query row m, log2 l (the forward's stats), delta, 0
};

static int64_t max_keys(const Problem& P) { return P.K * std::min(P.bs, std::max<int64_t>(P.Nk, 1)); }

// The keys query t of selection l may use, as row pointers into K and V, in order (ascending
// block, then key), with DOTS spare copies of the first at the end.
struct KeyRows {
  std::vector<const float*> k, v;
  int64_t n = 0;
  explicit KeyRows(const Problem& P) : k(static_cast<size_t>(max_keys(P) + DOTS)), v(k.size()) {}
  void gather(const Problem& P, const Inputs& in, int64_t b, int64_t kv, int64_t l, int64_t t) {
    n = 0;
    const int32_t* row = P.rows + (l * P.Nq + t) * P.K;
    const int64_t cnt = P.counts[l * P.Nq + t];
    const float* kb = in.K.at(b, kv, 0);
    const float* vb = in.V.at(b, kv, 0);
    const int64_t ldk = in.K.ld, ldv = in.V.ld, bs = P.bs;
    const int64_t lim = P.causal ? std::min(P.Nk, t + P.delta + 1) : P.Nk;  // keys [0, lim) allowed
    if (bs == 1) {
      int64_t m = cnt;
      while (m > 0 && row[m - 1] >= lim) --m;
      for (int64_t j = 0; j < m; ++j) {
        k[j] = kb + row[j] * ldk;
        v[j] = vb + row[j] * ldv;
      }
      n = m;
    } else {
      for (int64_t j = 0; j < cnt; ++j) {
        const int64_t c = row[j];
        const int64_t na = std::min(bs, lim - c * bs);
        const float* kp = kb + c * bs * ldk;
        const float* vp = vb + c * bs * ldv;
        for (int64_t i = 0; i < na; ++i) {
          k[n] = kp + i * ldk;
          v[n] = vp + i * ldv;
          ++n;
        }
      }
    }
    for (int64_t i = 0; i < DOTS; ++i) {
      k[n + i] = n > 0 ? k[0] : kb;
      v[n + i] = n > 0 ? v[0] : vb;
    }
  }
};

struct QState {
  KeyRows keys;
  Buf acc;
  std::vector<float> m, l;
  explicit QState(const Problem& P) : keys(P), acc(P.R * P.D), m(P.R), l(P.R) {}
};

template <typename T, int NC>
static void qm_fwd_task(Kern<NC>, const Problem& P, const Inputs& in, T* out, float* lse, float* st_m,
                        float* st_l, int64_t task, QState& w) {
  using Kn = Kern<NC>;
  const int64_t nchunk = cdiv(P.Nq, QM_TOKENS);
  const int64_t u = task / nchunk, t0 = (task % nchunk) * QM_TOKENS, t1 = std::min(P.Nq, t0 + QM_TOKENS);
  const int64_t b = P.unit_b(u), kv = P.unit_kv(u), h0 = P.unit_h0(u), l = P.unit_l(u);
  const int64_t R = P.R, D = P.D;
  float* acc = w.acc.p;
  alignas(64) float sb[DOTS];
  const Vec vc(P.c2);
  for (int64_t t = t0; t < t1; ++t) {
    w.keys.gather(P, in, b, kv, l, t);
    const int64_t n = w.keys.n;
    const float* const* kp = w.keys.k.data();
    const float* const* vp = w.keys.v.data();
    std::fill(acc, acc + R * D, 0.f);
    std::fill(w.m.begin(), w.m.end(), NEG_INF);
    std::fill(w.l.begin(), w.l.end(), 0.f);
    Kn::prefetch(kp, std::min(DOTS, n), D);
    Kn::prefetch(vp, std::min(DOTS, n), D);
    for (int64_t j0 = 0; j0 < n; j0 += DOTS) {
      const int64_t nb = std::min(DOTS, n - j0);
      if (j0 + DOTS < n) {
        Kn::prefetch(kp + j0 + DOTS, std::min(DOTS, n - j0 - DOTS), D);
        Kn::prefetch(vp + j0 + DOTS, std::min(DOTS, n - j0 - DOTS), D);
      }
      for (int64_t r = 0; r < R; ++r) {
        Kn::dots(in.Q.at(b, h0 + r, t), kp + j0, D, sb);
        Vec vmax(NEG_INF);
        for (int64_t i = 0; i < DOTS; i += VL) {
          Vec x = saturate(Vec::loadu(sb + i) * vc);
          if (nb < DOTS) x = keep_bits(x, len_bits(nb - i));
          x.store(sb + i);
          vmax = at::vec::maximum(vmax, x);
        }
        const float mo = w.m[r], mn = std::max(mo, hmax(vmax));
        float* ar = acc + r * D;
        if (mn > mo && mo != NEG_INF) {  // the running maximum grew: rescale
          const float alpha = std::exp2(mo - mn);
          w.l[r] *= alpha;
          scale_row(ar, D, alpha);
        }
        const Vec vm(mn == NEG_INF ? 0.f : mn);
        Vec vsum(0.f);
        for (int64_t i = 0; i < DOTS; i += VL) {
          const Vec p = vexp2(Vec::loadu(sb + i) - vm);
          p.store(sb + i);
          vsum = vsum + p;
        }
        w.l[r] += hsum(vsum);
        w.m[r] = mn;
        Kn::axpy(ar, sb, nb, vp + j0, D);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (b * P.Hq + h0 + r) * P.Nq + t;
      T* o = out + row * D;
      const float lsum = w.l[r];
      if (lsum == 0.f) {
        std::fill(o, o + D, static_cast<T>(0.f));
        lse[row] = NEG_INF;
        st_m[row] = POS_INF;
        st_l[row] = 0.f;
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] / lsum);
        const float log2l = std::log2(lsum);
        lse[row] = (w.m[r] + log2l) * LN2;
        st_m[row] = w.m[r];
        st_l[row] = log2l;
      }
    }
  }
}

// dQ of a chunk of tokens: P and dS recomputed against the gathered keys, dq_r = sum_j dS_rj k_j
template <typename T, int NC>
static void qm_dq_task(Kern<NC>, const Problem& P, const Inputs& in, T* dq, int64_t task, QState& w) {
  using Kn = Kern<NC>;
  const int64_t nchunk = cdiv(P.Nq, QM_TOKENS);
  const int64_t u = task / nchunk, t0 = (task % nchunk) * QM_TOKENS, t1 = std::min(P.Nq, t0 + QM_TOKENS);
  const int64_t b = P.unit_b(u), kv = P.unit_kv(u), h0 = P.unit_h0(u), l = P.unit_l(u);
  const int64_t R = P.R, D = P.D;
  float* acc = w.acc.p;
  alignas(64) float sb[DOTS], pb[DOTS];
  const Vec vc(P.c2);
  for (int64_t t = t0; t < t1; ++t) {
    w.keys.gather(P, in, b, kv, l, t);
    const int64_t n = w.keys.n;
    const float* const* kp = w.keys.k.data();
    const float* const* vp = w.keys.v.data();
    std::fill(acc, acc + R * D, 0.f);
    Kn::prefetch(kp, std::min(DOTS, n), D);
    Kn::prefetch(vp, std::min(DOTS, n), D);
    for (int64_t j0 = 0; j0 < n; j0 += DOTS) {
      const int64_t nb = std::min(DOTS, n - j0);
      if (j0 + DOTS < n) {
        Kn::prefetch(kp + j0 + DOTS, std::min(DOTS, n - j0 - DOTS), D);
        Kn::prefetch(vp + j0 + DOTS, std::min(DOTS, n - j0 - DOTS), D);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = (b * P.Hq + h0 + r) * P.Nq + t;
        Kn::dots(in.Q.at(b, h0 + r, t), kp + j0, D, sb);
        Kn::dots(in.dO.at(b, h0 + r, t), vp + j0, D, pb);
        const Vec vm(in.st[row * 4]), vl(in.st[row * 4 + 1]), vd(in.st[row * 4 + 2]);
        for (int64_t i = 0; i < DOTS; i += VL) {
          Vec x = saturate(Vec::loadu(sb + i) * vc);
          if (nb < DOTS) x = keep_bits(x, len_bits(nb - i));
          const Vec p = vexp2((x - vm) - vl);
          (p * (Vec::loadu(pb + i) - vd)).store(sb + i);
        }
        Kn::axpy(acc + r * D, sb, nb, kp + j0, D);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      T* o = dq + ((b * P.Hq + h0 + r) * P.Nq + t) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * P.sm_scale);
    }
  }
}

// dK/dV of a run of key blocks. The query rows of a block: for each selection serving this kv head
// (in order), the tokens of its list (ascending), each with the selection's heads here; for each key
// of the block, the rows allowed to use it, 16 at a time, their (p, dS) from the dot products with
// the key, summed into the key's dK, dV in row order.
struct KVState {
  std::vector<const float*> q, g, q2, g2;  // per row: q and dO rows (DOTS spare copies at the end)
  std::vector<float> st, st2;              // per row: m, log2 l, delta (three arrays of the row count)
  std::vector<int32_t> na;                 // per row: keys of the block it may use
  Buf dk, dv;
  explicit KVState(const Problem& P) : dk(P.D), dv(P.D) {}
};

static inline int64_t qm_blocks_per_task(const Problem& P) { return std::max<int64_t>(1, QM_KEYS / P.bs); }

template <typename T, int NC>
static void qm_dkv_task(Kern<NC>, const Problem& P, const Inputs& in, T* dk, T* dv, int64_t task,
                        KVState& w) {
  using Kn = Kern<NC>;
  const int64_t cpt = qm_blocks_per_task(P), ntask_c = cdiv(P.nkb, cpt);
  const int64_t bk = task / ntask_c, c_lo = (task % ntask_c) * cpt, c_hi = std::min(P.nkb, c_lo + cpt);
  const int64_t b = bk / P.Hkv, kv = bk % P.Hkv, D = P.D;
  const Vec vc(P.c2);
  alignas(64) float sb[DOTS], pb[DOTS];
  for (int64_t c = c_lo; c < c_hi; ++c) {
    const int64_t n0 = c * P.bs, nblk = std::min(P.bs, P.Nk - n0);
    // the block's rows
    int64_t nrows = 0;
    for (int64_t s = 0; s < P.spk; ++s) {
      const int32_t* ptr = P.col_ptr + P.unit_l((b * P.Hkv + kv) * P.spk + s) * (P.nkb + 1) + c;
      nrows += static_cast<int64_t>(ptr[1] - ptr[0]) * P.R;
    }
    const size_t cap = static_cast<size_t>(nrows + DOTS);
    if (w.q.size() < cap) {
      w.q.resize(cap), w.g.resize(cap), w.q2.resize(cap), w.g2.resize(cap), w.na.resize(cap);
      w.st.resize(3 * cap), w.st2.resize(3 * cap);
    }
    float *sm = w.st.data(), *sl = sm + cap, *sd = sl + cap;
    int64_t x = 0, min_na = P.bs;
    for (int64_t s = 0; s < P.spk; ++s) {
      const int64_t u = (b * P.Hkv + kv) * P.spk + s;
      const int64_t l = P.unit_l(u), h0 = P.unit_h0(u);
      const int32_t* ptr = P.col_ptr + l * (P.nkb + 1) + c;
      for (int64_t e = ptr[0]; e < ptr[1]; ++e) {
        const int64_t t = P.col_query[e], na = P.allowed(t, c);
        min_na = std::min(min_na, na);
        for (int64_t r = 0; r < P.R; ++r, ++x) {
          const int64_t row = (b * P.Hq + h0 + r) * P.Nq + t;
          w.q[x] = in.Q.at(b, h0 + r, t);
          w.g[x] = in.dO.at(b, h0 + r, t);
          const float* st = in.st + row * 4;
          sm[x] = st[0];
          sl[x] = st[1];
          sd[x] = st[2];
          w.na[x] = static_cast<int32_t>(na);
        }
      }
    }
    for (int64_t i = 0; i < DOTS; ++i, ++x) {  // spare rows for whole groups of 16 (results dropped)
      w.q[x] = nrows > 0 ? w.q[0] : in.Q.at(b, 0, 0);
      w.g[x] = nrows > 0 ? w.g[0] : in.dO.at(b, 0, 0);
      sm[x] = sl[x] = sd[x] = 0.f;
    }
    for (int64_t key = 0; key < nblk; ++key) {
      // rows allowed to use this key (all of them, except where the block straddles the diagonal)
      const float* const* qs = w.q.data();
      const float* const* gs = w.g.data();
      const float *ms = sm, *ls = sl, *ds = sd;
      int64_t n = nrows;
      if (min_na <= key) {
        float *m2 = w.st2.data(), *l2 = m2 + cap, *d2 = l2 + cap;
        n = 0;
        for (int64_t i = 0; i < nrows + DOTS; ++i) {
          if (i < nrows && w.na[i] <= key) continue;
          w.q2[n] = w.q[i], w.g2[n] = w.g[i], m2[n] = sm[i], l2[n] = sl[i], d2[n] = sd[i];
          ++n;
        }
        n -= DOTS;
        qs = w.q2.data(), gs = w.g2.data(), ms = m2, ls = l2, ds = d2;
      }
      const float* kr = in.K.at(b, kv, n0 + key);
      const float* vr = in.V.at(b, kv, n0 + key);
      std::fill(w.dk.p, w.dk.p + D, 0.f);
      std::fill(w.dv.p, w.dv.p + D, 0.f);
      Kn::prefetch(qs, std::min(DOTS, n), D);
      Kn::prefetch(gs, std::min(DOTS, n), D);
      for (int64_t i0 = 0; i0 < n; i0 += DOTS) {
        const int64_t nb = std::min(DOTS, n - i0);
        if (i0 + DOTS < n) {
          Kn::prefetch(qs + i0 + DOTS, std::min(DOTS, n - i0 - DOTS), D);
          Kn::prefetch(gs + i0 + DOTS, std::min(DOTS, n - i0 - DOTS), D);
        }
        Kn::dots(kr, qs + i0, D, sb);
        Kn::dots(vr, gs + i0, D, pb);
        for (int64_t i = 0; i < DOTS; i += VL) {  // P and dS, the forward's arithmetic
          const Vec xv = saturate(Vec::loadu(sb + i) * vc);
          const Vec p = vexp2((xv - Vec::loadu(ms + i0 + i)) - Vec::loadu(ls + i0 + i));
          (p * (Vec::loadu(pb + i) - Vec::loadu(ds + i0 + i))).store(pb + i);
          p.store(sb + i);
        }
        Kn::axpy(w.dk.p, pb, nb, qs + i0, D);
        Kn::axpy(w.dv.p, sb, nb, gs + i0, D);
      }
      T* okr = dk + ((b * P.Hkv + kv) * P.Nk + n0 + key) * D;
      T* ovr = dv + ((b * P.Hkv + kv) * P.Nk + n0 + key) * D;
      for (int64_t d = 0; d < D; ++d) {
        okr[d] = static_cast<T>(w.dk.p[d] * P.sm_scale);
        ovr[d] = static_cast<T>(w.dv.p[d]);
      }
    }
  }
}

}  // namespace sel
}  // namespace sia
