// y = x W^T (+ b) for the few rows of a decode or verification step, reading W once.
//
// Why: a decode step multiplies one row by every weight matrix and a verification gamma + 1 rows.
// Both are bound by reading the weights, yet the BLAS torch calls on CPU reads them at well under the
// machine's bandwidth for one bf16 row, and for 8 fp32 rows costs up to three times one row (its
// many-row kernels pack and block for compute). Here each weight row is loaded once and multiplied
// into every input row while it sits in registers, so M <= kLinearRows rows cost about one.
//
// Exactness: output (m, n) is one fixed sequence of operations over k whatever M is: 16 lane
// accumulators, lane l summing k = l, l + 16, ... with explicit multiply-adds (the build turns off
// floating-point contraction), then one fixed reduction tree over the lanes, then the bias. So a row
// of a verification step has, bit for bit, the value the same row gets in a one-row decode step.
// torch's own kernels give no such promise (fp32 rows differ between M = 1 and M = 8).
//
// bf16 on an AMX build (K a multiple of 32) runs on tiles instead (tile_rows), and elsewhere on a build with
// AVX512-BF16 on its dot products (dot_rows): each its own bits, the same contract. Verification is where
// that matters: 8 rows at fp32 arithmetic cost twice a decode in bf16.
//
// Layouts: x [..., K] (M rows in all) contiguous, w [N, K] contiguous (the Hugging Face layout, nothing
// repacked), bias [N] or empty, all one dtype (float32 or bfloat16); out [..., N] in that dtype,
// accumulated in float32 and rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"  // the signatures this file defines, checked against the list the others use
#include "prefetch.h"
#include "tiles.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kPairFrom = 8;  // AVX2+FMA steps of more rows may run in pairs (avx2_paired, rows_paired)
constexpr int64_t kGrain = 16;  // weight rows per parallel work item

// Rows ahead of the current group whose share is asked for: the next group, or further when a group is
// shorter than kWeightsAheadBytes (prefetch.h; one bf16 row of 576 is 1152 bytes: one row ahead arrived late with
// several x rows).
inline int64_t ahead_rows(int64_t group, int64_t row_bytes) {
  return std::max<int64_t>(group, (kWeightsAheadBytes + row_bytes - 1) / row_bytes);
}

