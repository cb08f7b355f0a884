// Backend "cpu" of sparse_io_attn: fused block-sparse flash attention, forward and backward.
//
// One translation unit, JIT-built by sparse_io_attn/block_sparse/cpu/_build.py
// (torch.utils.cpp_extension.load) and registered as torch ops in the namespace
// `sparse_io_attn_cpu` (TORCH_LIBRARY: no pybind11, which keeps the build short).
//
// Math (the same as the Triton kernels and the torch path): scores in base 2,
// t = (q . k) * c with c = sm_scale * log2(e); online softmax over the kept key blocks of a
// query tile; stats = (row maximum m, log2 of the row sum l); backward recomputes
// P = exp2((t - m) - log2 l), dS = P * (dP - delta), delta = rowsum(dO * O).
//
// Forward: one task per (batch, query head, query tile of BM <= 128 rows), walking the CSR list
// of its query block (partial blocks, then full blocks). Kept key chunks are taken in groups of
// up to GROUP_COLS keys per online-softmax step: one S tile [BM, <= GROUP_COLS] (one brgemm per
// chunk), one max pass and one exp pass per row over the whole group, one rescale of the
// accumulator per group, then one brgemm P V per chunk. Full blocks run without any mask;
// partial blocks apply key/query padding, the causal test and their element-mask bits, and are
// first trimmed to the rows and columns that can hold an allowed element (the bounding box of
// their mask intersected with the causal and length limits: a sliding window's edge blocks cost
// a fraction of a block).
//
// Backward (5 tile products per kept tile, S and dP computed once): one task per (batch, kv head,
// key segment); a key segment is a run of key tiles (<= 128 keys) chosen from the layout only
// (never from the thread count): about TARGET_TASKS tasks in all, cut at equal shares of the
// segment's schedule entries. For each key tile the task loops over the query heads of its GQA
// group and their CSC entries (partial, then full) in order, accumulating dK, dV in buffers of
// the task and dQ^T = K^T dS^T into a per-segment fp32 buffer. A last pass sums the segments'
// dQ^T buffers in segment order (only the query blocks a segment touches are zeroed and read).
// Partial tiles are trimmed like the forward's.
//
// Deterministic: every output element is produced by exactly one task summing in a fixed order,
// and the decomposition depends on shapes and layout only; no atomics on data. Results are
// bitwise identical across runs and thread counts. Tasks are handed to at::parallel_for threads
// through a counter (which thread runs a task does not change what it computes).
//
// Tile products are at::native::cpublas::brgemm calls on fp32 tiles (oneDNN's ukernel where
// available; measured here: ~160 GFLOP/s per core for 64x64x64 fp32 tiles, as fast as a hand-written
// AVX-512 microkernel, while the bf16 VNNI brgemm without AMX ran at ~85). Inputs of any
// dtype/strides are read directly when they are fp32 with a contiguous head dim, and otherwise
// packed once per call into fp32 row-major copies; transposed fp32 copies (K^T per key block;
// Q^T, dO^T per query block) are packed once per call. Everything is computed in fp32 and rounded
// once to the input dtype at the end. Large work buffers are cached between calls (BufferCache).
//
// Vector code goes through at::vec::Vectorized<float> with AVX-512 fast paths (exp2, bit-mask
// blends, reductions) selected at compile time; other ISAs use the generic Vectorized code.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#endif
// a namespace of our own for at::vec's inline code (never the same symbols as libtorch's copies)
#define CPU_CAPABILITY sparse_io_attn_cpu_vec

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace sia {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
static_assert(VL <= 16 && 32 % VL == 0, "vector length must divide a mask word");
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();
constexpr double LOG2E = 1.4426950408889634;
constexpr float LN2 = 0.6931471805599453f;
constexpr uint32_t FULL_BITS = (VL >= 32) ? 0xFFFFFFFFu : ((1u << VL) - 1u);

// tiles: rows of a query tile, keys of a forward key chunk, keys per online-softmax step, keys
// of a backward key tile; number of backward tasks aimed at
constexpr int64_t MAX_BM = 128;
constexpr int64_t MAX_BN = 256;
constexpr int64_t GROUP_COLS = 256;
constexpr int64_t MAX_BNK = 128;
constexpr int64_t TARGET_TASKS = 32;
constexpr int64_t MAX_DQ_PARTIAL_BYTES = int64_t(2) << 30;

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

// ------------------------------------------------------------------------------ vector helpers
// 2^x for x <= 128; exactly 0 for x < -126, -inf and NaN. No denormal is ever produced (denormal
// results and underflow cost a microcode assist per instruction on x86).
static inline Vec vexp2(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = __m512(x);
  const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, n);  // [-0.5, 0.5] on live lanes
  // 2^f, degree-6 minimax polynomial (relative error ~1e-7 in fp32)
  __m512 p = _mm512_set1_ps(1.5345741038531283e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399904166177600e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6184889703267040e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503288458366430e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646893022740e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314720570438740e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000005534566f));
  return Vec(_mm512_maskz_scalef_ps(live, p, n));
