// Key-major family (blocks of 16 keys and more): a task per (b, kv head, key block c, chunk of its
// gathered query rows). The rows of (b, kv head, c) are the pairs (query head h, token t) whose
// selection chose c: for each selection serving the kv head (in order), the tokens of its list for
// c (ascending), each with the heads of the selection in this kv head. Dense tiles of up to TM
// gathered rows against the block's keys (brgemm).
// Forward: per pair (row, c) the partial (m_p, l_p, O_p unnormalised) at the pair's slot (b, h, t, j),
// then a merge per row over its slots in order. Backward: dK_c, dV_c accumulated by the task (and
// the chunks of one block summed in chunk order when a block has several), dQ partials at the pair
// slots, then a reduction per row over its slots in order.
// Part of kernel.cpp's translation unit (see kernel.cpp for the overview).
#pragma once

#include "problem.h"
#include "query_major.h"
#include "softmax.h"

namespace sia {
namespace sel {

constexpr int64_t TM = 64;            // gathered rows per tile
constexpr int64_t FWD_CHUNK = 256;    // rows per forward task
constexpr int64_t BWD_CHUNK = 2048;   // rows per backward task
constexpr int64_t KEY_CHUNK = 256;    // keys per forward softmax step
constexpr int64_t BWD_KEYS = 128;     // keys per backward tile

// The rows of every (b, kv head, c) and how they are cut into chunks: a function of the plan and
// the chunk size only (never of the thread count).
struct Chunks {
  int64_t chunk;
  std::vector<int64_t> first;  // [B*Hkv*nkb + 1]: first task of each (b, kv, c)
  std::vector<int64_t> rows;   // [B*Hkv*nkb]: rows of each
  int64_t tasks() const { return first.back(); }
};

static Chunks make_chunks(const Problem& P, int64_t chunk) {
  Chunks C;
  C.chunk = chunk;
  const int64_t n = P.B * P.Hkv * P.nkb;
  C.first.assign(static_cast<size_t>(n + 1), 0);
  C.rows.assign(static_cast<size_t>(n), 0);
  for (int64_t x = 0; x < n; ++x) {
    const int64_t bk = x / P.nkb, c = x % P.nkb;
    int64_t r = 0;
    for (int64_t s = 0; s < P.spk; ++s) {
      const int32_t* p = P.col_ptr + P.unit_l(bk * P.spk + s) * (P.nkb + 1) + c;
      r += static_cast<int64_t>(p[1] - p[0]) * P.R;
    }
    C.rows[x] = r;
    C.first[x + 1] = C.first[x] + std::max<int64_t>(1, cdiv(r, chunk));
  }
  return C;
}

// Key-major task `task`: the gathered rows [r_lo, r_hi) of (b, kv, key block c), x = (b * Hkv + kv) *
// nkb + c (the last x with first[x] <= task); the block's keys [n0, n0 + nblk).
struct ChunkTask {
  int64_t x, c, b, kv, r_lo, r_hi, n0, nblk;
  ChunkTask(const Problem& P, const Chunks& C, int64_t task)
      : x(static_cast<int64_t>(std::upper_bound(C.first.begin(), C.first.end(), task) - C.first.begin()) - 1),
        c(x % P.nkb), b(x / P.nkb / P.Hkv), kv(x / P.nkb % P.Hkv), r_lo((task - C.first[x]) * C.chunk),
        r_hi(std::min(C.rows[x], r_lo + C.chunk)), n0(P.key0(c)), nblk(P.keys(c)) {}
};

// dst[0..n) = src[0..n): a pair's partial row, read back only by the merge/reduce pass much later,
// so written around the cache (no read for ownership) where dst is 64-byte aligned
static inline void store_stream(float* dst, const float* src, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0 && n % 16 == 0) {
    for (int64_t d = 0; d < n; d += 16) _mm512_stream_ps(dst + d, _mm512_loadu_ps(src + d));
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(float));
}

// the task's streamed stores, ordered before whatever the pool's barrier publishes
static inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_sfence();
#endif
}

// One gathered row: query head, token, slot of the pair, keys of the block it may use.
struct RowRef {
  int64_t h, t, j, na;
};

// Rows [r0, r0 + n) of (b, kv, c), in order.
static void row_refs(const Problem& P, int64_t b, int64_t kv, int64_t c, int64_t r0, int64_t n, RowRef* out) {
  int64_t skip = r0, got = 0;
  for (int64_t s = 0; s < P.spk && got < n; ++s) {
    const int64_t u = (b * P.Hkv + kv) * P.spk + s;
    const int64_t l = P.unit_l(u), h0 = P.unit_h0(u);
    const int32_t* p = P.col_ptr + l * (P.nkb + 1) + c;
    const int64_t len = static_cast<int64_t>(p[1] - p[0]) * P.R;
    if (skip >= len) {
      skip -= len;
      continue;
    }
    for (int64_t x = skip; x < len && got < n; ++x) {
      const int64_t e = p[0] + x / P.R;
      const int64_t t = P.col_query[e];
      out[got++] = RowRef{h0 + x % P.R, t, P.col_slot[e], P.allowed(t, c)};
    }
    skip = 0;
  }
}