inline float madd(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline float load(const int8_t* p) { return static_cast<float>(*p); }  // int8 codes; the row's scale comes after

inline float reduce_lanes(const float* acc) {  // fixed tree: (0+8, 1+9, ...), then halves again
  float a[8];
  for (int l = 0; l < 8; ++l) a[l] = acc[l] + acc[l + 8];
  float b[4];
  for (int l = 0; l < 4; ++l) b[l] = a[l] + a[l + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(__AVX512F__)
#include <immintrin.h>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 fp32: widen, shift into the high half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {  // 16 int8 codes -> 16 fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPARSEDRAFT_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {  // 8 int8 codes -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX512F__) || defined(SPARSEDRAFT_AVX2)
// reduce_lanes's tree without leaving registers: lanes l and l + 8 (the two 256-bit halves, or AVX2's two
// registers), then l and l + 4, then l and l + 2, then the two left. The same adds of the same pairs, so the
// same bits, without a store and fifteen scalar adds per output (a third of a 7-row fp32 step went there).
inline float reduce_halves(__m256 a) {  // a[l] = lanes l + l + 8
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#endif
#if defined(__AVX512F__)
inline float reduce16(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return reduce_halves(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}
#elif defined(SPARSEDRAFT_AVX2)
inline float reduce16(__m256 lo, __m256 hi) { return reduce_halves(_mm256_add_ps(lo, hi)); }
#endif

#if defined(SPARSEDRAFT_AVX2)
// NB weight rows from wn (k_len apart) against M rows of xf, into y[m * n_len + j]. The 16 lanes are two
// 8-float registers (lanes 0-7, 8-15); 16 registers hold the NB * 2 * M accumulators, NB * 2 weight
// vectors and one row of x.
template <int NB, int M, typename W>
void avx2_rows(const float* xf, const W* wn, int64_t k_len, float* y, int64_t n_len, int64_t ahead) {
  const int64_t full = k_len - k_len % kLanes;
  __m256 lo[NB][M], hi[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) lo[j][m] = hi[j][m] = _mm256_setzero_ps();
  const char* next = reinterpret_cast<const char*>(wn + ahead * k_len);  // the caller's ahead_rows() rows on
  for (int64_t k = 0; k < full; k += kLanes) {
    // While these rows stream, ask for the next group's into L2, one request per cache line's worth consumed
    // (NB * 16 weights: three requests for fp32 rows, one for int8, whose 48 bytes never skip a line; three
    // requests into one line made one int8 row 5-13% slower on a Zen 3 EPYC). The hardware prefetcher cannot
    // lock onto rows this short (an int8 row of 576 codes is 9 cache lines), and without this the int8 and
    // bf16 paths read at half fp32's rate on an AVX2 machine. The non-temporal form this used before
    // (prefetchnta) made one fp32 row 2.5x slower than this on an AMX Xeon forced onto this path. (The AVX-512
    // and AVX512-BF16 paths ask the same way, below; the tile path for its next 16 rows.)
    for (int64_t b = 0; b < NB * kLanes * static_cast<int64_t>(sizeof(W)); b += 64)
      prefetch_l2(next + k * NB * sizeof(W) + b);
    __m256 wl[NB], wh[NB];
    for (int j = 0; j < NB; ++j) {
      wl[j] = load8(wn + j * k_len + k);
      wh[j] = load8(wn + j * k_len + k + 8);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xl = _mm256_loadu_ps(xf + m * k_len + k), xh = _mm256_loadu_ps(xf + m * k_len + k + 8);
      for (int j = 0; j < NB; ++j) {
        lo[j][m] = _mm256_fmadd_ps(xl, wl[j], lo[j][m]);
        hi[j][m] = _mm256_fmadd_ps(xh, wh[j], hi[j][m]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    if (full == k_len) {
      for (int m = 0; m < M; ++m) y[m * n_len + j] = reduce16(lo[j][m], hi[j][m]);
      continue;
    }
    alignas(32) float lanes[M][kLanes];
    for (int m = 0; m < M; ++m) {
      _mm256_store_ps(lanes[m], lo[j][m]);
      _mm256_store_ps(lanes[m] + 8, hi[j][m]);
    }
    for (int64_t k = full; k < k_len; ++k) {  // tail: lane k - full, same order for every M
      const float wk = load(wn + j * k_len + k);
      for (int m = 0; m < M; ++m) lanes[m][k - full] = madd(xf[m * k_len + k], wk, lanes[m][k - full]);
    }
    for (int m = 0; m < M; ++m) y[m * n_len + j] = reduce_lanes(lanes[m]);
  }
}
#endif

#if defined(SPARSEDRAFT_AVX2)
// Rows of M > kPairFrom against weight rows wn .. wn + NB: AVX2 has 16 vector registers, and M rows'
// 2 * M accumulators beside the weight vectors spill to memory past ~7 rows (a 16-row step ran at a third
// of the matmul peak). Paired, the rows go two at a time over NB = 2 weight rows: 8 accumulators, 4 weight
// vectors and 2 of x, one load per multiply-add, the weight rows re-read from L1 for each pair. No
// (row, output) pair's sequence of operations changes, so the bits are those of the unpaired layout.
// Which layout wins past kPairFrom rows depends on the machine (bench.kernel_timing --linear over SmolLM2's
// weights: paired 1.5x faster at 16 rows on one AVX2 machine, 1.25-1.55x slower at 9-16 on a Zen 3 EPYC),
// so rows_paired (kernels.h), which Python measures once per process, decides.
template <int M, typename W>
void avx2_paired(const float* xf, const W* wn, int64_t k_len, float* y, int64_t n_len, bool two, int64_t ahead) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    if (two) avx2_rows<2, 2>(xf + m * k_len, wn, k_len, y + m * n_len, n_len, ahead);
    else avx2_rows<1, 2>(xf + m * k_len, wn, k_len, y + m * n_len, n_len, ahead);
  }
  if (m < M) {
    if (two) avx2_rows<2, 1>(xf + m * k_len, wn, k_len, y + m * n_len, n_len, ahead);
    else avx2_rows<1, 1>(xf + m * k_len, wn, k_len, y + m * n_len, n_len, ahead);
  }
}
#endif

// Rows of W [n0, n1) against all M rows of xf (float32 copy of x, [M, K]); results as float32.
// Lane l of acc[m] sums k = l, l + 16, ... (one multiply-add each, in k order): the AVX-512, AVX2+FMA
// and portable paths do the same operations (with FMA, the same bits), 16 lanes at a time. ``paired``
// (AVX2+FMA only: rows_paired) runs steps of more than kPairFrom rows two at a time (avx2_paired).
template <int M, typename W>
void rows(const float* xf, const W* w, int64_t k_len, int64_t n0, int64_t n1, float* yf, int64_t n_len,
          bool paired) {
  const int64_t full = k_len - k_len % kLanes;
#if defined(__AVX512F__)
  // NB weight rows side by side: more loads in flight and each x load feeds NB multiply-adds; the
  // order of operations for one (row, output) pair stays the same. NB shrinks as M grows so that
  // NB * M accumulators fit the 32 vector registers. They stay there only with every loop over them unrolled
  // (the pragmas): otherwise GCC 12 kept vacc in memory and stored each accumulator every 16 inputs, as many
  // bytes stored as read at one row, and at 7-12 rows the stores were the bound (scratch, in the message of
  // the commit that added the pragmas). One row takes the single-row loop: its four-row block without those
  // stores read SmolLM2's fp32 weights 5-9% slower than with them, the single-row loop as fast (scratch, in the
  // message of the commit that made one row take it).
  // Each group of this call asks for the rows `ahead` past its own (worked out once per call, not per group).
  constexpr int NB = M == 1 ? 1 : (M <= 4 ? 4 : (M <= 12 ? 2 : 1));
  const int64_t ahead = ahead_rows(NB, k_len * sizeof(W));
#elif defined(SPARSEDRAFT_AVX2)
  constexpr int NB = M == 1 ? 3 : (M <= 2 ? 2 : 1);
  const bool pairs = M > kPairFrom && paired;  // two rows of x at a time over two weight rows (avx2_paired)
  const int64_t ahead = ahead_rows(pairs ? 2 : NB, k_len * sizeof(W));
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * k_len;
    alignas(64) float acc[M][kLanes];
#if defined(__AVX512F__)
    if (NB > 1 && n + NB <= n1) {
      __m512 vacc[NB][M];
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) vacc[j][m] = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += kLanes) {
        // The next group's share into L2, NB lines per NB lines consumed: with several rows of x the hardware
        // prefetcher alone left the stream waiting on memory between multiply-adds (7 fp32 rows took twice one
        // row's time over SmolLM2's weights; with this, 1.25x).
        if ((k * sizeof(W)) % 64 == 0)
          for (int j = 0; j < NB; ++j)
            prefetch_l2(reinterpret_cast<const char*>(wn + ahead * k_len + k * NB) + j * 64);
        __m512 wv[NB];
#pragma GCC unroll 16
        for (int j = 0; j < NB; ++j) wv[j] = load16(wn + j * k_len + k);
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_loadu_ps(xf + m * k_len + k);
#pragma GCC unroll 16
          for (int j = 0; j < NB; ++j) vacc[j][m] = _mm512_fmadd_ps(xv, wv[j], vacc[j][m]);
        }
      }
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) {
        if (full == k_len) {
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) yf[m * n_len + n + j] = reduce16(vacc[j][m]);
          continue;
        }
        alignas(64) float lanes[M][kLanes];
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) _mm512_store_ps(lanes[m], vacc[j][m]);
        for (int64_t k = full; k < k_len; ++k) {
          const float wk = load(wn + j * k_len + k);
          for (int m = 0; m < M; ++m) lanes[m][k - full] = madd(xf[m * k_len + k], wk, lanes[m][k - full]);
        }
        for (int m = 0; m < M; ++m) yf[m * n_len + n + j] = reduce_lanes(lanes[m]);
      }
      n += NB - 1;
      continue;
    }
    __m512 vacc[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) vacc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += kLanes) {
      if ((k * sizeof(W)) % 64 == 0) prefetch_l2(reinterpret_cast<const char*>(wn + ahead * k_len + k));
      const __m512 wv = load16(wn + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) vacc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * k_len + k), wv, vacc[m]);
    }
    if (full == k_len) {
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) yf[m * n_len + n] = reduce16(vacc[m]);
      continue;
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) _mm512_store_ps(acc[m], vacc[m]);
#elif defined(SPARSEDRAFT_AVX2)
    if (pairs) {
      const bool two = n + 2 <= n1;
      avx2_paired<M>(xf, wn, k_len, yf + n, n_len, two, ahead);
      n += two ? 1 : 0;
      continue;
    }
    if (n + NB <= n1) {
      avx2_rows<NB, M>(xf, wn, k_len, yf + n, n_len, ahead);
      n += NB - 1;
    } else {
      avx2_rows<1, M>(xf, wn, k_len, yf + n, n_len, ahead);
    }
    continue;