#else
  return x.exp2();
#endif
}

// lanes whose bit is 0 become -inf
static inline Vec keep_bits(Vec s, uint32_t bits) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(NEG_INF), __m512(s)));
#else
  if ((bits & FULL_BITS) == FULL_BITS) return s;
  alignas(64) float buf[VL];
  s.store(buf);
  for (int64_t i = 0; i < VL; ++i)
    if (!((bits >> i) & 1u)) buf[i] = NEG_INF;
  return Vec::loadu(buf);
#endif
}

static inline float hmax(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(__m512(v));
#else
  alignas(64) float buf[VL];
  v.store(buf);
  float r = buf[0];
  for (int64_t i = 1; i < VL; ++i) r = std::max(r, buf[i]);
  return r;
#endif
}

static inline float hsum(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(__m512(v));
#else
  alignas(64) float buf[VL];
  v.store(buf);
  float r = 0.f;
  for (int64_t i = 0; i < VL; ++i) r += buf[i];
  return r;
#endif
}

// bits of the lanes [0, n) of one vector
static inline uint32_t len_bits(int64_t n) {
  if (n <= 0) return 0u;
  if (n >= VL) return FULL_BITS;
  return (1u << n) - 1u;
}

// VL mask bits of a packed mask row starting at bit `bit` (a multiple of VL)
static inline uint32_t word_bits(const int32_t* row, int64_t bit) {
  const uint32_t w = static_cast<uint32_t>(row[bit >> 5]);
  return (w >> (bit & 31)) & FULL_BITS;
}

static inline void scale_row(float* x, int64_t n, float a) {
  const Vec va(a);
  int64_t d = 0;
  for (; d + VL <= n; d += VL) (Vec::loadu(x + d) * va).store(x + d);
  for (; d < n; ++d) x[d] *= a;
}

static inline void add_row(float* x, const float* y, int64_t n) {
  int64_t d = 0;
  for (; d + VL <= n; d += VL) (Vec::loadu(x + d) + Vec::loadu(y + d)).store(x + d);
  for (; d < n; ++d) x[d] += y[d];
}

// ------------------------------------------------------------------------------ buffers
// Work buffers of 1 MiB and more come from a small process-wide cache: the same sizes recur every
// training step, and fresh large allocations are mmap-ed and page-faulted on every call (several
// percent of a sparse backward). At most CACHE_BYTES are kept; empty_cache() releases them.
constexpr size_t CACHE_MIN_BYTES = size_t(1) << 20;
constexpr size_t CACHE_BYTES = size_t(512) << 20;

class BufferCache {
 public:
  float* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i)  // smallest cached block that fits, without wasting half
        if (free_[i].first >= bytes && free_[i].first <= 2 * bytes &&
            (best == free_.size() || free_[i].first < free_[best].first))
          best = i;
      if (best < free_.size()) {
        float* p = free_[best].second;
        cached_ -= free_[best].first;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return p;
      }
    }
    return static_cast<float*>(std::aligned_alloc(64, bytes));
  }
  void put(float* p, size_t bytes) {
    std::vector<float*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.emplace_back(bytes, p);
      cached_ += bytes;
      while (cached_ > CACHE_BYTES) {  // oldest first
        cached_ -= free_.front().first;
        drop.push_back(free_.front().second);
        free_.erase(free_.begin());
      }
    }
    for (float* q : drop) std::free(q);
  }
  void clear() {
    std::vector<std::pair<size_t, float*>> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      cached_ = 0;
    }
    for (auto& e : drop) std::free(e.second);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, float*>> free_;
  size_t cached_ = 0;
};

static BufferCache& buffer_cache() {
  static BufferCache* cache = new BufferCache();  // never destroyed: no exit-order issues
  return *cache;
}

