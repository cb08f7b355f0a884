// Query-major family (small blocks): forward and dQ per (unit, chunk of query tokens) over each
// token's gathered keys; dK/dV per (b, query head, run of key blocks) over the query rows that chose
// them (the plan's key lists), so every key's gradient is summed by one task and no accumulator is
// shared. Rows are addressed by int32 row numbers (for single-token blocks the plan's rows and key
// lists themselves), QCH at a time: their dot products (16 per call), then the exponentials, then
// the row updates.
// Part of kernel.cpp's translation unit (see kernel.cpp for the overview).
#pragma once

#include "dots.h"
#include "problem.h"
#include "softmax.h"

namespace sia {
namespace sel {

constexpr int64_t QM_TOKENS = 16;        // query tokens per merge/reduce task
constexpr int64_t QM_TILE = 64;          // query tokens per query-major forward/dQ task
constexpr int64_t QM_KEY_RANGE = 1024;   // keys per forward/dQ sweep (their K, V rows reused from cache)
constexpr int64_t QM_KEYS = 64;          // keys per dK/dV task (whole blocks, at least one)
constexpr int64_t QM_TOKEN_TILE = 1024;  // tokens per dK/dV sweep (their q, dO rows reused from cache)
constexpr int64_t QCH = 64;              // rows per step: dot products, then exponentials, then updates
constexpr int64_t AHEAD = QCH;           // rows prefetched one step ahead

struct Inputs : OperandRows {  // Q, K, V (dO in a backward): fp32 rows (views or packed copies)
  using OperandRows::OperandRows;
  const float* st = nullptr;  // [B*Hq*Nq, 4]: per query row m, log2 l (the forward's stats), delta, 0
};

// idx + i, or (the last, partial group of 16 of a list of n) a copy padded with idx[0]: dot16 reads
// whole groups, and a list may end where its storage does.
static inline const int32_t* group16(const int32_t* idx, int64_t i, int64_t n, int32_t* pad) {
  if (i + DOTS <= n) return idx + i;
  for (int64_t z = 0; z < DOTS; ++z) pad[z] = i + z < n ? idx[i + z] : idx[0];
  return pad;
}

// The key lists of a tile of tokens [t0, t1) of selection l (each ascending: block, then key; the
// plan's rows themselves for single tokens, else expanded into `buf`), walked one key range of
// QM_KEY_RANGE keys at a time: every token of the tile takes its keys inside the range (a cursor
// per token), so the range's K and V rows are read from memory once per tile and reused from cache
// by its other tokens. A token's keys are visited in order either way.
struct TokenTile {
  std::vector<int32_t> buf;
  std::vector<const int32_t*> idx;
  std::vector<int64_t> n, cur;
  int64_t tokens = 0, k_end = 0, stride = 0;
  explicit TokenTile(const Problem& P)
      : buf(P.expand_keys() ? qm_tile(P) * P.K * std::min(P.bs, std::max<int64_t>(P.Nk, 1)) : 0),
        idx(qm_tile(P)), n(qm_tile(P)), cur(qm_tile(P)), stride(P.K * std::min(P.bs, std::max<int64_t>(P.Nk, 1))) {}
  // tokens per query-major task: 64, fewer where expanded key lists would pass 4 MiB
  static int64_t qm_tile(const Problem& P) {
    const int64_t keys = P.K * std::min(P.bs, std::max<int64_t>(P.Nk, 1));
    return !P.expand_keys() ? QM_TILE : std::max<int64_t>(1, std::min<int64_t>(QM_TILE, (int64_t(1) << 20) / std::max<int64_t>(keys, 1)));
  }
  void build(const Problem& P, int64_t l, int64_t t0, int64_t t1) {
    tokens = t1 - t0;
    k_end = 0;
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t t = t0 + i;
      const int32_t* row = P.rows + (l * P.Nq + t) * P.K;
      const int64_t cnt = P.counts[l * P.Nq + t];
      const int64_t lim = P.causal ? std::min(P.Nk, P.last_key(t) + 1) : P.Nk;  // keys [0, lim) allowed
      int64_t m = 0;
      if (!P.expand_keys()) {
        m = cnt;
        while (m > 0 && row[m - 1] >= lim) --m;
        idx[i] = row;
      } else {
        int32_t* out = buf.data() + i * stride;
        for (int64_t j = 0; j < cnt; ++j) {
          const int64_t k0 = P.key0(row[j]), na = std::min(P.keys(row[j]), lim - k0);
          for (int64_t z = 0; z < na; ++z) out[m++] = static_cast<int32_t>(k0 + z);
        }
        idx[i] = out;
      }
      n[i] = m;
      cur[i] = 0;
      if (m > 0) k_end = std::max<int64_t>(k_end, idx[i][m - 1] + 1);
    }
  }
  // f(i, j0, nc): token i's keys [j0, j0 + nc) (one range's), ranges ascending, tokens ascending
  template <typename F>
  void sweep(F&& f) {
    for (int64_t k_lo = 0; k_lo < k_end; k_lo += QM_KEY_RANGE) {
      const int64_t k_hi = k_lo + QM_KEY_RANGE;
      for (int64_t i = 0; i < tokens; ++i) {
        int64_t e = cur[i];
        while (e < n[i] && idx[i][e] < k_hi) ++e;
        if (e > cur[i]) f(i, cur[i], e - cur[i]);
        cur[i] = e;
      }
    }
  }
};

struct QState {
  TokenTile tile;
  Buf acc;
  std::vector<float> m, l;
  explicit QState(const Problem& P)
      : tile(P), acc(TokenTile::qm_tile(P) * P.R * std::max(P.D, P.Dv)), m(TokenTile::qm_tile(P) * P.R), l(m.size()) {}
};

static inline int64_t qm_tasks(const Problem& P) { return P.units() * cdiv(P.Nq, TokenTile::qm_tile(P)); }

// f(j0, nc): the entries [j0, j0 + nc) of a row list idx[0..n), QCH at a time, the rows x + idx[j] ldx
// and y + idx[j] ldy of the step after prefetched.
template <typename Kn, typename F>
static inline void by_steps(const float* x, int64_t ldx, const float* y, int64_t ldy, const int32_t* idx, int64_t n,
                            F&& f) {
  Kn::prefetch(x, ldx, idx, std::min(AHEAD, n));
  Kn::prefetch(y, ldy, idx, std::min(AHEAD, n));
  for (int64_t j0 = 0; j0 < n; j0 += QCH) {
    if (j0 + AHEAD < n) {
      Kn::prefetch(x, ldx, idx + j0 + AHEAD, std::min(QCH, n - j0 - AHEAD));
      Kn::prefetch(y, ldy, idx + j0 + AHEAD, std::min(QCH, n - j0 - AHEAD));
    }
    f(j0, std::min(QCH, n - j0));
  }
}

// Query-major forward/dQ task `task`: tokens [t0, t1) of unit (b, kv head, first query head h0,
// selection l), their key lists built in w.tile and their accumulators ([token, head, width]: width Dv
// for the forward's outputs, D for dQ) zeroed; kb, vb: the kv head's K and V rows.
struct TileTask {
  int64_t b, kv, h0, l, t0, t1;
  const float *kb, *vb;
  int64_t ldk, ldv;
  TokenTile& tile;
  TileTask(const Problem& P, const Inputs& in, int64_t task, QState& w, int64_t width) : tile(w.tile) {
    const int64_t TT = TokenTile::qm_tile(P), nchunk = cdiv(P.Nq, TT), u = task / nchunk;
    b = P.unit_b(u);
    kv = P.unit_kv(u);
    h0 = P.unit_h0(u);
    l = P.unit_l(u);
    t0 = (task % nchunk) * TT;
    t1 = std::min(P.Nq, t0 + TT);
    kb = in.K.at(b, kv, 0);
    vb = in.V.at(b, kv, 0);
    ldk = in.K.ld;
    ldv = in.V.ld;
    tile.build(P, l, t0, t1);
    std::fill(w.acc.p, w.acc.p + tile.tokens * P.R * width, 0.f);
  }
  // f(i, j0, nc): keys [j0, j0 + nc) of token i, in TokenTile::sweep's order, QCH at a time (their K
  // and V rows of the step after prefetched)
  template <typename Kn, typename F>
  void sweep(F&& f) {
    tile.sweep([&](int64_t i, int64_t s0, int64_t ns) {
      by_steps<Kn>(kb, ldk, vb, ldv, tile.idx[i] + s0, ns, [&](int64_t j, int64_t nc) { f(i, s0 + j, nc); });
    });
  }
};

template <typename T, int NC>
static void qm_fwd_task(Kern<NC>, const Problem& P, const Inputs& in, const RowStore<T>& store, int64_t task,
                        QState& w) {
  using Kn = Kern<NC>;
  TileTask tt(P, in, task, w, P.Dv);
  const TokenTile& tile = tt.tile;
  const int64_t R = P.R, D = P.D, Dv = P.Dv, b = tt.b, h0 = tt.h0;
  alignas(64) float sb[QCH + DOTS];
  int32_t pad[DOTS];
  std::fill(w.m.begin(), w.m.begin() + tile.tokens * R, NEG_INF);
  std::fill(w.l.begin(), w.l.begin() + tile.tokens * R, 0.f);
  tt.sweep<Kn>([&](int64_t i, int64_t j0, int64_t nc) {
    const int32_t* ki = tile.idx[i];
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = in.Q.at(b, h0 + r, tt.t0 + i);
      for (int64_t z = 0; z < nc; z += DOTS)
        Kn::dots(qr, tt.kb, tt.ldk, group16(ki, j0 + z, tile.n[i], pad), D, sb + z);
      float* ar = w.acc.p + (i * R + r) * Dv;
      softmax_step(sb, nc, P.c2, w.m[i * R + r], w.l[i * R + r], ar, Dv, AllBits{});
      Kn::axpy(ar, sb, nc, tt.vb, tt.ldv, ki + j0, Dv);
    }
  });
  for (int64_t i = 0; i < tile.tokens; ++i)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (b * P.Hq + h0 + r) * P.Nq + tt.t0 + i;
      store.put(row, h0 + r, w.acc.p + (i * R + r) * Dv, w.m[i * R + r], w.l[i * R + r]);
    }
}