#else
    (void)paired;
    for (int m = 0; m < M; ++m)
      for (int l = 0; l < kLanes; ++l) acc[m][l] = 0.0f;
    for (int64_t k = 0; k < full; k += kLanes)
      for (int m = 0; m < M; ++m)
        for (int l = 0; l < kLanes; ++l) acc[m][l] = madd(xf[m * k_len + k + l], load(wn + k + l), acc[m][l]);
#endif
    for (int64_t k = full; k < k_len; ++k) {  // tail: lane k - full, same order for every M
      const float wk = load(wn + k);
      for (int m = 0; m < M; ++m) acc[m][k - full] = madd(xf[m * k_len + k], wk, acc[m][k - full]);
    }
    for (int m = 0; m < M; ++m) yf[m * n_len + n] = reduce_lanes(acc[m]);
  }
}

#if SPARSEDRAFT_TILES
// bf16 on AMX tiles (K a multiple of 32): y^T = W x^T, so the weight rows load into tiles as they lie and
// only x is rearranged (pack_operand, once per call, its rows past M zero).
// Output (m, n) is the tile unit's fixed sum over each 32 k, those sums added in k order: the same
// whatever M is, but not the vector path's bits. Weight rows [n0, n1) in blocks of 16, the last one
// zero-padded (so which rows take tiles never depends on how the rows were split between threads).
void tile_rows(const uint16_t* xv, const uint16_t* w, int64_t k_len, int64_t m_len, int64_t n0, int64_t n1,
               float* yf, int64_t n_len) {
  thread_local std::vector<uint16_t> pad;
  alignas(64) float c[16][16];
  configure_tiles();
  for (int64_t n = n0; n < n1; n += 16) {
    const uint16_t* wn = w + n * k_len;
    // The next block of 16 rows (contiguous after this one) is asked for in step with this one's k, a
    // share per step, as the vector paths do: 5-10% off a step whose weights come from memory (scratch in
    // the message of the commit that added it), the 16 strided tile-load streams being otherwise unaided.
    const char* next = n + 16 < n1 ? reinterpret_cast<const char*>(wn + 16 * k_len) : nullptr;
    const auto ask = [&](int64_t k0, int64_t k1) {
      if (next != nullptr)
        for (int64_t b = 32 * k0; b < 32 * k1; b += 64) prefetch_l2(next + b);  // 32 bytes of block per k
    };
    if (n + 16 > n1) {
      pad.assign(16 * k_len, 0);
      std::memcpy(pad.data(), wn, (n1 - n) * k_len * sizeof(uint16_t));
      wn = pad.data();
    }
    _tile_zero(0);
    _tile_zero(1);
    int64_t k = 0;  // two accumulators over alternate 32-k steps keep two products in flight; fixed order
    for (; k + 64 <= k_len; k += 64) {
      ask(k, k + 64);
      _tile_loadd(2, wn + k, k_len * 2);
      _tile_loadd(4, xv + k * 16, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, wn + k + 32, k_len * 2);
      _tile_loadd(5, xv + (k + 32) * 16, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (k < k_len) {
      ask(k, k_len);
      _tile_loadd(2, wn + k, k_len * 2);
      _tile_loadd(4, xv + k * 16, 64);
      _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, c, 64);
    alignas(64) float c1[16][16];
    _tile_stored(1, c1, 64);
    for (int64_t j = 0; j < 16 && n + j < n1; ++j)
      for (int64_t m = 0; m < m_len; ++m) yf[m * n_len + n + j] = c[j][m] + c1[j][m];
  }
  _tile_release();
}
#endif

template <typename W>
using RowsFn = void (*)(const float*, const W*, int64_t, int64_t, int64_t, float*, int64_t, bool);

template <typename W, int... Ms>
RowsFn<W> pick(int64_t m, std::integer_sequence<int, Ms...>) {
  RowsFn<W> fn = nullptr;
  ((m == Ms + 1 ? (fn = &rows<Ms + 1, W>, 0) : 0), ...);
  return fn;
}

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16 dot products (CPUs that have them without AMX, or with the tiles turned off): x and
// the weight rows stay bf16, and each VDPBF16PS adds to lane l of acc[m] the two products of the pair
// k = 32 j + 2 l, 32 j + 2 l + 1, in j order; the tail goes to lane (k - full) / 2 in k order, then the same
// lane tree as the other paths. Half the instructions of widening to float32, and the same for every M.
template <int M, int NB>
void dot_block(const uint16_t* x, const uint16_t* wn, int64_t k_len, float* y, int64_t n_len, int64_t ahead) {
  const int64_t full = k_len - k_len % 32;
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  // The share of the rows `ahead` on (ahead_rows()), one line per row per step: without it, 3 rows of x over bf16
  // weights streamed from memory took twice one row's time (on an AMX machine with the tiles turned off).
  const char* next = reinterpret_cast<const char*>(wn + ahead * k_len);
  for (int64_t k = 0; k < full; k += 32) {
    for (int j = 0; j < NB; ++j) prefetch_l2(next + (k * NB) * sizeof(uint16_t) + j * 64);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wn + j * k_len + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k_len + k);
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    if (full == k_len) {
      for (int m = 0; m < M; ++m) y[m * n_len + j] = reduce16(acc[j][m]);
      continue;
    }
    alignas(64) float lanes[M][kLanes];
    for (int m = 0; m < M; ++m) _mm512_store_ps(lanes[m], acc[j][m]);
    for (int64_t k = full; k < k_len; ++k) {
      const float wk = bf16_to_float(wn[j * k_len + k]);
      for (int m = 0; m < M; ++m)
        lanes[m][(k - full) / 2] = madd(bf16_to_float(x[m * k_len + k]), wk, lanes[m][(k - full) / 2]);
    }
    for (int m = 0; m < M; ++m) y[m * n_len + j] = reduce_lanes(lanes[m]);
  }
}

// Weight rows [n0, n1) against the M rows of x. One row of x takes four weight rows side by side (more
// loads in flight); more rows take one at a time, which ran 1.3x faster than two at 7 rows in a one-process
// A/B on an AMX machine. A row's order of operations is the same either way.
template <int M>
void dot_rows(const uint16_t* x, const uint16_t* w, int64_t k_len, int64_t n0, int64_t n1, float* yf,
              int64_t n_len) {
  constexpr int NB = M == 1 ? 4 : 1;
  const int64_t ahead = ahead_rows(NB, k_len * sizeof(uint16_t));  // once per call, for every group
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_block<M, NB>(x, w + n * k_len, k_len, yf + n, n_len, ahead);
  for (; n < n1; ++n) dot_block<M, 1>(x, w + n * k_len, k_len, yf + n, n_len, ahead);
}

using DotFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*, int64_t);