struct Buf {
  float* p = nullptr;
  size_t bytes = 0;
  explicit Buf(int64_t n) : bytes(static_cast<size_t>(round_up(std::max<int64_t>(n, 1) * sizeof(float), 64))) {
    p = bytes >= CACHE_MIN_BYTES ? buffer_cache().get(bytes) : static_cast<float*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(p != nullptr, "sparse_io_attn cpu: out of memory (", bytes, " bytes)");
  }
  ~Buf() {
    if (bytes >= CACHE_MIN_BYTES) buffer_cache().put(p, bytes);
    else std::free(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

void empty_cache() { buffer_cache().clear(); }

// A [B, H, rows, D] fp32 operand: rows of D contiguous floats at p + b*sb + h*sh + row*ld.
struct Rows {
  const float* p = nullptr;
  int64_t sb = 0, sh = 0, ld = 0;
  const float* at(int64_t b, int64_t h, int64_t row) const { return p + b * sb + h * sh + row * ld; }
};

// Run `f(task, worker_state)` for task in [0, n) on at::parallel_for's threads.
template <typename MakeState, typename F>
void run_tasks(int64_t n, MakeState&& make_state, F&& f) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) f(t, *state);
    at::native::cpublas::brgemm_release();
  });
}

// C[M, N] (+)= A[M, K] B[K, N], row-major with leading dimensions
static inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add,
                        const float* A, const float* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C);
}

// Run f(scalar_t{}) for the supported input dtypes (float32, bfloat16, float16).
template <typename F>
static void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "sparse_io_attn cpu: unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

// ------------------------------------------------------------------------------ packing
template <typename T>
static const T* typed(const at::Tensor& x) { return reinterpret_cast<const T*>(x.data_ptr()); }

// x [B, H, N, D] -> fp32 rows (a view when x is fp32 with a contiguous head dim, else a packed copy
// [B, H, NP, D] whose rows N..NP are zero)
static Rows as_rows(const at::Tensor& x, int64_t NP, std::unique_ptr<Buf>& store) {
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  if (x.scalar_type() == at::kFloat && (x.stride(3) == 1 || D == 1) && x.stride(2) >= D) {
    return Rows{x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
  }
  store = std::make_unique<Buf>(B * H * NP * D);
  float* dst = store->p;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2), s3 = x.stride(3);
  const int64_t chunk = 64, nchunks = cdiv(NP, chunk);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = typed<scalar_t>(x);
    at::parallel_for(0, B * H * nchunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = t / nchunks, n_lo = (t % nchunks) * chunk, n_hi = std::min(NP, n_lo + chunk);
        const int64_t b = bh / H, h = bh % H;
        for (int64_t n = n_lo; n < n_hi; ++n) {
          float* d = dst + (bh * NP + n) * D;
          if (n >= N) {
            std::memset(d, 0, D * sizeof(float));
            continue;
          }
          const scalar_t* s = src + b * s0 + h * s1 + n * s2;
          for (int64_t k = 0; k < D; ++k) d[k] = static_cast<float>(s[k * s3]);
        }
      }
    });
  });
  return Rows{dst, H * NP * D, NP * D, D};
}

// x [B, H, N, D] -> fp32 [B, H, nblk, D, blk]: per block of `blk` rows its transpose (zero padded)
static void pack_transposed(const at::Tensor& x, int64_t blk, int64_t nblk, float* dst) {
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2), s3 = x.stride(3);
  const bool direct = x.scalar_type() == at::kFloat && (s3 == 1 || D == 1) && s2 >= D;
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = typed<scalar_t>(x);
    at::parallel_for(0, B * H * nblk, 1, [&](int64_t lo, int64_t hi) {
      std::unique_ptr<Buf> rows;  // fp32 rows of a block when x is not fp32 with a contiguous head dim
      if (!direct) rows = std::make_unique<Buf>(blk * D);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = t / nblk, c = t % nblk, b = bh / H, h = bh % H;
        float* d = dst + t * D * blk;
        const int64_t n0 = c * blk, nv = std::max<int64_t>(0, std::min(blk, N - n0));
        const scalar_t* s = src + b * s0 + h * s1 + n0 * s2;
        const float* fr;
        int64_t ld;
        if (direct) {
          fr = reinterpret_cast<const float*>(s);
          ld = s2;
        } else {
          for (int64_t j = 0; j < nv; ++j)
            for (int64_t k = 0; k < D; ++k) rows->p[j * D + k] = static_cast<float>(s[j * s2 + k * s3]);
          fr = rows->p;
          ld = D;
        }
        if (nv > 0) at::vec::transpose_mxn<float>(fr, ld, d, blk, static_cast<int>(nv), static_cast<int>(D));
        if (nv < blk)
          for (int64_t k = 0; k < D; ++k) std::memset(d + k * blk + nv, 0, (blk - nv) * sizeof(float));
      }
    });
  });
}

