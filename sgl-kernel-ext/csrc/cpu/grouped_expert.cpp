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
// At decode batch sizes the cost is reading the weights, so every weight element is read from
// memory once per group: the rows of a group are multiplied together (up to kTile of them per
// pass over a block of weight rows, the block staying in cache for the next kTile rows), and
// bfloat16/float16 weights are widened to float32 in registers (a bfloat16 is the top half of
// a float32: zero-extend and shift left 16). The work is split over output columns (blocks of
// weight rows of every group) with at::parallel_for, so torch.set_num_threads applies. The
// AVX2+FMA path is chosen at run time (__builtin_cpu_supports); elsewhere a portable scalar
// loop computes the same sums. Each output element's sum runs in the same order whatever the
// batch, the group's size or the thread count, so a row's result never depends on its company.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EAAS_X86 1
#endif

namespace {

constexpr int64_t kTile = 8;         // rows of a group multiplied per pass over a weight block
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

struct ScalarOps {
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

struct Avx2Ops {
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

struct Avx512Ops {
  template <typename W>
  static void dots(const W* w, int64_t rows, int64_t k, const float* x, int64_t ldx, int64_t n,
                   float* y, int64_t ldy) {
    dots_avx512(w, rows, k, x, ldx, n, y, ldy);
  }
};

EAAS_AVX512BF16 inline __mmask32 tail32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
}

template <int R, int N>
EAAS_AVX512BF16 inline void dots_bf16_rn(const c10::BFloat16* w, int64_t k,
                                         const c10::BFloat16* x, int64_t ldx, float* y,
                                         int64_t ldy) {
  __m512 acc[R * N];  // acc[i * N + r]: weight row i against x row r
#pragma GCC unroll 16
  for (int q = 0; q < R * N; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    const __mmask32 m = tail32(k - c);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + i) * k + c), _MM_HINT_T0);
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i * k + c);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + c);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i * N + r] = _mm512_dpbf16_ps(acc[i * N + r], wv[i], xv);
    }
  }
  float sums[R * N];
  reduce_all_512<R * N>(acc, sums);
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < N; ++r) y[r * ldy + i] = sums[i * N + r];
}

template <int N>
EAAS_AVX512BF16 void dots_bf16_n(const c10::BFloat16* w, int64_t rows, int64_t k,
                                 const c10::BFloat16* x, int64_t ldx, float* y, int64_t ldy) {
  constexpr int R = N <= 4 ? 4 : 2;
  int64_t j = 0;
  for (; j + R <= rows; j += R) dots_bf16_rn<R, N>(w + j * k, k, x, ldx, y + j, ldy);
  for (; j < rows; ++j) dots_bf16_rn<1, N>(w + j * k, k, x, ldx, y + j, ldy);
}

EAAS_AVX512BF16 void dots_bf16(const c10::BFloat16* w, int64_t rows, int64_t k,
                               const c10::BFloat16* x, int64_t ldx, int64_t n, float* y,
                               int64_t ldy) {
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const c10::BFloat16* xt = x + r0 * ldx;
    float* yt = y + r0 * ldy;
    switch (std::min<int64_t>(kTile, n - r0)) {
      case 1: dots_bf16_n<1>(w, rows, k, xt, ldx, yt, ldy); break;
      case 2: dots_bf16_n<2>(w, rows, k, xt, ldx, yt, ldy); break;
      case 3: dots_bf16_n<3>(w, rows, k, xt, ldx, yt, ldy); break;
      case 4: dots_bf16_n<4>(w, rows, k, xt, ldx, yt, ldy); break;
      case 5: dots_bf16_n<5>(w, rows, k, xt, ldx, yt, ldy); break;
      case 6: dots_bf16_n<6>(w, rows, k, xt, ldx, yt, ldy); break;
      case 7: dots_bf16_n<7>(w, rows, k, xt, ldx, yt, ldy); break;
      default: dots_bf16_n<8>(w, rows, k, xt, ldx, yt, ldy); break;
    }
  }
}