// dQ of a tile of tokens: P and dS recomputed against the gathered keys, dq_r = sum_j dS_rj k_j
template <typename T, int NC>
static void qm_dq_task(Kern<NC>, const Problem& P, const Inputs& in, T* dq, int64_t task, QState& w) {
  using Kn = Kern<NC>;
  TileTask tt(P, in, task, w, P.D);
  const TokenTile& tile = tt.tile;
  const int64_t R = P.R, D = P.D, Dv = P.Dv, b = tt.b, h0 = tt.h0;
  const float *kb = tt.kb, *vb = tt.vb;
  const int64_t ldk = tt.ldk, ldv = tt.ldv;
  alignas(64) float sb[QCH + DOTS], pb[QCH + DOTS];
  int32_t pad[DOTS];
  const Vec vc(P.c2);
  tt.sweep<Kn>([&](int64_t i, int64_t j0, int64_t nc) {
    const int64_t t = tt.t0 + i, ncv = round_up(nc, VL);
    const int32_t* ki = tile.idx[i];
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = (b * P.Hq + h0 + r) * P.Nq + t;
      const float* qr = in.Q.at(b, h0 + r, t);
      const float* gr = in.dO.at(b, h0 + r, t);
      for (int64_t z = 0; z < nc; z += DOTS) {
        const int32_t* g = group16(ki, j0 + z, tile.n[i], pad);
        Kn::dots(qr, kb, ldk, g, D, sb + z);
        Kn::dots(gr, vb, ldv, g, Dv, pb + z);
      }
      const Vec vm(in.st[row * 4]), vl(in.st[row * 4 + 1]), vd(in.st[row * 4 + 2]);
      for (int64_t z = 0; z < ncv; z += VL) {
        const Vec x = keep_bits(saturate(Vec::loadu(sb + z) * vc), len_bits(nc - z));
        const Vec p = vexp2((x - vm) - vl);
        (p * (Vec::loadu(pb + z) - vd)).store(sb + z);
      }
      Kn::axpy(w.acc.p + (i * R + r) * D, sb, nc, kb, ldk, ki + j0, D);
    }
  });
  for (int64_t i = 0; i < tile.tokens; ++i)
    for (int64_t r = 0; r < R; ++r) {
      T* o = dq + ((b * P.Hq + h0 + r) * P.Nq + tt.t0 + i) * D;
      const float* ar = w.acc.p + (i * R + r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(ar[d] * P.sm_scale);
    }
}