// ------------------------------------------------------------------------------ problem
struct Lists {  // one order (CSR rows or CSC columns) of the schedule
  const int32_t *full_ptr, *full_idx, *part_ptr, *part_idx, *part_mask;
  int64_t count(int64_t i) const {
    return (full_ptr[i + 1] - full_ptr[i]) + static_cast<int64_t>(part_ptr[i + 1] - part_ptr[i]);
  }
};

static Lists lists_of(const at::Tensor& full_ptr, const at::Tensor& full_idx, const at::Tensor& part_ptr,
                      const at::Tensor& part_idx, const at::Tensor& part_mask) {
  for (const at::Tensor* t : {&full_ptr, &full_idx, &part_ptr, &part_idx, &part_mask}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "sparse_io_attn cpu: schedule tensors must be contiguous int32 CPU tensors");
  }
  return Lists{full_ptr.data_ptr<int32_t>(), full_idx.data_ptr<int32_t>(), part_ptr.data_ptr<int32_t>(),
               part_idx.data_ptr<int32_t>(), part_mask.data_ptr<int32_t>()};
}

struct Problem {
  int64_t B, Hq, Hkv, G, Nq, Nk, D, bq, bk, nqb, nkb, W, WT, slb, slh;
  bool causal;
  int64_t delta;
  float c2, sm_scale;
  int64_t BM, BMv, nsubq;  // query tiles: BM rows (a multiple of 16 when a block is split), nsubq per block
  int64_t BN, gcols, lds_f;  // forward: key chunk, keys per softmax step, S leading dimension
  int64_t BNK, nsubk, lds_b;  // backward: key tile, tiles per block, S^T leading dimension
  const int32_t* masks = nullptr;    // [NM, bq, W]
  const int32_t* masks_t = nullptr;  // [NM, bk, WT]
  std::vector<int32_t> boxes;        // [NM, 4]: rows [r0, r1) x columns [c0, c1) holding the set bits
};

// The bounding box of every element mask (empty masks get r0 >= r1).
static void mask_boxes(Problem& P, int64_t NM) {
  P.boxes.assign(NM * 4, 0);
  at::parallel_for(0, NM, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      int64_t r0 = P.bq, r1 = 0, c0 = P.bk, c1 = 0;
      for (int64_t r = 0; r < P.bq; ++r) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(P.masks + (x * P.bq + r) * P.W);
        for (int64_t w = 0; w < P.W; ++w) {
          const uint32_t v = row[w];
          if (!v) continue;
          r0 = std::min(r0, r);
          r1 = r + 1;
          c0 = std::min<int64_t>(c0, w * 32 + __builtin_ctz(v));
          c1 = std::max<int64_t>(c1, w * 32 + 32 - __builtin_clz(v));
        }
      }
      int32_t* b = P.boxes.data() + x * 4;
      b[0] = static_cast<int32_t>(r0);
      b[1] = static_cast<int32_t>(r1);
      b[2] = static_cast<int32_t>(c0);
      b[3] = static_cast<int32_t>(c1);
    }
  });
}

// equal parts of at most `cap` (a multiple of 16 when split): (part size, number of parts)
static std::pair<int64_t, int64_t> split(int64_t n, int64_t cap) {
  if (n <= cap) return {n, 1};
  const int64_t size = round_up(cdiv(n, cdiv(n, cap)), 16);
  return {size, cdiv(n, size)};
}

