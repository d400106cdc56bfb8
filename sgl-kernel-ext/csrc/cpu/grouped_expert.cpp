// The expert server's CPU grouped expert kernel: gate/up GEMM, SiLU * up, down GEMM over the
// packed groups of group_shrink (sgl-kernel-ext/sgl_kernel_ext/group_shrink.py).
//
// For each group g < groups with count[g] > 0, expert e = expert[g], and each row r of
// x[offset[g] : offset[g] + count[g]]:
//
//     out[r] = w2[e] @ (silu(w13[e][:I] @ x[r]) * (w13[e][I:] @ x[r]))
//
// with w13 [E, 2I, H] and w2 [E, H, I] in float32, bfloat16 or float16, x converted to float32
// and every product accumulated in float32. Rows outside every group are left undefined.
//
// expert_sum (what the expert server calls, once per layer) wraps it: the (token, k) entries
// sorted by expert with a counting sort, the groups (the active experts, or every expert), x's
// rows gathered, grouped_expert, then out[t] = sum over k in k order of w[t, k] * row(t, k) in
// float32, in x's dtype.
//
// At decode batch sizes the cost is reading the weights, so every weight element is read from
// memory once per group: the rows of a group are multiplied together (up to kTile of them per
// pass over a block of weight rows, kTileBf16 on the avx512bf16 path; the block stays in cache
// for the group's next tile, tiles as even as possible), and bfloat16/float16 weights are widened
// to float32 in registers (a bfloat16 is the top half of a float32: zero-extend and shift left
// 16), or multiplied as bfloat16 with vdpbf16ps. Each phase (gate/up, then down) splits every
// group's weight rows evenly between the threads (at::parallel_for over the threads, so
// torch.set_num_threads applies): each thread streams its share of each active expert, and the
// split does not depend on the groups' sizes. The AVX2+FMA, AVX-512 and AVX512-BF16 paths are
// chosen at run time (__builtin_cpu_supports); elsewhere a portable scalar loop computes the
// same sums. Each output element's sum runs in the same order whatever the batch, the group's
// size or the thread count, so a row's result never depends on its company.
//
// expert_sum can also record each expert's load (its optional expert_load [2, E] int64, added
// to): row 0 the entries it computed (from the counting sort), row 1 its time in nanoseconds:
// in each phase each thread reads a steady clock after its share of each active group and
// adds the time since its previous read to that group's expert, so an expert's time is the
// thread time spent on its gate/up and down products (summed over threads; sorting, gathering
// and the weighted sum are not per expert and are not in it). Without expert_load no clock is
// read.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EAAS_X86 1
#endif

namespace {

constexpr int64_t kTile = 8;         // rows of a group multiplied per pass over a weight block
constexpr int64_t kTileBf16 = 12;    // the same on the avx512bf16 path
// avx512bf16 path: with kPrefetchRows x rows or more, the weights are prefetched kPrefetchBytes
// ahead of use (the hardware prefetchers alone do not run far enough ahead of the dot products
// there; with fewer rows, which are bound by memory bandwidth, they do better alone).
constexpr int kPrefetchRows = 3;
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kGateUpBlock = 16; // gate rows (and as many up rows) per phase-1 work item
constexpr int64_t kDownBlock = 32;   // w2 rows (output columns) per phase-2 work item
constexpr int kLanes = 8;            // float32 lanes of one AVX2 register

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// ---- portable scalar path -----------------------------------------------------------------
// y[r * ldy + j] = w[j] . x[r] for j < rows, r < n; w rows of length k (contiguous), x rows
// ldx apart. Eight partial sums per dot (lane l takes elements l, l + 8, ...), added in lane
// order at the end: independent lanes the compiler may vectorize without reassociating.
template <typename W>
void dots_scalar(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx, int64_t n,
                 float* y, int64_t ldy) {
  for (int64_t j = 0; j < rows; ++j) {
    const W* wj = w + j * k;
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x + r * ldx;
      float acc[kLanes] = {0};
      int64_t i = 0;
      for (; i + kLanes <= k; i += kLanes) {
        for (int l = 0; l < kLanes; ++l) acc[l] += widen(wj[i + l]) * xr[i + l];
      }
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[l];
      for (; i < k; ++i) sum += widen(wj[i]) * xr[i];
      y[r * ldy + j] = sum;
    }
  }
}

// h[j] = silu(gate[j]) * up[j] for j < n, stored in X (bfloat16: rounded to nearest even).
template <typename X>
void silu_mul_scalar(const float* gate, const float* up, X* h, int64_t n);

struct ScalarOps {
  static constexpr int64_t kRows = kTile;  // x rows per dots call, at most
  template <typename X>
  static void silu_mul(const float* gate, const float* up, X* h, int64_t n) {
    silu_mul_scalar(gate, up, h, n);
  }
  template <typename W>
  static void dots(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx, int64_t n,
                   float* y, int64_t ldy) {
    dots_scalar(w, rows, k, x, ldx, n, y, ldy);
  }
};