struct KState {
  Buf qg, gg, s, dp, t1, acc, dk, dv, stat;
  std::vector<RowRef> refs;
  int64_t lds;
  explicit KState(const Problem& P, bool backward)
      : qg(TM * P.D), gg(backward ? TM * P.Dv : 1), s(TM * stride(P)), dp(backward ? TM * stride(P) : 1),
        t1(backward ? std::min(P.bs, BWD_KEYS) * LDC : 1), acc(TM * std::max(P.D, P.Dv)),
        dk(backward ? P.bs * P.D : 1), dv(backward ? P.bs * P.Dv : 1), stat(8 * LDC), refs(TM),
        lds(stride(P)) {}
  static constexpr int64_t LDC = TM + 16;  // per-row columns (stat) and transposed tiles (t1): leading dimension
  float* col(int64_t k) { return stat.p + k * LDC; }
  // leading dimension of the score tiles: whole vectors of the widest key chunk, plus 16
  static int64_t stride(const Problem& P) { return round_up(std::min(P.bs, KEY_CHUNK), 16) + 16; }
};

// ------------------------------------------------------------------------------ forward
struct Partials {  // per pair slot (b, h, t, j)
  float* o;        // [B*Hq*Nq*K, Dv] unnormalised output
  float* m;        // row maximum (base 2)
  float* l;        // row sum
};

static void km_fwd_task(const Problem& P, const Inputs& in, const float* KT, const Chunks& C, const Partials& out,
                        int64_t task, KState& w) {
  const ChunkTask ct(P, C, task);
  const int64_t b = ct.b, kv = ct.kv, c = ct.c, n0 = ct.n0, nblk = ct.nblk, r_lo = ct.r_lo, r_hi = ct.r_hi;
  const int64_t D = P.D, Dv = P.Dv, lds = w.lds;
  const float* kt = KT + ct.x * D * P.bs;  // [D, bs]
  float *Qg = w.qg.p, *S = w.s.p, *acc = w.acc.p;
  float *mi = w.col(0), *li = w.col(1), *al = w.col(2);  // row maximum, row sum, rescale factor
  const Vec vc(P.c2);
  for (int64_t r0 = r_lo; r0 < r_hi; r0 += TM) {
    const int64_t tm = std::min(TM, r_hi - r0);
    RowRef* ref = w.refs.data();
    row_refs(P, b, kv, c, r0, tm, ref);
    for (int64_t i = 0; i < tm; ++i)
      std::memcpy(Qg + i * D, in.Q.at(b, ref[i].h, ref[i].t), D * sizeof(float));
    std::fill(mi, mi + tm, NEG_INF);
    std::fill(li, li + tm, 0.f);
    for (int64_t a = 0; a < nblk; a += KEY_CHUNK) {
      const int64_t nc = std::min(KEY_CHUNK, nblk - a), ncv = round_up(nc, VL);
      gemm(tm, nc, D, D, P.bs, lds, false, Qg, kt + a, S);  // S = Qg K_c^T  [tm, nc]
      for (int64_t i = 0; i < tm; ++i) {
        float* s = S + i * lds;
        const int64_t allow = std::min(nc, ref[i].na - a);
        const float mn = std::max(mi[i], scaled_max(s, ncv, vc, [&](int64_t jv) { return len_bits(allow - jv); }));
        const float psum = exp2_sum(s, ncv, mn);
        const float alpha = mi[i] == NEG_INF ? 0.f : std::exp2(mi[i] - mn);
        al[i] = alpha;
        li[i] = li[i] * alpha + psum;
        mi[i] = mn;
      }
      if (a > 0)
        for (int64_t i = 0; i < tm; ++i)
          if (al[i] != 1.f) scale_row(acc + i * Dv, Dv, al[i]);
      gemm(tm, Dv, nc, lds, in.V.ld, Dv, a > 0, S, in.V.at(b, kv, n0 + a), acc);  // acc (+)= P V_c
    }
    for (int64_t i = 0; i < tm; ++i) {
      const int64_t slot = ((b * P.Hq + ref[i].h) * P.Nq + ref[i].t) * P.K + ref[i].j;
      store_stream(out.o + slot * Dv, acc + i * Dv, Dv);
      out.m[slot] = mi[i];
      out.l[slot] = li[i];
    }
  }
  stream_fence();
}