static Problem make_problem(const at::Tensor& q, const at::Tensor& k, int64_t bq, int64_t bk, int64_t slb,
                            int64_t slh, std::optional<int64_t> causal_offset, double sm_scale,
                            const at::Tensor& masks) {
  Problem P;
  P.B = q.size(0);
  P.Hq = q.size(1);
  P.Nq = q.size(2);
  P.D = q.size(3);
  P.Hkv = k.size(1);
  P.Nk = k.size(2);
  TORCH_CHECK(P.Hkv > 0 && P.Hq % P.Hkv == 0, "sparse_io_attn cpu: Hq must be a multiple of Hkv");
  TORCH_CHECK(bq > 0 && bk > 0, "sparse_io_attn cpu: block sizes must be positive");
  P.G = P.Hq / P.Hkv;
  P.bq = bq;
  P.bk = bk;
  P.nqb = cdiv(P.Nq, bq);
  P.nkb = cdiv(P.Nk, bk);
  P.W = cdiv(bk, 32);
  P.WT = cdiv(bq, 32);
  P.slb = slb;
  P.slh = slh;
  P.causal = causal_offset.has_value();
  P.delta = causal_offset.value_or(0);
  P.sm_scale = static_cast<float>(sm_scale);
  P.c2 = static_cast<float>(sm_scale * LOG2E);
  std::tie(P.BM, P.nsubq) = split(bq, MAX_BM);
  P.BMv = round_up(P.BM, VL);
  P.BN = split(bk, MAX_BN).first;
  P.gcols = std::max(GROUP_COLS, round_up(P.BN, VL));
  P.lds_f = P.gcols + 16;  // + 16: rows not a multiple of 4 KiB apart
  std::tie(P.BNK, P.nsubk) = split(bk, MAX_BNK);
  P.lds_b = P.BMv + 16;
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.is_contiguous() && masks.dim() == 3 &&
                  masks.size(1) == bq && masks.size(2) == P.W,
              "sparse_io_attn cpu: masks must be contiguous int32 [num_masks, BLOCK_SIZE_Q, ceil(BLOCK_SIZE_KV/32)]");
  P.masks = masks.data_ptr<int32_t>();
  mask_boxes(P, masks.size(0));
  return P;
}

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
  explicit FwdState(const Problem& P) : s(P.BM * P.lds_f), acc(P.BM * P.D), rows(6 * P.BMv) { segs.reserve(64); }
};