// ---- AVX2 + FMA path ----------------------------------------------------------------------
#ifdef EAAS_X86
#define EAAS_AVX2 __attribute__((target("avx2,fma,f16c")))

EAAS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

EAAS_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

EAAS_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The lane sums of four accumulators at once: {sum(a), sum(b), sum(c), sum(d)}. Each one's
// lanes are added in the same tree whichever slot it takes (so a zero-padded call gives the
// same bits), and four sums cost about what one horizontal sum does.
EAAS_AVX2 inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  __m256 abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// sums[q] = the lane sum of acc[q] for q < T (T accumulators, four at a time).
template <int T>
EAAS_AVX2 inline void reduce_all(const __m256* acc, float* sums) {
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int q = 0; q < T; q += 4) {
    __m128 s = reduce4(acc[q], q + 1 < T ? acc[q + 1] : zero, q + 2 < T ? acc[q + 2] : zero,
                       q + 3 < T ? acc[q + 3] : zero);
    alignas(16) float four[4];
    _mm_store_ps(four, s);
    for (int t = 0; t < 4 && q + t < T; ++t) sums[q + t] = four[t];
  }
}

// R weight rows against N x rows: R * N accumulators (at most 8, plus R weight registers and
// one x register: within the 16 ymm registers). Each weight vector is loaded (and widened) once
// and used N times.
template <int R, int N, typename W>
EAAS_AVX2 inline void dots_avx2_rn(const W* w, int64_t k, const float* x, int64_t ldx, float* y,
                                   int64_t ldy) {
  __m256 acc[R * N];  // acc[i * N + r]: weight row i against x row r
#pragma GCC unroll 16
  for (int q = 0; q < R * N; ++q) acc[q] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kLanes <= k; c += kLanes) {
    // The next R rows, at the same column, one cache line per row: rows are short (a few KiB)
    // and each starts a new stream the hardware prefetchers would only pick up after misses.
    if ((c * int64_t(sizeof(W))) % 64 == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + (R + i) * k + c), _MM_HINT_T0);
    }
    __m256 wv[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) wv[i] = load8(w + i * k + c);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + c);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i * N + r] = _mm256_fmadd_ps(wv[i], xv, acc[i * N + r]);
    }
  }
  float sums[R * N];
  reduce_all<R * N>(acc, sums);
  for (int i = 0; i < R; ++i) {
    for (int r = 0; r < N; ++r) {
      float sum = sums[i * N + r];
      for (int64_t t = c; t < k; ++t) sum += widen(w[i * k + t]) * x[r * ldx + t];
      y[r * ldy + i] = sum;
    }
  }
}

// All `rows` weight rows against N (<= kTile) x rows: R rows at a time, then one at a time.
template <int N, typename W>
EAAS_AVX2 void dots_avx2_n(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx,
                           float* y, int64_t ldy) {
  constexpr int R = N <= 2 ? 4 : (N <= 4 ? 2 : 1);
  int64_t j = 0;
  for (; j + R <= rows; j += R) dots_avx2_rn<R, N>(w + j * k, k, x, ldx, y + j, ldy);
  for (; j < rows; ++j) dots_avx2_rn<1, N>(w + j * k, k, x, ldx, y + j, ldy);
}

template <typename W>
EAAS_AVX2 void dots_avx2(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx,
                         int64_t n, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const float* xt = x + r0 * ldx;
    float* yt = y + r0 * ldy;
    switch (std::min<int64_t>(kTile, n - r0)) {
      case 1: dots_avx2_n<1>(w, rows, k, xt, ldx, yt, ldy); break;
      case 2: dots_avx2_n<2>(w, rows, k, xt, ldx, yt, ldy); break;
      case 3: dots_avx2_n<3>(w, rows, k, xt, ldx, yt, ldy); break;
      case 4: dots_avx2_n<4>(w, rows, k, xt, ldx, yt, ldy); break;
      case 5: dots_avx2_n<5>(w, rows, k, xt, ldx, yt, ldy); break;
      case 6: dots_avx2_n<6>(w, rows, k, xt, ldx, yt, ldy); break;
      case 7: dots_avx2_n<7>(w, rows, k, xt, ldx, yt, ldy); break;
      default: dots_avx2_n<8>(w, rows, k, xt, ldx, yt, ldy); break;
    }
  }
}

struct Avx2Ops : ScalarOps {
  template <typename W>
  static void dots(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx, int64_t n,
                   float* y, int64_t ldy) {
    dots_avx2(w, rows, k, x, ldx, n, y, ldy);
  }
};