// out, lse, stats of query rows [t0, t1) of (b, h): the pair partials merged in slot order
template <typename T>
static void km_merge_task(const Problem& P, const Partials& pp, const RowStore<T>& store, int64_t task, Buf& wbuf) {
  const int64_t nchunk = cdiv(P.Nq, QM_TOKENS);
  const int64_t bh = task / nchunk, t0 = (task % nchunk) * QM_TOKENS, t1 = std::min(P.Nq, t0 + QM_TOKENS);
  const int64_t b = bh / P.Hq, h = bh % P.Hq, l = b * P.slb + h / P.hps, D = P.Dv;
  float* acc = wbuf.p;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = bh * P.Nq + t, cnt = P.counts[l * P.Nq + t];
    const int64_t s0 = row * P.K;
    float m = NEG_INF;
    for (int64_t j = 0; j < cnt; ++j) m = std::max(m, pp.m[s0 + j]);
    float lsum = 0.f;
    if (m != NEG_INF) {
      std::fill(acc, acc + D, 0.f);
      for (int64_t j = 0; j < cnt; ++j) {
        const float wj = std::exp2(pp.m[s0 + j] - m);
        lsum += pp.l[s0 + j] * wj;
        const float* src = pp.o + (s0 + j) * D;
        const Vec vw(wj);
        int64_t d = 0;
        for (; d + VL <= D; d += VL) at::vec::fmadd(vw, Vec::loadu(src + d), Vec::loadu(acc + d)).store(acc + d);
        for (; d < D; ++d) acc[d] = std::fma(wj, src[d], acc[d]);
      }
    }
    store.put(row, h, acc, m, lsum);
  }
}

// ------------------------------------------------------------------------------ backward
struct KBwd {
  const float *KT, *VT;  // [B, Hkv, nkb, D, bs], [B, Hkv, nkb, Dv, bs]
  float* dqp;            // [B*Hq*Nq*K, D]: dQ partial of each pair slot (unscaled)
  float* dkvp;           // [tasks, bs, D + Dv]: dK ([bs, D]), then dV ([bs, Dv]) of the chunks of blocks with several
};

template <typename T>
static void km_bwd_task(const Problem& P, const Inputs& in, const KBwd& kb, const Chunks& C, T* dk, T* dv,
                        int64_t task, KState& w) {
  const ChunkTask ct(P, C, task);
  const int64_t x = ct.x, b = ct.b, kv = ct.kv, c = ct.c, n0 = ct.n0, nblk = ct.nblk, r_lo = ct.r_lo, r_hi = ct.r_hi;
  const int64_t D = P.D, Dv = P.Dv, lds = w.lds, ldt = KState::LDC;
  const float* kt = kb.KT + x * D * P.bs;
  const float* vt = kb.VT + x * Dv * P.bs;
  float *Qg = w.qg.p, *Gg = w.gg.p, *S = w.s.p, *dP = w.dp.p, *Tr = w.t1.p, *dQ = w.acc.p, *dK = w.dk.p, *dV = w.dv.p;
  float *mr = w.col(0), *lr = w.col(1), *dr = w.col(2);  // the rows' m, log2 l, delta
  std::fill(dK, dK + nblk * D, 0.f);
  std::fill(dV, dV + nblk * Dv, 0.f);
  const Vec vc(P.c2);
  for (int64_t r0 = r_lo; r0 < r_hi; r0 += TM) {
    const int64_t tm = std::min(TM, r_hi - r0);
    RowRef* ref = w.refs.data();
    row_refs(P, b, kv, c, r0, tm, ref);
    for (int64_t i = 0; i < tm; ++i) {
      const int64_t row = (b * P.Hq + ref[i].h) * P.Nq + ref[i].t;
      std::memcpy(Qg + i * D, in.Q.at(b, ref[i].h, ref[i].t), D * sizeof(float));
      std::memcpy(Gg + i * Dv, in.dO.at(b, ref[i].h, ref[i].t), Dv * sizeof(float));
      mr[i] = in.st[row * 4];
      lr[i] = in.st[row * 4 + 1];
      dr[i] = in.st[row * 4 + 2];
    }
    std::fill(dQ, dQ + tm * D, 0.f);
    for (int64_t a = 0; a < nblk; a += BWD_KEYS) {
      const int64_t nk = std::min(BWD_KEYS, nblk - a), nkv = round_up(nk, VL);
      gemm(tm, nk, D, D, P.bs, lds, false, Qg, kt + a, S);   // S = Qg K^T   [tm, nk]
      gemm(tm, nk, Dv, Dv, P.bs, lds, false, Gg, vt + a, dP);  // dP = dOg V^T [tm, nk]
      for (int64_t i = 0; i < tm; ++i) {
        float* s = S + i * lds;
        float* g = dP + i * lds;
        const int64_t allow = std::min(nk, ref[i].na - a);
        const Vec vm(mr[i]), vl(lr[i]), vd(dr[i]);
        for (int64_t jv = 0; jv < nkv; jv += VL) {
          const Vec xv = keep_bits(saturate(Vec::loadu(s + jv) * vc), len_bits(allow - jv));
          const Vec p = vexp2((xv - vm) - vl);
          p.store(s + jv);
          (p * (Vec::loadu(g + jv) - vd)).store(g + jv);
        }
      }
      at::vec::transpose_mxn<float>(S, lds, Tr, ldt, static_cast<int>(tm), static_cast<int>(nk));
      gemm(nk, Dv, tm, ldt, Dv, Dv, true, Tr, Gg, dV + a * Dv);  // dV += P^T dOg
      at::vec::transpose_mxn<float>(dP, lds, Tr, ldt, static_cast<int>(tm), static_cast<int>(nk));
      gemm(nk, D, tm, ldt, D, D, true, Tr, Qg, dK + a * D);  // dK += dS^T Qg
      gemm(tm, D, nk, lds, in.K.ld, D, true, dP, in.K.at(b, kv, n0 + a), dQ);  // dQ += dS K
    }
    for (int64_t i = 0; i < tm; ++i) {
      const int64_t slot = ((b * P.Hq + ref[i].h) * P.Nq + ref[i].t) * P.K + ref[i].j;
      store_stream(kb.dqp + slot * D, dQ + i * D, D);
    }
  }
  stream_fence();
  if (C.first[x + 1] - C.first[x] == 1) {
    const int64_t orow = (b * P.Hkv + kv) * P.Nk + n0;
    store_dkv(dK, nblk * D, dV, nblk * Dv, P.sm_scale, dk + orow * D, dv + orow * Dv);
  } else {
    float* dst = kb.dkvp + task * P.bs * (D + Dv);
    std::memcpy(dst, dK, nblk * D * sizeof(float));
    std::memcpy(dst + P.bs * D, dV, nblk * Dv * sizeof(float));
  }
}