template <typename T>
static void fwd_task(const Problem& P, const Lists& L, const Rows& Q, const float* KT, const Rows& V, T* out,
                     float* lse, float* st_m, float* st_l, int64_t task, FwdState& w) {
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
  const int64_t D = P.D, lds = P.lds_f, BMv = P.BMv, rq = m0 - r * P.bq;
  const float* q = Q.at(b, h, m0);
  float* acc = w.acc.p;
  float* S = w.s.p;
  float* mi = w.rows.p;   // running row maximum (base 2)
  float* li = mi + BMv;   // running row sum
  float* mn = li + BMv;   // new maximum
  float* ms = mn + BMv;   // new maximum, 0 where -inf
  float* al = ms + BMv;   // rescale factor
  float* rs = al + BMv;   // row sum of the group
  std::fill(acc, acc + mrows * D, 0.f);
  std::fill(mi, mi + BMv, NEG_INF);
  std::fill(li, li + BMv, 0.f);
  std::fill(mn, mn + BMv, NEG_INF);
  // c > 0: the max pass reads raw scores (max(c s) = c max(s)) and the exp pass folds the scale
  // into one fma; otherwise the max pass stores c s.
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
            if (!fast) x = x * vc;
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
            Vec x = Vec::loadu(s + jv) * vc;
            if (jv + VL > g.nc) x = keep_bits(x, len_bits(g.nc - jv));
            x.store(s + jv);
            vmax = at::vec::maximum(vmax, x);
          }
        }
      }
      float mx = hmax(vmax);
      if (fast) mx *= P.c2;
      mn[i] = std::max(mi[i], mx);
    }
    // rescale factors of all rows at once
    for (int64_t i = 0; i < mrows; i += VL) {
      const Vec vn = Vec::loadu(mn + i);
      const Vec vs = Vec::blendv(vn, Vec(0.f), vn == Vec(NEG_INF));
      vs.store(ms + i);
      vexp2(Vec::loadu(mi + i) - vs).store(al + i);
    }
    // pass 2: p = exp2(c s - m), row sums
    for (int64_t i = 0; i < mrows; ++i) {
      float* srow = S + i * lds;
      const Vec vneg(-ms[i]);
      Vec vsum(0.f);
      for (const Seg& g : segs) {
        if (i < g.i0 || i >= g.i1) continue;
        float* s = srow + g.col;
        const int64_t ncv = round_up(g.nc, VL);
        for (int64_t jv = 0; jv < ncv; jv += VL) {
          const Vec p = vexp2(at::vec::fmadd(Vec::loadu(s + jv), vf, vneg));
          p.store(s + jv);
          vsum = vsum + p;
        }
      }
      rs[i] = hsum(vsum);
    }
    for (int64_t i = 0; i < mrows; ++i) {
      const float a = al[i];
      li[i] = li[i] * a + rs[i];
      if (a != 1.f && mi[i] != NEG_INF) scale_row(acc + i * D, D, a);
      mi[i] = mn[i];
    }
    for (const Seg& g : segs)
      gemm(g.i1 - g.i0, D, g.nc, lds, V.ld, D, true, S + g.i0 * lds + g.col, V.at(b, hk, g.k0), acc + g.i0 * D);
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
  T* o = out + rbase * D;
  for (int64_t i = 0; i < mrows; ++i) {
    const float l = li[i];
    T* orow = o + i * D;
    const float* arow = acc + i * D;
    if (l == 0.f) {
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(0.f);
      lse[rbase + i] = NEG_INF;
      st_m[rbase + i] = POS_INF;
      st_l[rbase + i] = 0.f;
    } else {
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(arow[d] / l);
      const float log2l = std::log2(l);
      lse[rbase + i] = (mi[i] + log2l) * LN2;
      st_m[rbase + i] = mi[i];
      st_l[rbase + i] = log2l;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& full_ptr,
    const at::Tensor& full_idx, const at::Tensor& part_ptr, const at::Tensor& part_idx,
    const at::Tensor& part_mask, const at::Tensor& masks, int64_t block_q, int64_t block_k, int64_t stride_lb,
    int64_t stride_lh, std::optional<int64_t> causal_offset, double sm_scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3),
              "sparse_io_attn cpu: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "sparse_io_attn cpu: q, k, v must share a dtype");
  const Problem P = make_problem(q, k, block_q, block_k, stride_lb, stride_lh, causal_offset, sm_scale, masks);
  const Lists L = lists_of(full_ptr, full_idx, part_ptr, part_idx, part_mask);
  const int64_t B = P.B, Hq = P.Hq, Nq = P.Nq, D = P.D;

  auto out = at::empty({B, Hq, Nq, D}, q.options());
  auto f32 = q.options().dtype(at::kFloat);
  auto lse = at::empty({B, Hq, Nq}, f32);
  auto stats = at::empty({2, B, Hq, Nq}, f32);
  if (B * Hq * Nq * D == 0) return {out, lse, stats};

  std::unique_ptr<Buf> q_store, v_store;
  const Rows Q = as_rows(q, P.nqb * P.bq, q_store);
  const Rows V = as_rows(v, P.nkb * P.bk, v_store);
  Buf kt(B * P.Hkv * P.nkb * D * P.bk);
  pack_transposed(k, P.bk, P.nkb, kt.p);

  float* lse_p = lse.data_ptr<float>();
  float* st_m = stats.data_ptr<float>();
  float* st_l = st_m + B * Hq * Nq;
  const int64_t ntasks = B * Hq * P.nqb * P.nsubq;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* o = out.data_ptr<scalar_t>();
    run_tasks(ntasks, [&] { return std::make_unique<FwdState>(P); },
              [&](int64_t t, FwdState& w) { fwd_task<scalar_t>(P, L, Q, kt.p, V, o, lse_p, st_m, st_l, t, w); });
  });
  return {out, lse, stats};
}

// ------------------------------------------------------------------------------ backward
struct BwdIn {
  Rows Q, dO, K, V;           // fp32 rows (views or packed copies)
  const float *QT, *dOT;      // [B, Hq, nqb, D, bq]
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
      : s(P.BNK * P.lds_b), dp(P.BNK * P.lds_b), dk(P.BNK * P.D), dv(P.BNK * P.D) {}
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
  const int64_t D = P.D, lds = P.lds_b, bq = P.bq;

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

  const bool fast = P.c2 > 0.f;
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
    std::fill(dV, dV + nk * D, 0.f);