// ---- AVX-512 paths ------------------------------------------------------------------------
// Twice the lanes of AVX2 and twice the registers; the tail of a row is a masked load (zeros
// past the end), so every element goes through the same vector sums. Avx512Ops takes float32
// x like the paths above; Avx512Bf16Ops multiplies bfloat16 weights by bfloat16 x with
// vdpbf16ps (32 products per instruction, summed in float32 lanes), four times the AVX2 rate.
#define EAAS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define EAAS_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

constexpr int kLanes512 = 16;

EAAS_AVX512 inline __mmask16 tail16(int64_t left) {
  return left >= kLanes512 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// As reduce4 for AVX2: the four 128-bit quarters of the pairwise sums, then AVX2's tree.
EAAS_AVX512 inline __m128 reduce4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  __m256 half = _mm256_add_ps(
      _mm512_castps512_ps256(abcd),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

template <int T>
EAAS_AVX512 inline void reduce_all_512(const __m512* acc, float* sums) {
  const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int q = 0; q < T; q += 4) {
    __m128 s = reduce4_512(acc[q], q + 1 < T ? acc[q + 1] : zero,
                           q + 2 < T ? acc[q + 2] : zero, q + 3 < T ? acc[q + 3] : zero);
    alignas(16) float four[4];
    _mm_store_ps(four, s);
    for (int t = 0; t < 4 && q + t < T; ++t) sums[q + t] = four[t];
  }
}

EAAS_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

EAAS_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

EAAS_AVX512 inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <int R, int N, typename W>
EAAS_AVX512 inline void dots_avx512_rn(const W* w, int64_t k, const float* x, int64_t ldx,
                                       float* y, int64_t ldy) {
  __m512 acc[R * N];  // acc[i * N + r]: weight row i against x row r
#pragma GCC unroll 16
  for (int q = 0; q < R * N; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += kLanes512) {
    const __mmask16 m = tail16(k - c);
    if ((c * int64_t(sizeof(W))) % 64 == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + (R + i) * k + c), _MM_HINT_T0);
    }
    __m512 wv[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) wv[i] = load16(w + i * k + c, m);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + c);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i * N + r] = _mm512_fmadd_ps(wv[i], xv, acc[i * N + r]);
    }
  }
  float sums[R * N];
  reduce_all_512<R * N>(acc, sums);
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < N; ++r) y[r * ldy + i] = sums[i * N + r];
}

template <int N, typename W>
EAAS_AVX512 void dots_avx512_n(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx,
                               float* y, int64_t ldy) {
  constexpr int R = N <= 4 ? 4 : 2;  // at most 16 accumulators of the 32 zmm registers
  int64_t j = 0;
  for (; j + R <= rows; j += R) dots_avx512_rn<R, N>(w + j * k, k, x, ldx, y + j, ldy);
  for (; j < rows; ++j) dots_avx512_rn<1, N>(w + j * k, k, x, ldx, y + j, ldy);
}

template <typename W>
EAAS_AVX512 void dots_avx512(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx,
                             int64_t n, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const float* xt = x + r0 * ldx;
    float* yt = y + r0 * ldy;
    switch (std::min<int64_t>(kTile, n - r0)) {
      case 1: dots_avx512_n<1>(w, rows, k, xt, ldx, yt, ldy); break;
      case 2: dots_avx512_n<2>(w, rows, k, xt, ldx, yt, ldy); break;
      case 3: dots_avx512_n<3>(w, rows, k, xt, ldx, yt, ldy); break;
      case 4: dots_avx512_n<4>(w, rows, k, xt, ldx, yt, ldy); break;
      case 5: dots_avx512_n<5>(w, rows, k, xt, ldx, yt, ldy); break;
      case 6: dots_avx512_n<6>(w, rows, k, xt, ldx, yt, ldy); break;
      case 7: dots_avx512_n<7>(w, rows, k, xt, ldx, yt, ldy); break;
      default: dots_avx512_n<8>(w, rows, k, xt, ldx, yt, ldy); break;
    }
  }
}

struct Avx512Ops : ScalarOps {
  template <typename W>
  static void dots(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx, int64_t n,
                   float* y, int64_t ldy) {
    dots_avx512(w, rows, k, x, ldx, n, y, ldy);
  }
};

EAAS_AVX512BF16 inline __mmask32 tail32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
}