// dK, dV of a block whose rows ran as several chunks: their sums in chunk order
template <typename T>
static void km_dkv_reduce(const Problem& P, const KBwd& kb, const Chunks& C, int64_t x, T* dk, T* dv, Buf& acc) {
  const int64_t n = C.first[x + 1] - C.first[x];
  if (n == 1) return;
  const int64_t bk = x / P.nkb, c = x % P.nkb, b = bk / P.Hkv, kv = bk % P.Hkv, W = P.bs * (P.D + P.Dv);
  const int64_t n0 = P.key0(c), nblk = P.keys(c);
  for (int64_t which = 0; which < 2; ++which) {
    const int64_t D = which == 0 ? P.D : P.Dv, off = which == 0 ? 0 : P.bs * P.D;
    std::memcpy(acc.p, kb.dkvp + C.first[x] * W + off, nblk * D * sizeof(float));
    for (int64_t s = 1; s < n; ++s) add_row(acc.p, kb.dkvp + (C.first[x] + s) * W + off, nblk * D);
    T* o = (which == 0 ? dk : dv) + ((b * P.Hkv + kv) * P.Nk + n0) * D;
    const float sc = which == 0 ? P.sm_scale : 1.f;
    for (int64_t i = 0; i < nblk * D; ++i) o[i] = static_cast<T>(acc.p[i] * sc);
  }
}

// dQ of query rows [t0, t1) of (b, h): the pair partials summed in slot order
template <typename T>
static void km_dq_reduce(const Problem& P, const KBwd& kb, T* dq, int64_t task, Buf& acc) {
  const int64_t nchunk = cdiv(P.Nq, QM_TOKENS);
  const int64_t bh = task / nchunk, t0 = (task % nchunk) * QM_TOKENS, t1 = std::min(P.Nq, t0 + QM_TOKENS);
  const int64_t b = bh / P.Hq, h = bh % P.Hq, l = b * P.slb + h / P.hps, D = P.D;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = bh * P.Nq + t, cnt = P.counts[l * P.Nq + t];
    std::fill(acc.p, acc.p + D, 0.f);
    for (int64_t j = 0; j < cnt; ++j) add_row(acc.p, kb.dqp + (row * P.K + j) * D, D);
    T* o = dq + row * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc.p[d] * P.sm_scale);
  }
}

}  // namespace sel
}  // namespace sia