    for (int64_t jh = 0; jh < P.G; ++jh) {
      const int64_t h = g * P.G + jh;
      const float* mbase = in.m + (b * P.Hq + h) * in.ldst;
      const float* lbase = in.l2 + (b * P.Hq + h) * in.ldst;
      const float* dbase = in.dl + (b * P.Hq + h) * in.ldst;

      auto qblock = [&](int64_t r, int32_t mid, bool partial) {
        const int64_t boff = ((b * P.Hq + h) * P.nqb + r) * D * bq;
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
          gemm(nj, ni, D, in.V.ld, bq, lds, false, vp + ja * in.V.ld, in.dOT + boff + i0 + ia, dP0);
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
                // the forward's exact arithmetic: fma(s, c, -m) when c > 0, (c s) - m otherwise
                const Vec vm = Vec::loadu(mr + iv);
                const Vec x = fast ? keep_bits(at::vec::fmadd(Vec::loadu(srow + iv), vc, Vec(0.f) - vm), kb)
                                   : keep_bits(Vec::loadu(srow + iv) * vc, kb) - vm;
                const Vec p = vexp2(x - Vec::loadu(lr + iv));
                p.store(srow + iv);
                (p * (Vec::loadu(prow + iv) - Vec::loadu(dr + iv))).store(prow + iv);
              }
            } else if (fast) {
              for (int64_t iv = 0; iv < niv; iv += VL) {
                const Vec x = at::vec::fmadd(Vec::loadu(srow + iv), vc, Vec(0.f) - Vec::loadu(mr + iv));
                const Vec p = vexp2(x - Vec::loadu(lr + iv));
                p.store(srow + iv);
                (p * (Vec::loadu(prow + iv) - Vec::loadu(dr + iv))).store(prow + iv);
              }
            } else {
              for (int64_t iv = 0; iv < niv; iv += VL) {
                const Vec p = vexp2((Vec::loadu(srow + iv) * vc - Vec::loadu(mr + iv)) - Vec::loadu(lr + iv));
                p.store(srow + iv);
                (p * (Vec::loadu(prow + iv) - Vec::loadu(dr + iv))).store(prow + iv);
              }
            }
          }
          gemm(nj, D, ni, lds, in.dO.ld, D, true, S0, in.dO.at(b, h, m0 + ia), dV + ja * D);  // dV += P^T dO
          gemm(nj, D, ni, lds, in.Q.ld, D, true, dP0, in.Q.at(b, h, m0 + ia), dK + ja * D);   // dK += dS^T Q
          gemm(D, ni, nj, P.bk, lds, bq, true, ktp + ja, dP0, dq_blk + i0 + ia);             // dQ^T += K^T dS^T
        }
      };

      const int64_t lid = b * P.slb + h * P.slh;
      const int64_t col = lid * (P.nkb + 1) + c;
      for (int64_t e = L.part_ptr[col]; e < L.part_ptr[col + 1]; ++e) qblock(L.part_idx[e], L.part_mask[e], true);
      for (int64_t e = L.full_ptr[col]; e < L.full_ptr[col + 1]; ++e) qblock(L.full_idx[e], -1, false);
    }

    const int64_t obase = ((b * P.Hkv + g) * P.Nk + n0) * D;
    for (int64_t i = 0; i < nk * D; ++i) {
      dk[obase + i] = static_cast<T>(dK[i] * P.sm_scale);
      dv[obase + i] = static_cast<T>(dV[i]);
    }
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
    double sm_scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && dout.device().is_cpu() &&
                  out.device().is_cpu() && stats.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3),
              "sparse_io_attn cpu: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "sparse_io_attn cpu: q, k, v, out, dout must share a dtype");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "sparse_io_attn cpu: bad dout/out shape");
  Problem P = make_problem(q, k, block_q, block_k, stride_lb, stride_lh, causal_offset, sm_scale, masks);
  TORCH_CHECK(masks_t.scalar_type() == at::kInt && masks_t.is_contiguous() && masks_t.dim() == 3 &&
                  masks_t.size(0) == masks.size(0) && masks_t.size(1) == block_k && masks_t.size(2) == P.WT,
              "sparse_io_attn cpu: masks_t must be transpose_masks(masks)");
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 4 && stats.size(0) == 2 &&
                  stats.size(1) == q.size(0) && stats.size(2) == q.size(1) && stats.size(3) == q.size(2),
              "sparse_io_attn cpu: stats must be fp32 [2, B, Hq, Nq]");
  P.masks_t = masks_t.data_ptr<int32_t>();
  const Lists C = lists_of(full_ptr, full_idx, part_ptr, part_idx, part_mask);
  const int64_t B = P.B, Hq = P.Hq, Hkv = P.Hkv, Nq = P.Nq, Nk = P.Nk, D = P.D;
  const int64_t NqP = P.nqb * P.bq, NkP = P.nkb * P.bk;

  auto dq = at::empty({B, Hq, Nq, D}, q.options());
  auto dk = at::empty({B, Hkv, Nk, D}, k.options());
  auto dv = at::empty({B, Hkv, Nk, D}, v.options());
  if (B * Hq * Nq * D == 0 || B * Hkv * Nk == 0) return {dq, dk, dv};

  BwdIn in;
  std::unique_ptr<Buf> q_store, do_store, k_store, v_store;
  in.Q = as_rows(q, NqP, q_store);
  in.dO = as_rows(dout, NqP, do_store);
  in.K = as_rows(k, NkP, k_store);
  in.V = as_rows(v, NkP, v_store);
  Buf qt(B * Hq * NqP * D), dot(B * Hq * NqP * D), kt(B * Hkv * NkP * D);
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
  {
    const auto st = stats.contiguous();
    const float* sm = st.data_ptr<float>();
    const float* sl = sm + B * Hq * Nq;
    const int64_t ldst = in.ldst;
    dispatch(q.scalar_type(), [&](auto tag) {
      using scalar_t = decltype(tag);
      const scalar_t* o = typed<scalar_t>(out);
      const scalar_t* g = typed<scalar_t>(dout);
      const int64_t o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2), o3 = out.stride(3);
      const int64_t g0 = dout.stride(0), g1 = dout.stride(1), g2 = dout.stride(2), g3 = dout.stride(3);
      at::parallel_for(0, B * Hq, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t bh = lo; bh < hi; ++bh) {
          const int64_t b = bh / Hq, h = bh % Hq;
          float* mm = mbuf.p + bh * ldst;
          float* ll = lbuf.p + bh * ldst;
          float* dd = dbuf.p + bh * ldst;
          for (int64_t i = 0; i < Nq; ++i) {
            mm[i] = sm[bh * Nq + i];
            ll[i] = sl[bh * Nq + i];
            const scalar_t* orow = o + b * o0 + h * o1 + i * o2;
            const scalar_t* grow = g + b * g0 + h * g1 + i * g2;
            float acc = 0.f;
            for (int64_t d = 0; d < D; ++d)
              acc += static_cast<float>(orow[d * o3]) * static_cast<float>(grow[d * g3]);
            dd[i] = acc;
          }
          for (int64_t i = Nq; i < ldst; ++i) {
            mm[i] = POS_INF;
            ll[i] = 0.f;
            dd[i] = 0.f;
          }
        }
      });
    });
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