// One weight row against N x rows: y[r * ldy] = w . x[r]. Two accumulators per x row, the
// even and the odd 32-element chunks of k (vdpbf16ps: 32 products per instruction, summed in
// pairs into 16 float32 lanes), added at the end, then their 16 lanes (reduce_all_512): 2N
// independent chains, and the weights read as one sequential stream (several weight rows at
// once read slower from memory here, as several streams). The same order whatever N.
template <int N>
EAAS_AVX512BF16 inline void dot_bf16_n(const c10::BFloat16* w, int64_t k,
                                       const c10::BFloat16* x, int64_t ldx, float* y,
                                       int64_t ldy) {
  __m512 acc0[N], acc1[N];
#pragma GCC unroll 16
  for (int r = 0; r < N; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= k; c += 64) {
    if (N >= kPrefetchRows) {
      const char* ahead = reinterpret_cast<const char*>(w + c) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + c + 32);
#pragma GCC unroll 16
    for (int r = 0; r < N; ++r) {
      acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, (__m512bh)_mm512_loadu_si512(x + r * ldx + c));
      acc1[r] = _mm512_dpbf16_ps(acc1[r], w1,
                                 (__m512bh)_mm512_loadu_si512(x + r * ldx + c + 32));
    }
  }
  if (c < k) {  // the tail: masked loads, zeros past the end
    const __mmask32 m0 = tail32(k - c), m1 = tail32(k - c > 32 ? k - c - 32 : 0);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, w + c);
    const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, w + c + 32);
#pragma GCC unroll 16
    for (int r = 0; r < N; ++r) {
      acc0[r] = _mm512_dpbf16_ps(acc0[r], w0,
                                 (__m512bh)_mm512_maskz_loadu_epi16(m0, x + r * ldx + c));
      acc1[r] = _mm512_dpbf16_ps(acc1[r], w1,
                                 (__m512bh)_mm512_maskz_loadu_epi16(m1, x + r * ldx + c + 32));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < N; ++r) acc0[r] = _mm512_add_ps(acc0[r], acc1[r]);
  float sums[N];
  reduce_all_512<N>(acc0, sums);
  for (int r = 0; r < N; ++r) y[r * ldy] = sums[r];
}

template <int N>
EAAS_AVX512BF16 void dots_bf16_n(const c10::BFloat16* w, int64_t rows, int64_t k,
                                 const c10::BFloat16* x, int64_t ldx, float* y, int64_t ldy) {
  for (int64_t j = 0; j < rows; ++j) dot_bf16_n<N>(w + j * k, k, x, ldx, y + j, ldy);
}

// n <= kTileBf16 x rows.
EAAS_AVX512BF16 void dots_bf16(const c10::BFloat16* w, int64_t rows, int64_t k,
                               const c10::BFloat16* x, int64_t ldx, int64_t n, float* y,
                               int64_t ldy) {
  switch (n) {
    case 1: return dots_bf16_n<1>(w, rows, k, x, ldx, y, ldy);
    case 2: return dots_bf16_n<2>(w, rows, k, x, ldx, y, ldy);
    case 3: return dots_bf16_n<3>(w, rows, k, x, ldx, y, ldy);
    case 4: return dots_bf16_n<4>(w, rows, k, x, ldx, y, ldy);
    case 5: return dots_bf16_n<5>(w, rows, k, x, ldx, y, ldy);
    case 6: return dots_bf16_n<6>(w, rows, k, x, ldx, y, ldy);
    case 7: return dots_bf16_n<7>(w, rows, k, x, ldx, y, ldy);
    case 8: return dots_bf16_n<8>(w, rows, k, x, ldx, y, ldy);
    case 9: return dots_bf16_n<9>(w, rows, k, x, ldx, y, ldy);
    case 10: return dots_bf16_n<10>(w, rows, k, x, ldx, y, ldy);
    case 11: return dots_bf16_n<11>(w, rows, k, x, ldx, y, ldy);
    default: return dots_bf16_n<12>(w, rows, k, x, ldx, y, ldy);
  }
}

// exp(v) on 16 lanes: v = n ln2 + f (|f| <= ln2 / 2, ln2 in two parts), e^f by its Taylor
// polynomial to f^7 (relative error below 2e-8), scaled by 2^n with vscalefps (which gives 0
// and inf past float's range). NaN stays NaN.
EAAS_AVX512 inline __m512 exp16(__m512 v) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-104.0f)),
                                 _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

// 16 floats to bfloat16 as c10::BFloat16 rounds (to nearest even, subnormals kept, NaN quiet);
// vcvtneps2bf16 would flush subnormals.
EAAS_AVX512 inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

struct Avx512Bf16Ops {
  static constexpr int64_t kRows = kTileBf16;
  // silu(g) * u = g / (1 + exp(-g)) * u, 16 lanes at a time, rounded to bfloat16.
  EAAS_AVX512BF16 static void silu_mul(const float* gate, const float* up, c10::BFloat16* h,
                                       int64_t n) {
    for (int64_t j = 0; j < n; j += kLanes512) {
      const __mmask16 m = tail16(n - j);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + j);
      const __m512 u = _mm512_maskz_loadu_ps(m, up + j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      _mm256_mask_storeu_epi16(h + j, m, round_bf16(_mm512_mul_ps(s, u)));
    }
  }
  static void dots(const c10::BFloat16* w, int64_t rows, int64_t k, const c10::BFloat16* x,
                   int64_t ldx, int64_t n, float* y, int64_t ldy) {
    dots_bf16(w, rows, k, x, ldx, n, y, ldy);
  }
};
#endif  // EAAS_X86