// dK/dV: a task per (b, kv head, run of key blocks, QM_KEYS keys), walking the kv head's query
// heads one at a time (the rows this pass gathers, q and dO, of one head at a time). For head h, key
// n0 + i of block c is used by the tokens of h's selection that chose c (the key list, ascending)
// from the first one allowed to use it on: a suffix of the list. The task sweeps the tokens in
// tiles of QM_TOKEN_TILE: in each tile every key of the run takes its tokens there (QCH at a time:
// dot products with the key, P and dS, then dK += dS q, dV += P dO), so a tile's q and dO rows come
// from memory once and are reused from cache by the run's other keys. Each key sums over heads in
// order, then its tokens in list order, whatever the tiling.
struct KeyCursor {
  const int32_t* t;  // the key's tokens (a suffix of its block's list)
  int64_t n, cur;
};

struct KVState {
  std::vector<KeyCursor> keys;
  Buf acc;  // [keys, D + Dv]: dK, dV sums
  explicit KVState(const Problem& P) : acc(std::max(QM_KEYS, P.bs) * (P.D + P.Dv)) {}
};

static inline int64_t qm_blocks_per_task(const Problem& P) { return std::max<int64_t>(1, QM_KEYS / P.bs); }

// m, log2 l and delta of 16 query rows (tokens t[0..16) of one head: rows of st, 4 floats apart)
static inline void row_stats(const float* st, const int32_t* t, float* m, float* l, float* d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_slli_epi32(_mm512_loadu_si512(t), 2);
  _mm512_storeu_ps(m, _mm512_i32gather_ps(x, st, 4));
  _mm512_storeu_ps(l, _mm512_i32gather_ps(x, st + 1, 4));
  _mm512_storeu_ps(d, _mm512_i32gather_ps(x, st + 2, 4));
#else
  for (int64_t i = 0; i < DOTS; ++i) {
    m[i] = st[t[i] * 4];
    l[i] = st[t[i] * 4 + 1];
    d[i] = st[t[i] * 4 + 2];
  }
#endif
}