// masks [NM, bq, ceil(bk/32)] -> [NM, bk, ceil(bq/32)]: bit (r, c) -> bit (c, r)
at::Tensor transpose_masks(const at::Tensor& masks, int64_t block_k) {
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.dim() == 3 && masks.device().is_cpu(),
              "sparse_io_attn cpu: masks must be int32 [num_masks, BLOCK_SIZE_Q, words] on the CPU");
  const auto m = masks.contiguous();
  const int64_t NM = m.size(0), bq = m.size(1), W = m.size(2), WT = cdiv(bq, 32);
  TORCH_CHECK(W == cdiv(block_k, 32), "sparse_io_attn cpu: masks have ", W, " words per row, block_k ", block_k,
              " needs ", cdiv(block_k, 32));
  auto out = at::empty({NM, block_k, WT}, m.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(m.data_ptr<int32_t>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, NM, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      uint32_t* d = dst + x * block_k * WT;
      std::fill(d, d + block_k * WT, 0u);
      const uint32_t* s = src + x * bq * W;
      for (int64_t r = 0; r < bq; ++r)
        for (int64_t c = 0; c < block_k; ++c)
          if ((s[r * W + (c >> 5)] >> (c & 31)) & 1u) d[c * WT + (r >> 5)] |= 1u << (r & 31);
    }
  });
  return out;
}

// Which vector code this build uses (for tests and the benchmark header).
std::string capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace sia


TORCH_LIBRARY(sparse_io_attn_cpu, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor full_ptr, Tensor full_idx, Tensor part_ptr, Tensor part_idx, "
        "Tensor part_mask, Tensor masks, int block_q, int block_k, int stride_lb, int stride_lh, "
        "int? causal_offset, float sm_scale) -> (Tensor, Tensor, Tensor)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor full_ptr, "
        "Tensor full_idx, Tensor part_ptr, Tensor part_idx, Tensor part_mask, Tensor masks, Tensor masks_t, "
        "int block_q, int block_k, int stride_lb, int stride_lh, int? causal_offset, float sm_scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("transpose_masks(Tensor masks, int block_k) -> Tensor");
  m.def("capability() -> str", &sia::capability);
  m.def("empty_cache() -> ()", &sia::empty_cache);
}

TORCH_LIBRARY_IMPL(sparse_io_attn_cpu, CPU, m) {
  m.impl("fwd", &sia::fwd);
  m.impl("bwd", &sia::bwd);
  m.impl("transpose_masks", &sia::transpose_masks);
}