// ---- which path ---------------------------------------------------------------------------
// Best first. avx512bf16 multiplies in bfloat16 (x and the SiLU * up intermediate rounded to
// bfloat16, as SGLang's bfloat16 MoE does): "auto" takes it only for bfloat16 weights and x.
const char* const kIsas[] = {"avx512bf16", "avx512", "avx2", "scalar"};

bool supported(const std::string& isa) {
#ifdef EAAS_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  static const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  if (isa == "avx512bf16") return bf16;
  if (isa == "avx512") return avx512;
  if (isa == "avx2") return avx2;
#endif
  return isa == "scalar";
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (const char* isa : kIsas)
    if (supported(isa)) out.emplace_back(isa);
  return out;
}

std::string cpu_isa() { return cpu_isas().front(); }

// ---- the grouped expert computation -------------------------------------------------------
struct GroupList {
  const int64_t* expert;
  const int64_t* offset;
  const int64_t* count;
  int64_t groups;
};

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }  // round to nearest even

template <typename X>
void silu_mul_scalar(const float* gate, const float* up, X* h, int64_t n) {
  for (int64_t j = 0; j < n; ++j) store(h + j, silu(gate[j]) * up[j]);
}

// Each thread's time on each group, added to ns[group] (nullptr: no clock is read). One
// read per group: the time since the previous mark goes to the group just done.
struct GroupClock {
  int64_t* ns;
  using Time = std::chrono::steady_clock::time_point;
  Time mark() const { return ns ? std::chrono::steady_clock::now() : Time{}; }
  Time done(int64_t group, Time since) const {
    if (!ns) return since;
    const Time now = std::chrono::steady_clock::now();
    const auto spent = std::chrono::duration_cast<std::chrono::nanoseconds>(now - since);
    __atomic_fetch_add(ns + group, static_cast<int64_t>(spent.count()), __ATOMIC_RELAXED);
    return now;
  }
};

// [begin, end) of `blocks` for thread `t` of `threads`: contiguous, sizes differing by <= 1.
inline std::pair<int64_t, int64_t> share(int64_t blocks, int64_t t, int64_t threads) {
  return {blocks * t / threads, blocks * (t + 1) / threads};
}

// Phase 1: h[row, j] = silu(gate_j . x[row]) * (up_j . x[row]); phase 2: out[row, c] = w2_c .
// h[row], for the rows of every group. Each phase splits every group's weight rows (gate/up
// rows j, then output columns c) evenly between the threads, in blocks: each thread streams its
// share of each active expert's weights once, and the threads' work is the same whatever the
// groups' sizes. A group's rows go through a block in tiles of at most kTile rows (a group of
// 9..16 rows in two tiles of 4..8), the block staying in cache from one tile to the next. The
// groups listed are walked, empty ones included (they do nothing).
// X: the element type of x and h (float, or bfloat16 for Avx512Bf16Ops). clock: each
// thread's time per group (GroupClock).
template <typename Ops, typename W, typename X>
void run_groups(const X* x, const W* w13, const W* w2, const GroupList& g, int64_t hidden,
                int64_t inter, X* h, float* out, GroupClock clock) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto tiles = [](int64_t count, auto&& fn) {  // fn(r0, n): count rows in balanced tiles
    const int64_t n_tiles = (count + Ops::kRows - 1) / Ops::kRows;
    for (int64_t t = 0, r0 = 0; t < n_tiles; ++t) {
      const int64_t n = count / n_tiles + (t < count % n_tiles ? 1 : 0);
      fn(r0, n);
      r0 += n;
    }
  };
  const int64_t up_blocks = (inter + kGateUpBlock - 1) / kGateUpBlock;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    float gate[Ops::kRows * kGateUpBlock];
    float up[Ops::kRows * kGateUpBlock];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const auto [b_begin, b_end] = share(up_blocks, t, threads);
      auto since = clock.mark();
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        const int64_t count = g.count[grp];
        if (count == 0 || b_begin == b_end) continue;
        const W* w = w13 + g.expert[grp] * 2 * inter * hidden;
        for (int64_t b = b_begin; b < b_end; ++b) {
          const int64_t j0 = b * kGateUpBlock;
          const int64_t rows = std::min(kGateUpBlock, inter - j0);
          tiles(count, [&](int64_t r0, int64_t n) {
            const int64_t row = g.offset[grp] + r0;
            Ops::dots(w + j0 * hidden, rows, hidden, x + row * hidden, hidden, n, gate,
                      kGateUpBlock);
            Ops::dots(w + (inter + j0) * hidden, rows, hidden, x + row * hidden, hidden, n, up,
                      kGateUpBlock);
            for (int64_t r = 0; r < n; ++r)
              Ops::silu_mul(gate + r * kGateUpBlock, up + r * kGateUpBlock,
                            h + (row + r) * inter + j0, rows);
          });
        }
        since = clock.done(grp, since);
      }
    }
  });
  const int64_t down_blocks = (hidden + kDownBlock - 1) / kDownBlock;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    // The sums land here first, then go to out in rows of kDownBlock: out's rows are `hidden`
    // floats apart (a power of two, often), and a tile's scattered stores there would all
    // fall in one set of the L1 cache.
    float sums[Ops::kRows * kDownBlock];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const auto [b_begin, b_end] = share(down_blocks, t, threads);
      auto since = clock.mark();
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        const int64_t count = g.count[grp];
        if (count == 0 || b_begin == b_end) continue;
        const W* w = w2 + g.expert[grp] * hidden * inter;
        for (int64_t b = b_begin; b < b_end; ++b) {
          const int64_t c0 = b * kDownBlock;
          const int64_t rows = std::min(kDownBlock, hidden - c0);
          tiles(count, [&](int64_t r0, int64_t n) {
            const int64_t row = g.offset[grp] + r0;
            Ops::dots(w + c0 * inter, rows, inter, h + row * inter, inter, n, sums,
                      kDownBlock);
            for (int64_t r = 0; r < n; ++r)
              std::memcpy(out + (row + r) * hidden + c0, sums + r * kDownBlock,
                          rows * sizeof(float));
          });
        }
        since = clock.done(grp, since);
      }
    }
  });
}