struct Avx512Bf16Ops {
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

// Phase 1 (work item = group g, block b of gate rows): h[row, j] = silu(gate_j . x) * (up_j .
// x) for j in the block. Phase 2 (group g, block b of output columns): out[row, c] = w2_c . h.
// The work items of every group listed are walked, empty ones included (they do nothing).
// X: the element type of x and h (float, or bfloat16 for Avx512Bf16Ops).
template <typename Ops, typename W, typename X>
void run_groups(const X* x, const W* w13, const W* w2, const GroupList& g, int64_t hidden,
                int64_t inter, X* h, float* out) {
  const int64_t up_blocks = (inter + kGateUpBlock - 1) / kGateUpBlock;
  at::parallel_for(0, g.groups * up_blocks, 1, [&](int64_t begin, int64_t end) {
    float gate[kTile * kGateUpBlock];
    float up[kTile * kGateUpBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / up_blocks;
      const int64_t count = g.count[grp];
      if (count == 0) continue;
      const int64_t j0 = (item % up_blocks) * kGateUpBlock;
      const int64_t rows = std::min(kGateUpBlock, inter - j0);
      const W* w = w13 + g.expert[grp] * 2 * inter * hidden;
      for (int64_t r0 = 0; r0 < count; r0 += kTile) {
        const int64_t n = std::min(kTile, count - r0);
        const int64_t row = g.offset[grp] + r0;
        Ops::dots(w + j0 * hidden, rows, hidden, x + row * hidden, hidden, n, gate,
                  kGateUpBlock);
        Ops::dots(w + (inter + j0) * hidden, rows, hidden, x + row * hidden, hidden, n, up,
                  kGateUpBlock);
        for (int64_t r = 0; r < n; ++r) {
          X* hr = h + (row + r) * inter + j0;
          for (int64_t j = 0; j < rows; ++j)
            store(hr + j, silu(gate[r * kGateUpBlock + j]) * up[r * kGateUpBlock + j]);
        }
      }
    }
  });
  const int64_t down_blocks = (hidden + kDownBlock - 1) / kDownBlock;
  at::parallel_for(0, g.groups * down_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / down_blocks;
      const int64_t count = g.count[grp];
      if (count == 0) continue;
      const int64_t c0 = (item % down_blocks) * kDownBlock;
      const int64_t rows = std::min(kDownBlock, hidden - c0);
      const W* w = w2 + g.expert[grp] * hidden * inter + c0 * inter;
      const int64_t row = g.offset[grp];
      Ops::dots(w, rows, inter, h + row * inter, inter, count, out + row * hidden + c0, hidden);
    }
  });
}

template <typename W>
void run_float_x(const std::string& isa, const at::Tensor& x, const W* w13, const W* w2,
                 const GroupList& g, int64_t hidden, int64_t inter, float* out) {
  at::Tensor h = at::empty({x.size(0), inter}, x.options().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
#ifdef EAAS_X86
  if (isa == "avx512") return run_groups<Avx512Ops>(xp, w13, w2, g, hidden, inter, hp, out);
  if (isa == "avx2") return run_groups<Avx2Ops>(xp, w13, w2, g, hidden, inter, hp, out);
#endif
  run_groups<ScalarOps>(xp, w13, w2, g, hidden, inter, hp, out);
}

template <typename W>
void run(const std::string& isa, const at::Tensor& x_in, const W* w13, const W* w2,
         const GroupList& g, int64_t hidden, int64_t inter, float* out) {
#ifdef EAAS_X86
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (isa == "avx512bf16") {
      const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
      at::Tensor h = at::empty({x.size(0), inter}, x.options());
      return run_groups<Avx512Bf16Ops>(x.data_ptr<c10::BFloat16>(), w13, w2, g, hidden, inter,
                                       h.data_ptr<c10::BFloat16>(), out);
    }
  }
#endif
  run_float_x(isa, x_in.to(at::kFloat).contiguous(), w13, w2, g, hidden, inter, out);
}

at::Tensor grouped_expert(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& expert_in, const at::Tensor& offset_in,
                          const at::Tensor& count_in, int64_t groups, c10::string_view isa_in) {
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
      run(isa, x_in, w13.data_ptr<float>(), w2.data_ptr<float>(), g, hidden, inter, op);
      break;
    case at::kBFloat16:
      run(isa, x_in, w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(), g, hidden,
          inter, op);
      break;
    case at::kHalf:
      run(isa, x_in, w13.data_ptr<c10::Half>(), w2.data_ptr<c10::Half>(), g, hidden, inter, op);
      break;
    default:
      TORCH_CHECK(false, "weights must be float32, bfloat16 or float16, got ",
                  w13.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_cpu, m) {
  m.def(
      "grouped_expert(Tensor x, Tensor w13, Tensor w2, Tensor expert, Tensor offset, "
      "Tensor count, int groups, str isa=\"auto\") -> Tensor");
  m.def("cpu_isas() -> str[]", &cpu_isas);
}

TORCH_LIBRARY_IMPL(sgl_kernel_ext_cpu, CPU, m) { m.impl("grouped_expert", &grouped_expert); }