template <int... Ms>
DotFn pick_dot(int64_t m, std::integer_sequence<int, Ms...>) {
  DotFn fn = nullptr;
  ((m == Ms + 1 ? (fn = &dot_rows<Ms + 1>, 0) : 0), ...);
  return fn;
}
#endif

}  // namespace

// x W^T (+ b), or with int8 codes w and a scale per output row, (x Q^T) * scale (+ b): the same lanes and
// order over k either way, the scale applied once per output after the sum.
static at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias,
                              bool paired) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              "few_rows_linear takes x [..., K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  const int64_t m_len = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1), k_len = x.size(-1), n_len = w.size(0);
  TORCH_CHECK(m_len >= 1 && m_len <= kLinearRows, "few_rows_linear takes 1..", kLinearRows, " rows, got ", m_len);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "few_rows_linear takes float32 or bfloat16 x");
  const bool codes = w.scalar_type() == at::kChar;
  TORCH_CHECK(codes ? scale.defined() && scale.numel() == w.size(0) && scale.scalar_type() == at::kFloat
                    : w.scalar_type() == x.scalar_type(),
              "few_rows_linear takes w of x's dtype, or int8 w with a float32 scale per output row");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(),
              "few_rows_linear takes CPU tensors and a contiguous weight");
  auto out_sizes = x.sizes().vec();  // x's leading dims, then N: the caller reshapes nothing
  out_sizes.back() = n_len;
  const bool bf16 = x.scalar_type() == at::kBFloat16, biased = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.dim() == 1 && bias.size(0) == n_len), "bias must be [N]");
  const auto b = biased ? bias.to(at::kFloat).contiguous() : at::Tensor();  // added after the sum, in float32:
  const float* bp = biased ? b.data_ptr<float>() : nullptr;                 // the same for every M
  auto yf = at::empty(out_sizes, x.options().dtype(at::kFloat));
  auto out = bf16 ? at::empty(out_sizes, x.options()) : yf;
  float* yp = yf.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const auto finish = [&](int64_t n0, int64_t n1) { finish_outputs(yp, m_len, n_len, n0, n1, bp, yb); };
  const auto ms = std::make_integer_sequence<int, kLinearRows>{};