template <typename W>
void run_float_x(const std::string& isa, const at::Tensor& x, const W* w13, const W* w2,
                 const GroupList& g, int64_t hidden, int64_t inter, float* out,
                 GroupClock clock) {
  at::Tensor h = at::empty({x.size(0), inter}, x.options().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
#ifdef EAAS_X86
  if (isa == "avx512")
    return run_groups<Avx512Ops>(xp, w13, w2, g, hidden, inter, hp, out, clock);
  if (isa == "avx2") return run_groups<Avx2Ops>(xp, w13, w2, g, hidden, inter, hp, out, clock);
#endif
  run_groups<ScalarOps>(xp, w13, w2, g, hidden, inter, hp, out, clock);
}

template <typename W>
void run(const std::string& isa, const at::Tensor& x_in, const W* w13, const W* w2,
         const GroupList& g, int64_t hidden, int64_t inter, float* out, GroupClock clock) {
#ifdef EAAS_X86
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (isa == "avx512bf16") {
      const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
      at::Tensor h = at::empty({x.size(0), inter}, x.options());
      return run_groups<Avx512Bf16Ops>(x.data_ptr<c10::BFloat16>(), w13, w2, g, hidden, inter,
                                       h.data_ptr<c10::BFloat16>(), out, clock);
    }
  }
#endif
  run_float_x(isa, x_in.to(at::kFloat).contiguous(), w13, w2, g, hidden, inter, out, clock);
}