template <typename T, int NC>
static void qm_dkv_task(Kern<NC>, const Problem& P, const Inputs& in, T* dk, T* dv, int64_t task, KVState& w) {
  using Kn = Kern<NC>;
  const int64_t cpt = qm_blocks_per_task(P), ntask_c = cdiv(P.nkb, cpt);
  const int64_t bk = task / ntask_c, c_lo = (task % ntask_c) * cpt, c_hi = std::min(P.nkb, c_lo + cpt);
  const int64_t b = bk / P.Hkv, kv = bk % P.Hkv, D = P.D, Dv = P.Dv, W = D + Dv;
  const int64_t n0 = P.key0(c_lo), nkeys = P.key0(c_hi - 1) + P.keys(c_hi - 1) - n0;  // the blocks' keys, a run
  const Vec vc(P.c2);
  alignas(64) float sb[QCH + DOTS], pb[QCH + DOTS], ms[QCH + DOTS], ls[QCH + DOTS], ds[QCH + DOTS];
  int32_t pad[DOTS];
  float* acc = w.acc.p;
  std::fill(acc, acc + nkeys * W, 0.f);
  for (int64_t h = kv * P.Gq; h < (kv + 1) * P.Gq; ++h) {
    const int64_t l = b * P.slb + h / P.hps;
    const float* qh = in.Q.at(b, h, 0);
    const float* gh = in.dO.at(b, h, 0);
    const int64_t ldq = in.Q.ld, ldg = in.dO.ld;
    const float* sth = in.st + (b * P.Hq + h) * P.Nq * 4;
    w.keys.clear();
    int64_t t_first = P.Nq;
    for (int64_t c = c_lo; c < c_hi; ++c) {
      const int32_t* ptr = P.col_ptr + l * (P.nkb + 1) + c;
      const int32_t* tl = P.col_query + ptr[0];
      const int64_t len = ptr[1] - ptr[0], nblk = P.keys(c);
      int64_t first = 0;
      for (int64_t key = 0; key < nblk; ++key) {
        while (first < len && P.allowed(tl[first], c) <= key) ++first;  // tokens ascending: a prefix
        w.keys.push_back(KeyCursor{tl + first, len - first, 0});
        if (first < len) t_first = std::min<int64_t>(t_first, tl[first]);
      }
    }
    for (int64_t tc = t_first; tc < P.Nq; tc += QM_TOKEN_TILE) {
      const int64_t t_end = tc + QM_TOKEN_TILE;
      for (int64_t key = 0; key < nkeys; ++key) {
        KeyCursor& kc = w.keys[key];
        int64_t end = kc.cur;
        while (end < kc.n && kc.t[end] < t_end) ++end;
        const int32_t* ti = kc.t + kc.cur;
        const int64_t n = end - kc.cur;
        kc.cur = end;
        if (n == 0) continue;
        const float* kr = in.K.at(b, kv, n0 + key);
        const float* vr = in.V.at(b, kv, n0 + key);
        float* dkr = acc + key * W;
        float* dvr = dkr + D;
        by_steps<Kn>(qh, ldq, gh, ldg, ti, n, [&](int64_t i0, int64_t nc) {
          const int64_t ncv = round_up(nc, VL);
          for (int64_t i = 0; i < nc; i += DOTS) {
            const int32_t* g = group16(ti, i0 + i, n, pad);
            Kn::dots(kr, qh, ldq, g, D, sb + i);
            Kn::dots(vr, gh, ldg, g, Dv, pb + i);
            row_stats(sth, g, ms + i, ls + i, ds + i);
          }
          for (int64_t i = 0; i < ncv; i += VL) {  // P and dS, the forward's arithmetic
            const Vec xv = saturate(Vec::loadu(sb + i) * vc);
            const Vec p = vexp2((xv - Vec::loadu(ms + i)) - Vec::loadu(ls + i));
            (p * (Vec::loadu(pb + i) - Vec::loadu(ds + i))).store(pb + i);
            p.store(sb + i);
          }
          Kn::axpy(dkr, pb, nc, qh, ldq, ti + i0, D);
          Kn::axpy(dvr, sb, nc, gh, ldg, ti + i0, Dv);
        });
      }
    }
  }
  for (int64_t key = 0; key < nkeys; ++key) {
    const int64_t o = (b * P.Hkv + kv) * P.Nk + n0 + key;
    store_dkv(acc + key * W, D, acc + key * W + D, Dv, P.sm_scale, dk + o * D, dv + o * Dv);
  }
}

}  // namespace sel
}  // namespace sia