#if SPARSEDRAFT_TILES
  if (x.scalar_type() == at::kBFloat16 && !codes && k_len % 32 == 0 && tiles_on()) {
    std::vector<uint16_t> xv(16 * k_len);
    const auto xc = x.contiguous();
    pack_operand(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), m_len, 16, k_len, xv.data());
    auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, n_len, kGrain, [&](int64_t n0, int64_t n1) {
      tile_rows(xv.data(), wp, k_len, m_len, n0, n1, yp, n_len);
      finish(n0, n1);
    });
  } else
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && !codes) {
    const auto xc = x.contiguous();
    const auto xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    const DotFn fn = pick_dot(m_len, ms);
    at::parallel_for(0, n_len, kGrain, [&](int64_t n0, int64_t n1) {
      fn(xb, wp, k_len, n0, n1, yp, n_len);
      finish(n0, n1);
    });
  } else
#endif
  {
  const auto xf = x.to(at::kFloat).contiguous();  // the vector paths read x in float32 (a copy per call)
  const float* xp = xf.data_ptr<float>();
  const auto sc = codes ? scale.contiguous() : scale;
  const float* sp = codes ? sc.data_ptr<float>() : nullptr;
  at::parallel_for(0, n_len, kGrain, [&](int64_t n0, int64_t n1) {
    if (codes) {
      pick<int8_t>(m_len, ms)(xp, w.data_ptr<int8_t>(), k_len, n0, n1, yp, n_len, paired);
      // The row scales, on outputs this thread has just written: one multiply after the sum, as a separate
      // mul_ gave it, without that op's dispatch (211 of them in an int8 draft step of SmolLM2).
      for (int64_t m = 0; m < m_len; ++m)
        for (int64_t n = n0; n < n1; ++n) yp[m * n_len + n] *= sp[n];
    } else if (w.scalar_type() == at::kFloat) {
      pick<float>(m_len, ms)(xp, w.data_ptr<float>(), k_len, n0, n1, yp, n_len, paired);
    } else {
      auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      pick<uint16_t>(m_len, ms)(xp, wp, k_len, n0, n1, yp, n_len, paired);
    }
    finish(n0, n1);
  });
  }
  return out;
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  return rows_linear(x, w, at::Tensor(), bias, rows_paired.load(std::memory_order_relaxed));
}

at::Tensor few_rows_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "few_rows_linear_int8 takes int8 codes");
  return rows_linear(x, codes, scale, bias, rows_paired.load(std::memory_order_relaxed));
}

int64_t linear_pair_from() { return kPairFrom; }