// grouped_expert, adding each thread's time on group g to group_ns[g] (nullptr: untimed).
at::Tensor grouped_expert_timed(const at::Tensor& x_in, const at::Tensor& w13,
                                const at::Tensor& w2, const at::Tensor& expert_in,
                                const at::Tensor& offset_in, const at::Tensor& count_in,
                                int64_t groups, c10::string_view isa_in, int64_t* group_ns) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 and w2 must be 3-d [E, 2I, H], [E, H, I]");
  const int64_t num_experts = w13.size(0), inter = w13.size(1) / 2, hidden = w13.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w2.size(0) == num_experts && w2.size(1) == hidden &&
                  w2.size(2) == inter,
              "w2 must be [E, H, I] for w13 [E, 2I, H]; got ", w13.sizes(), " and ", w2.sizes());
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "w13 and w2 must have one dtype");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "w13 and w2 must be contiguous");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden, "x must be [N, ", hidden, "], got ",
              x_in.sizes());
  const bool bf16 = w13.scalar_type() == at::kBFloat16;
  std::string isa(isa_in.data(), isa_in.size());
  if (isa == "auto") {
    isa = cpu_isa();
    if (isa == "avx512bf16" && !(bf16 && x_in.scalar_type() == at::kBFloat16))
      isa = cpu_isas().at(1);
  }
  TORCH_CHECK(std::find(std::begin(kIsas), std::end(kIsas), isa) != std::end(kIsas),
              "isa must be auto, avx512bf16, avx512, avx2 or scalar, got '", isa, "'");
  TORCH_CHECK(supported(isa), "this CPU cannot run the ", isa, " path");
  TORCH_CHECK(isa != "avx512bf16" || bf16, "the avx512bf16 path needs bfloat16 weights");
  const at::Tensor expert = expert_in.to(at::kLong).contiguous();
  const at::Tensor offset = offset_in.to(at::kLong).contiguous();
  const at::Tensor count = count_in.to(at::kLong).contiguous();
  TORCH_CHECK(groups >= 0 && groups <= expert.numel() && groups <= offset.numel() &&
                  groups <= count.numel(),
              "groups (", groups, ") exceeds the group lists");
  const int64_t rows = x_in.size(0);
  GroupList g{expert.data_ptr<int64_t>(), offset.data_ptr<int64_t>(), count.data_ptr<int64_t>(),
              groups};
  for (int64_t i = 0; i < groups; ++i) {
    TORCH_CHECK(g.count[i] == 0 || (g.expert[i] >= 0 && g.expert[i] < num_experts),
                "group ", i, ": expert ", g.expert[i], " is not one of the ", num_experts);
    TORCH_CHECK(g.count[i] >= 0 && g.offset[i] >= 0 && g.offset[i] + g.count[i] <= rows,
                "group ", i, ": rows [", g.offset[i], ", ", g.offset[i] + g.count[i],
                ") are not within x's ", rows);
  }
  at::Tensor out = at::empty({rows, hidden}, x_in.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  switch (w13.scalar_type()) {
    case at::kFloat:
      run(isa, x_in, w13.data_ptr<float>(), w2.data_ptr<float>(), g, hidden, inter, op,
          GroupClock{group_ns});
      break;
    case at::kBFloat16:
      run(isa, x_in, w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(), g, hidden,
          inter, op, GroupClock{group_ns});
      break;
    case at::kHalf:
      run(isa, x_in, w13.data_ptr<c10::Half>(), w2.data_ptr<c10::Half>(), g, hidden, inter, op,
          GroupClock{group_ns});
      break;
    default:
      TORCH_CHECK(false, "weights must be float32, bfloat16 or float16, got ",
                  w13.scalar_type());
  }
  return out;
}

at::Tensor grouped_expert(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& expert_in, const at::Tensor& offset_in,
                          const at::Tensor& count_in, int64_t groups, c10::string_view isa_in) {
  return grouped_expert_timed(x_in, w13, w2, expert_in, offset_in, count_in, groups, isa_in,
                              nullptr);
}

// acc[c] += w * r[c] for c < n: the product rounded to float32, then added (-ffp-contract=off
// keeps the compiler from fusing the two, in either loop).
inline void add_scaled_scalar(float* acc, float w, const float* r, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += w * r[c];
}

// out[c] = acc[c] in out's dtype (bfloat16, float16: rounded to nearest even).
template <typename T>
inline void store_row_scalar(T* out, const float* acc, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<T>(acc[c]);
}

#ifdef EAAS_X86
EAAS_AVX512 void add_scaled_avx512(float* acc, float w, const float* r, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t c = 0; c < n; c += kLanes512) {
    const __mmask16 m = tail16(n - c);
    const __m512 product = _mm512_mul_ps(wv, _mm512_maskz_loadu_ps(m, r + c));
    _mm512_mask_storeu_ps(acc + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + c), product));
  }
}

EAAS_AVX512 void store_row_avx512(c10::BFloat16* out, const float* acc, int64_t n) {
  for (int64_t c = 0; c < n; c += kLanes512) {
    const __mmask16 m = tail16(n - c);
    _mm256_mask_storeu_epi16(out + c, m, round_bf16(_mm512_maskz_loadu_ps(m, acc + c)));
  }
}
#endif

inline void add_scaled(float* acc, float w, const float* r, int64_t n, bool avx512) {
#ifdef EAAS_X86
  if (avx512) return add_scaled_avx512(acc, w, r, n);
#endif
  add_scaled_scalar(acc, w, r, n);
}

template <typename T>
inline void store_row(T* out, const float* acc, int64_t n, bool avx512) {
#ifdef EAAS_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (avx512) return store_row_avx512(out, acc, n);
  }
#endif
  store_row_scalar(out, acc, n);
}

// out[t] = sum over k < K, in k order, of router_weights[t, k] * expert_{l}(hidden[t]) with l =
// flat_local[t * K + k] (-1: not held here, skipped), in float32, then in hidden's dtype: the
// entries sorted by expert (stable: a counting sort), the groups (the active experts, or with
// shrink off every expert, empty ones included), grouped_expert on the gathered rows, and the
// weighted sum of each token's rows. expert_load ([2, E] int64, optional): each expert's
// entries are added to row 0, its thread time in the grouped products to row 1 (GroupClock).
at::Tensor expert_sum(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                      const at::Tensor& flat_local_in, const at::Tensor& router_weights_in,
                      bool shrink, c10::string_view isa,
                      const std::optional<at::Tensor>& expert_load) {
  TORCH_CHECK(hidden.dim() == 2 && router_weights_in.dim() == 2 &&
                  router_weights_in.size(0) == hidden.size(0),
              "hidden must be [T, H] and router_weights [T, K], got ", hidden.sizes(), " and ",
              router_weights_in.sizes());
  TORCH_CHECK(w13.dim() == 3, "w13 must be 3-d [E, 2I, H]");
  const int64_t tokens = hidden.size(0), top_k = router_weights_in.size(1);
  const int64_t width = hidden.size(1), num_experts = w13.size(0);
  TORCH_CHECK(flat_local_in.dim() == 1 && flat_local_in.numel() == tokens * top_k,
              "flat_local must be [T * K] = [", tokens * top_k, "], got ", flat_local_in.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16 ||
                  hidden.scalar_type() == at::kHalf,
              "hidden must be float32, bfloat16 or float16, got ", hidden.scalar_type());
  const bool timed = expert_load.has_value();
  TORCH_CHECK(!timed || (expert_load->scalar_type() == at::kLong &&
                         expert_load->is_contiguous() && expert_load->device().is_cpu() &&
                         expert_load->dim() == 2 && expert_load->size(0) == 2 &&
                         expert_load->size(1) == num_experts),
              "expert_load must be a contiguous int64 CPU tensor [2, ", num_experts, "]");
  const at::Tensor flat_local = flat_local_in.to(at::kLong).contiguous();
  const at::Tensor router_weights = router_weights_in.to(at::kFloat).contiguous();
  const int64_t* local = flat_local.data_ptr<int64_t>();
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    TORCH_CHECK(local[i] >= -1 && local[i] < num_experts, "flat_local[", i, "] = ", local[i],
                " is not -1 or one of the ", num_experts, " local experts");
    if (local[i] >= 0) ++starts[local[i] + 1];
  }
  int64_t groups = 0;
  at::Tensor expert = at::empty({num_experts}, flat_local.options());
  at::Tensor offset = at::empty({num_experts}, flat_local.options());
  at::Tensor count = at::empty({num_experts}, flat_local.options());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = starts[e + 1];
    starts[e + 1] = starts[e] + n;
    if (n > 0 || !shrink) {
      expert.data_ptr<int64_t>()[groups] = e;
      offset.data_ptr<int64_t>()[groups] = starts[e];
      count.data_ptr<int64_t>()[groups] = n;
      ++groups;
    }
  }
  const int64_t rows = starts[num_experts];
  std::vector<int64_t> position(tokens * top_k, -1);  // entry -> its row in expert order
  at::Tensor token = at::empty({rows}, flat_local.options());  // row -> its token
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (local[i] < 0) continue;
    const int64_t row = starts[local[i]]++;
    position[i] = row;
    token.data_ptr<int64_t>()[row] = i / top_k;
  }
  at::Tensor result = at::empty({tokens, width}, hidden.options());
  if (rows == 0) return result.zero_();
  std::vector<int64_t> group_ns(timed ? groups : 0, 0);
  const at::Tensor out_rows =
      grouped_expert_timed(hidden.index_select(0, token), w13, w2, expert, offset, count, groups,
                           isa, timed ? group_ns.data() : nullptr);
  if (timed) {
    int64_t* entries = expert_load->data_ptr<int64_t>();
    int64_t* ns = entries + num_experts;
    const int64_t* of = expert.data_ptr<int64_t>();
    const int64_t* n = count.data_ptr<int64_t>();
    for (int64_t grp = 0; grp < groups; ++grp) {
      entries[of[grp]] += n[grp];
      ns[of[grp]] += group_ns[grp];
    }
  }
  const float* rp = out_rows.data_ptr<float>();
  const float* wp = router_weights.data_ptr<float>();
  const bool avx512 = supported("avx512");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "expert_sum",
                                  [&] {
    scalar_t* op = result.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(width);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t row = position[t * top_k + k];
          if (row < 0) continue;
          add_scaled(acc.data(), wp[t * top_k + k], rp + row * width, width, avx512);
        }
        store_row(op + t * width, acc.data(), width, avx512);
      }
    });
  });
  return result;
}

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_cpu, m) {
  m.def(
      "grouped_expert(Tensor x, Tensor w13, Tensor w2, Tensor expert, Tensor offset, "
      "Tensor count, int groups, str isa=\"auto\") -> Tensor");
  m.def(
      "expert_sum(Tensor hidden, Tensor w13, Tensor w2, Tensor flat_local, "
      "Tensor router_weights, bool shrink=True, str isa=\"auto\", "
      "Tensor(a!)? expert_load=None) -> Tensor");
  m.def("cpu_isas() -> str[]", &cpu_isas);
}

TORCH_LIBRARY_IMPL(sgl_kernel_ext_cpu, CPU, m) {
  m.impl("grouped_expert", &grouped_expert);
  m.impl("expert_sum", &expert_sum);
}
