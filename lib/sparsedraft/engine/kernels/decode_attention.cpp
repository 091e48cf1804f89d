// Decode / verification attention over a KV cache on the CPU, reading each cached key and value once.
//
// Why: at long context a decode step is bound by reading the cache. torch's SDPA reads it per query
// head and packs it per call, so a GQA group of g heads and a T-token verification cost far more
// than the one pass over memory they need. Here all R = g*T query rows of a KV head share each load
// of a key (scores) and of a value (weighted sum).
//
// Work split: items are (batch, kv head, chunk of kChunk keys), contiguous runs of them per thread.
// Chunk boundaries are fixed by key position, never by thread count, and every chunk's
// partial result (row max, sum of exponentials, unnormalised output) is merged in chunk order.
// Inside a chunk, each query row is a separate lane that follows one fixed sequence of operations
// over its visible keys; blocking (several rows or keys at once) only changes which lanes run side
// by side. So a row's output depends on its query and its visible keys alone: a T-row verification
// gives, bit for bit, what T one-token decodes over the growing prefix give. Multiply-adds are
// explicit (madd) and the build turns off floating-point contraction, so every copy of a loop rounds
// the same way. `omp simd` marks the lane loops (no reductions across lanes) so the compiler
// vectorises them the way they are written. Steps with few rows per KV head (a decode: g rows) take
// the keys as lanes instead (attend_chunk_by_keys), since rows as lanes would be mostly padding; each
// (key, row) still gets the same chain of operations, so both ways give the same bits.
//
// bf16 caches on an AMX build take tiles instead (attend_chunk_tiles, below): the tile unit's fixed
// order in place of the madd chains, the same contract. A build with AVX512-BF16 but no AMX takes the same
// steps with each tile product done by dot-product instructions (attend_chunk_dots).
//
// Layouts: q [B, KV, R, D] with row r = i*T + t (query head i of the group, new token t); k, v
// [B, KV, S, D] with the last dimension contiguous and consecutive keys D floats apart (views into
// bigger cache buffers are fine); out [B, KV, R, D]. Row r sees keys 0 .. S-T+t.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // the Tensor <-> Python caster; far lighter than torch/extension.h

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "kernels.h"  // the signatures this file defines, checked against the list the others use
#include "prefetch.h"
#include "tiles.h"

#if !SPARSEDRAFT_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPARSEDRAFT_DOTS 1
#else
#define SPARSEDRAFT_DOTS 0
#endif

namespace {

// Floats the accumulators of one register block may hold: about three quarters of the vector register
// file the build targets (32 x 16 with AVX-512, 16 x 8 with AVX2, 16 x 4 otherwise), so the blocks
// below stay in registers instead of spilling. Block sizes only decide which lanes run side by side,
// never a row's order of operations, so they change no bits.
#if defined(__AVX512F__)
constexpr int kAccFloats = 384;
#elif defined(__AVX__)
constexpr int kAccFloats = 96;
#else
constexpr int kAccFloats = 48;
#endif
constexpr int64_t kChunk = 256;  // keys per work item; fixed positions, part of the exactness contract
// Query rows handled side by side in the score and softmax loops: a multiple of one vector register, since a
// step's R rows are rounded up to it (rp). On AVX2's 8-float registers, 16 put a 7-token verification's 21 rows
// (GQA 3) in 32 lanes, a third of its scoring and exponentials padding; 8 puts them in 24. Which rows share a
// block never changes a row's operations, so no bits change either.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kLanes = 8;
#if defined(__FMA__)
// AVX2+FMA's 16 vector registers: scoring and weighing hold their operands in registers (score_keys,
// weigh_values) where the compiler's loops re-read them. AVX-512 builds (32 registers) keep the
// loops.
#define SPARSEDRAFT_REGISTER_BLOCKS 1
#endif
#else
constexpr int64_t kLanes = 16;
#endif
#ifndef SPARSEDRAFT_REGISTER_BLOCKS
#define SPARSEDRAFT_REGISTER_BLOCKS 0
#endif
#if SPARSEDRAFT_REGISTER_BLOCKS
// x, which the compiler must now keep in a register: without this it folds the load into every multiply-add
// that uses x, one load each time.
inline __m256 in_register(__m256 x) {
  asm("" : "+x"(x));
  return x;
}
#endif
constexpr float kLog2e = 1.4426950408889634f;

inline float madd(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// 2^x for x <= 0 (the scores minus their max); 0 below 2^-126 and for -inf. Round to an integer n by the
// 1.5*2^23 trick, a degree-7 polynomial for 2^f on f in [-0.5, 0.5] (truncation error 5e-9, coefficients
// from the highest power down), then n goes into the exponent bits.
constexpr float kExp2Poly[] = {1.525273380405984e-05f, 1.5403530393381606e-04f, 1.3333558146428443e-03f,
                               9.618129107628477e-03f, 5.550410866482158e-02f,  2.402265069591007e-01f,
                               6.931471805599453e-01f, 1.0f};

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (x + it) - it is x rounded to a whole number

inline float exp2_nonpositive(float x) {
  const float xc = x > -127.0f ? x : -127.0f;
  const float magic = kRoundMagic;
  const float n = (xc + magic) - magic;
  const float f = xc - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 8; ++i) p = madd(p, f, kExp2Poly[i]);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -126.0f ? 0.0f : p * scale;
}

// exp2_nonpositive on a vector of lanes, written out because the compiler leaves the scalar form
// unvectorised: the same operations in the same order (its comparison as MAXPS, which keeps the second
// operand unless the first is greater, and a select), so every lane gets the scalar call's bits. O is the
// vector width's operations (Lanes8 for AVX2+FMA, Lanes16 for AVX-512).
template <class O>
inline typename O::V exp2_nonpositive_lanes(typename O::V x) {
  using V = typename O::V;
  const V xc = O::max(x, O::set(-127.0f));
  const V n = O::nearest(xc);
  const V f = O::sub(xc, n);
  V p = O::set(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = O::fmadd(p, f, O::set(kExp2Poly[i]));
  return O::zero_below(O::times_pow2(p, n), x, -126.0f);
}

#if defined(__AVX2__) && defined(__FMA__)
struct Lanes8 {
  using V = __m256;
  static V set(float a) { return _mm256_set1_ps(a); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V nearest(V x) {  // x rounded to a whole number, ties to even, by kRoundMagic
    const V magic = set(kRoundMagic);
    return sub(add(x, magic), magic);
  }
  static V times_pow2(V p, V n) {  // p * 2^n for whole n in [-127, 0], 2^n through the exponent bits
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return mul(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  }
  static V zero_below(V y, V x, float t) {
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, set(t), _CMP_LT_OQ));
  }
};
#endif

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static V set(float a) { return _mm512_set1_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // One instruction each where Lanes8 takes three: the same whole number (ties to even) and the same product
  // (p * 2^n is exact, or rounds alike, wherever zero_below keeps it), so the same bits.
  static V nearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }
  static V zero_below(V y, V x, float t) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set(t), _CMP_LT_OQ), y, _mm512_setzero_ps());
  }
};
#endif

struct Shape {
  int64_t B, KV, R, T, S, D;
  int64_t key_rows;  // steps of at most this many rows per KV head take the keys-as-lanes path
  int64_t rp;       // R rounded up to kLanes
  int64_t chunks;   // ceil(S / kChunk)
  int64_t visible(int64_t r) const { return S - T + r % T + 1; }  // keys row r sees
};

// v[x] = exp2_nonpositive(v[x] - m[x]) for the kLanes lanes of one block.
inline void exp2_lanes(float* v, const float* m) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16);
  _mm512_storeu_ps(v, exp2_nonpositive_lanes<Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(v), _mm512_loadu_ps(m))));
#elif defined(__AVX2__) && defined(__FMA__)
  for (int64_t x = 0; x < kLanes; x += 8)
    _mm256_storeu_ps(v + x,
                     exp2_nonpositive_lanes<Lanes8>(_mm256_sub_ps(_mm256_loadu_ps(v + x), _mm256_loadu_ps(m + x))));
#else
#pragma omp simd
  for (int64_t x = 0; x < kLanes; ++x) v[x] = exp2_nonpositive(v[x] - m[x]);
#endif
}

// s[KB][rp] (columns v0 .. v0 + NV*kLanes) = scores of keys k[KB][D] against query rows (qt is
// [D][rp], scale folded in): one madd per d, in d order, for every (key, row). KB*NV independent
// accumulators keep the FMA units busy.
template <int KB, int NV>
void score_keys(const float* qt, const float* k, float* s, int64_t D, int64_t rp, int64_t v0) {
#if SPARSEDRAFT_REGISTER_BLOCKS
  // The same chains with the query vectors held in registers: written as loops, the compiler re-read them from
  // memory for every key, 16 loads per 12 multiply-adds, and AVX2 CPUs load two vectors a cycle.
  __m256 acc[KB][NV];
  for (int kk = 0; kk < KB; ++kk)
    for (int n = 0; n < NV; ++n) acc[kk][n] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 qd[NV];
    for (int n = 0; n < NV; ++n) qd[n] = in_register(_mm256_loadu_ps(qt + d * rp + v0 + 8 * n));
    for (int kk = 0; kk < KB; ++kk) {
      const __m256 kd = _mm256_set1_ps(k[kk * D + d]);
      for (int n = 0; n < NV; ++n) acc[kk][n] = _mm256_fmadd_ps(kd, qd[n], acc[kk][n]);
    }
  }
  for (int kk = 0; kk < KB; ++kk)
    for (int n = 0; n < NV; ++n) _mm256_storeu_ps(s + kk * rp + v0 + 8 * n, acc[kk][n]);
#else
  float acc[KB][NV * kLanes] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* qd = qt + d * rp + v0;
    for (int kk = 0; kk < KB; ++kk) {
      const float kd = k[kk * D + d];
#pragma omp simd
      for (int64_t l = 0; l < NV * kLanes; ++l) acc[kk][l] = madd(kd, qd[l], acc[kk][l]);
    }
  }
  for (int kk = 0; kk < KB; ++kk)
#pragma omp simd
    for (int64_t l = 0; l < NV * kLanes; ++l) s[kk * rp + v0 + l] = acc[kk][l];
#endif
}

// How far ahead of the key block being scored the rows path asks for its keys (where the caller lets it: float
// keys read in place), on AVX2 builds. The keys of a chunk asked for all at once while the previous chunk's
// exponentials were taken (what the AVX-512 build still does) left a 2-core Zen 3 EPYC's scoring waiting on
// them: with this, the rows path's fp32 attention over 30 layers took 1-8% less time at 8K and 32K, 3-16
// tokens, both builds in one process (docs/results/attention-keys-ahead-ab.json).
#if SPARSEDRAFT_REGISTER_BLOCKS
constexpr int64_t kKeysAhead = 2048;
#else
constexpr int64_t kKeysAhead = 0;
#endif

// Scores of keys [j0, j1) against all rows: groups of up to three row vectors, keys in blocks.
// While the first row group scores a key block, the values of those keys (next) are fetched into
// cache, so memory keeps streaming while the scores are computed rather than after; with ``keys`` (k's rows as
// they lie in memory) the keys kKeysAhead bytes on are asked for too (past the last key, a prefetch of memory
// that may not be the tensor's: a prefetch never faults).
template <int NV>
void score_rows(const float* qt, const float* k, float* s, int64_t D, int64_t rp, int64_t v0, int64_t len,
                const char* next, int64_t next_bytes_per_key, const char* keys) {
  constexpr int KB = std::clamp(kAccFloats / (NV * static_cast<int>(kLanes)), 1, NV * kLanes <= 16 ? 8 : 4);
  const int64_t key_bytes = D * static_cast<int64_t>(sizeof(float));
  int64_t j = 0;
  for (; j + KB <= len; j += KB) {
    if (next != nullptr)
      for (int64_t b = j * next_bytes_per_key; b < (j + KB) * next_bytes_per_key; b += 64) prefetch_l2(next + b);
    if (keys != nullptr)
      for (int64_t b = j * key_bytes; b < (j + KB) * key_bytes; b += 64) prefetch_l2(keys + kKeysAhead + b);
    score_keys<KB, NV>(qt, k + j * D, s + j * rp, D, rp, v0);
  }
  for (; j < len; ++j) score_keys<1, NV>(qt, k + j * D, s + j * rp, D, rp, v0);
}

// ``ahead``: k is the keys as they lie in memory, to be asked for kKeysAhead bytes before they are scored (the
// caller then need not ask for this chunk's keys itself); false for keys widened into scratch. Only the first
// row group asks, for the keys as for the values; the others find both in cache.
void score(const float* qt, const float* k, float* s, int64_t D, int64_t rp, int64_t len, const char* next,
           int64_t next_bytes_per_key, bool ahead = false) {
  const char* keys = ahead && kKeysAhead > 0 ? reinterpret_cast<const char*>(k) : nullptr;
  int64_t v0 = 0;
  for (; v0 + 3 * kLanes <= rp; v0 += 3 * kLanes, next = nullptr, keys = nullptr)
    score_rows<3>(qt, k, s, D, rp, v0, len, next, next_bytes_per_key, keys);
  if (rp - v0 == 2 * kLanes) score_rows<2>(qt, k, s, D, rp, v0, len, next, next_bytes_per_key, keys);
  if (rp - v0 == kLanes) score_rows<1>(qt, k, s, D, rp, v0, len, next, next_bytes_per_key, keys);
}

// Rows [r0, r1) in blocks of RB, the leftover rows as one block: block(rows, r) runs a weighing of ``rows`` rows
// (a std::integral_constant) from row r.
template <int RB, class Block>
void by_row_blocks(int64_t r0, int64_t r1, Block&& block) {
  static_assert(RB <= 4);
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) block(std::integral_constant<int, RB>{}, r);
  switch (r1 - r) {
    case 3: block(std::integral_constant<int, 3>{}, r); break;
    case 2: block(std::integral_constant<int, 2>{}, r); break;
    case 1: block(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

#if SPARSEDRAFT_REGISTER_BLOCKS
// Where the register blocks below read values: float rows in place, or int8 codes with a scale per key (an
// int8 draft view, attend_int8), widened in registers to float(code) * scale, the float the dequantising copy
// stores; so an int8 view's values weigh without that copy, to the same bits.
struct FloatValues {
  const float* v;
  int64_t D;
  __m256 load8(int64_t j, int64_t d) const { return _mm256_loadu_ps(v + j * D + d); }
};
struct Int8Values {
  const int8_t* codes;
  const float* scales;
  int64_t D;
  __m256 load8(int64_t j, int64_t d) const {
    const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j * D + d)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(scales[j]));
  }
};

// weigh_values's chains (below) with each key's values loaded once into registers (written as loops, the
// compiler re-read them for every row), DW a multiple of 8.
template <int RB, int DW, class Values>
void weigh_registers(const float* p, int64_t pk, int64_t pr, const Values& v, int64_t D, int64_t r0, int64_t d0,
                     int64_t j0, int64_t j1, float* o) {
  static_assert(DW % 8 == 0);
  constexpr int NW = DW / 8;
  __m256 acc[RB][NW];
  for (int rr = 0; rr < RB; ++rr)
    for (int w = 0; w < NW; ++w) acc[rr][w] = _mm256_loadu_ps(o + (r0 + rr) * D + d0 + 8 * w);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 vj[NW];
    for (int w = 0; w < NW; ++w) vj[w] = in_register(v.load8(j, d0 + 8 * w));
    for (int rr = 0; rr < RB; ++rr) {
      const __m256 pj = _mm256_set1_ps(p[j * pk + (r0 + rr) * pr]);
      for (int w = 0; w < NW; ++w) acc[rr][w] = _mm256_fmadd_ps(pj, vj[w], acc[rr][w]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int w = 0; w < NW; ++w) _mm256_storeu_ps(o + (r0 + rr) * D + d0 + 8 * w, acc[rr][w]);
}

// Rows [r0, r1) over keys [j0, j1), D a multiple of 8: column tiles of 24, then one of 16 or 8, four rows at a
// time. Twelve accumulators, three registers of values and a broadcast fill AVX2's sixteen, with 7 loads per 12
// multiply-adds.
template <class Values>
void weigh_in_registers(const float* p, int64_t pk, int64_t pr, const Values& v, int64_t D, int64_t r0,
                        int64_t r1, int64_t j0, int64_t j1, float* o) {
  const auto tile = [&](auto width, int64_t d0) {
    by_row_blocks<4>(r0, r1, [&](auto rows, int64_t r) {
      weigh_registers<decltype(rows)::value, decltype(width)::value>(p, pk, pr, v, D, r, d0, j0, j1, o);
    });
  };
  int64_t d0 = 0;
  for (; d0 + 24 <= D; d0 += 24) tile(std::integral_constant<int, 24>{}, d0);
  if (D - d0 == 16) tile(std::integral_constant<int, 16>{}, d0);
  if (D - d0 == 8) tile(std::integral_constant<int, 8>{}, d0);
}
#endif

// o[RB rows][DW columns from d0] += sum over keys j in [j0, j1) of p[j][r0 + row] * v[j][d0 + col],
// one madd per key in key order for every (row, column). p[j][r] sits at p[j * pk + r * pr]: rows as
// lanes (pk = rp, pr = 1) or keys as lanes (pk = 1, pr = kChunk).
template <int RB, int DW>
void weigh_values(const float* p, int64_t pk, int64_t pr, const float* v, int64_t D, int64_t r0, int64_t d0,
                  int64_t j0, int64_t j1, float* o) {
  float acc[RB][DW];
  for (int rr = 0; rr < RB; ++rr)
#pragma omp simd
    for (int c = 0; c < DW; ++c) acc[rr][c] = o[(r0 + rr) * D + d0 + c];
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * D + d0;
    for (int rr = 0; rr < RB; ++rr) {
      const float pj = p[j * pk + (r0 + rr) * pr];
#pragma omp simd
      for (int c = 0; c < DW; ++c) acc[rr][c] = madd(pj, vj[c], acc[rr][c]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
#pragma omp simd
    for (int c = 0; c < DW; ++c) o[(r0 + rr) * D + d0 + c] = acc[rr][c];
}

// Columns [d0, d0 + DW) of rows [r0, r1) over keys [j0, j1): RB rows at a time, the leftover rows as one block.
template <int DW, int RB>
void weigh_tile(const float* p, int64_t pk, int64_t pr, const float* v, int64_t D, int64_t r0, int64_t r1,
                int64_t d0, int64_t j0, int64_t j1, float* o) {
  by_row_blocks<RB>(r0, r1, [&](auto rows, int64_t r) {
    weigh_values<decltype(rows)::value, DW>(p, pk, pr, v, D, r, d0, j0, j1, o);
  });
}

// Rows [r0, r1) over keys [j0, j1) for the columns [0, D): column tiles of DW, leftover columns one at a time (the
// same madd chain per element).
template <int DW>
void weigh_rows(const float* p, int64_t pk, int64_t pr, const float* v, int64_t D, int64_t r0, int64_t r1,
                int64_t j0, int64_t j1, float* o) {
  constexpr int RB = std::clamp(kAccFloats / DW, 1, 4);  // rows per register block
  const int64_t dfull = D / DW * DW;
  for (int64_t d0 = 0; d0 < dfull; d0 += DW) weigh_tile<DW, RB>(p, pk, pr, v, D, r0, r1, d0, j0, j1, o);
  for (int64_t d0 = dfull; d0 < D; ++d0)
    for (int64_t r = r0; r < r1; ++r) weigh_values<1, 1>(p, pk, pr, v, D, r, d0, j0, j1, o);
}

void weigh(const float* p, int64_t pk, int64_t pr, const float* v, int64_t D, int64_t r0, int64_t r1,
           int64_t j0, int64_t j1, float* o) {
#if SPARSEDRAFT_REGISTER_BLOCKS
  if (D % 8 == 0) return weigh_in_registers(p, pk, pr, FloatValues{v, D}, D, r0, r1, j0, j1, o);
#endif
  if (D % 64 == 0 && kAccFloats >= 3 * 64) {
    weigh_rows<64>(p, pk, pr, v, D, r0, r1, j0, j1, o);
  } else if (D % 32 == 0 && kAccFloats >= 3 * 32) {
    weigh_rows<32>(p, pk, pr, v, D, r0, r1, j0, j1, o);
  } else {
    weigh_rows<16>(p, pk, pr, v, D, r0, r1, j0, j1, o);
  }
}

// Keys as lanes, for steps with few query rows per KV head: a decode's g rows would fill g of the row
// path's 16 lanes, so most of its score and softmax arithmetic would be padding. The chunk's keys are
// transposed to kt [D][kKeyStride]; row r's score of key j is the same madd chain over d in order from 0
// as in the row path, its softmax the same max, exponentials and in-order sum, so every (key, row)
// gets the same bits on either path.
constexpr int64_t kKeyBlock = 64;  // keys scored side by side for one row
// Floats between kt's rows: a chunk plus one cache line. At exactly kChunk (1 KiB) the eight rows an 8x8
// block writes map to the same few L1 sets and evict each other; transposing then took half the decode
// attention's time (perf, one thread, 4K keys). The layout changes no arithmetic.
constexpr int64_t kKeyStride = kChunk + 16;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint16_t h;
  std::memcpy(&h, &x, sizeof h);
  return bf16_to_float(h);
}

// Prefetch the part [from, to) of a byte range (64-byte lines) into L2.
inline void prefetch_span(const char* base, int64_t from, int64_t to) {
  for (int64_t b = from / 64 * 64; b < to; b += 64) prefetch_l2(base + b);
}

// While keys [j0, j1) of a chunk of len are worked on, the same share of this chunk's values (used once the
// keys are scored) and of the next chunk's keys (either none: nullptr): memory keeps streaming in step with
// the work.
inline void prefetch_share(const char* values, int64_t value_bytes, const char* next_keys, int64_t next_bytes,
                           int64_t len, int64_t j0, int64_t j1) {
  prefetch_span(values, j0 * value_bytes / len, j1 * value_bytes / len);
  if (next_keys != nullptr) prefetch_span(next_keys, j0 * next_bytes / len, j1 * next_bytes / len);
}

#if defined(__AVX2__)
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift: exact
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}
inline __m128 load4(const int8_t* p) {  // int8 codes -> fp32: exact (the caller applies the key's scale)
  int32_t bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(bytes)));
}

// Four columns of eight keys: a[i] holds key i's four values in its low half and key i + 4's in its
// high half; an in-lane 4x4 transpose then gives column c of all eight keys in col[c].
inline void transpose_halves(const __m256 a[4], __m256 col[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
  col[0] = _mm256_shuffle_ps(t0, t2, 0x44), col[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  col[2] = _mm256_shuffle_ps(t1, t3, 0x44), col[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// col[i] = k[0 .. 7][i] for i < 8: one 8x8 block of keys (rows D apart), moved exactly. The loads pair
// key i with key i + 4 across the two 128-bit halves, so no cross-half shuffle is needed (those cost
// several cycles each on CPUs that split 256-bit operations, like the first Zen cores).
template <typename scalar_t>
inline void transpose8(const scalar_t* k, int64_t D, __m256 col[8]) {
  __m256 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    const scalar_t* a = k + i * D;
    const scalar_t* b = k + (i + 4) * D;
    lo[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(load4(a)), load4(b), 1);
    hi[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(load4(a + 4)), load4(b + 4), 1);
  }
  transpose_halves(lo, col);
  transpose_halves(hi, col + 4);
}

// kt[d0 + i][0 .. 7] = k[0 .. 7][d0 + i]: transpose8 stored at kt's row stride.
template <typename scalar_t>
inline void transpose8_into(const scalar_t* k, int64_t D, float* kt) {
  __m256 col[8];
  transpose8(k, D, col);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + i * kKeyStride, col[i]);
}

#if defined(__FMA__)
// score_by_keys for R <= kFusedRows rows without the transposed copy: each 8x8 block of keys is
// transposed in registers and multiplied straight into the rows' accumulators (eight keys per vector),
// d in order from 0, so every (key, row) gets score_by_keys's chain and bits. Keys past the last whole
// block of eight take the same chain one at a time. Storing kt and reading it back was the larger part
// of a decode's attention. int8 codes (scalar_t int8_t, an int8 draft view) come with a scale per key
// (`scales`, else unused): each column of eight keys is multiplied by their scales, which gives
// float(code) * scale, the float dequantize_keys stores, so they score to the bits of that copy, without it.
constexpr int64_t kFusedRows = 6;

template <int R, typename scalar_t>
void score_keys_fused(const float* qt, int64_t rp, const scalar_t* k, const float* scales, int64_t len, int64_t D,
                      float* s, const char* values, int64_t value_bytes, const char* next_keys, int64_t next_bytes) {
  constexpr bool coded = std::is_same_v<scalar_t, int8_t>;
  const int64_t j8 = len / 8 * 8;
  for (int64_t j0 = 0; j0 < j8; j0 += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256 key_scales = coded ? _mm256_loadu_ps(scales + j0) : _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      // This block's share of the prefetches, a few lines per column step (positions counted in key floats:
      // step d0 of block j0 covers [j0 * D + 8 * d0, + 64)). One burst of 32 lines per block filled the
      // miss buffers and stalled the scoring behind it; spread out, the fetches overlap the arithmetic
      // (fp32 decode attention 8% faster at 4K and 16% at 16K on a Zen 3 EPYC, both builds in one process:
      // docs/results/attention-prefetch-ab.json).
      prefetch_share(values, value_bytes, next_keys, next_bytes, len * D, j0 * D + d0 * 8, j0 * D + d0 * 8 + 64);
      __m256 col[8];
      transpose8(k + j0 * D + d0, D, col);
      if constexpr (coded)
        for (int i = 0; i < 8; ++i) col[i] = _mm256_mul_ps(col[i], key_scales);
      for (int i = 0; i < 8; ++i)
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(col[i], _mm256_set1_ps(qt[(d0 + i) * rp + r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + r * kChunk + j0, acc[r]);
  }
  prefetch_share(values, value_bytes, next_keys, next_bytes, len, j8, len);
  for (int64_t j = j8; j < len; ++j)
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float kd = coded ? static_cast<float>(k[j * D + d]) * scales[j] : to_float(k[j * D + d]);
        acc = madd(kd, qt[d * rp + r], acc);
      }
      s[r * kChunk + j] = acc;
    }
}

// The fused scoring for R rows, if there is one for this build, R and D; false: take transpose + score.
template <typename scalar_t>
bool score_fused(const float* qt, int64_t rp, const scalar_t* k, const float* scales, int64_t len, int64_t D,
                 int64_t R, float* s, const char* values, int64_t value_bytes, const char* next_keys,
                 int64_t next_bytes) {
  if (D % 8 != 0 || R > kFusedRows) return false;
  using Fn = void (*)(const float*, int64_t, const scalar_t*, const float*, int64_t, int64_t, float*, const char*,
                      int64_t, const char*, int64_t);
  static constexpr Fn kByRows[kFusedRows] = {score_keys_fused<1, scalar_t>, score_keys_fused<2, scalar_t>,
                                             score_keys_fused<3, scalar_t>, score_keys_fused<4, scalar_t>,
                                             score_keys_fused<5, scalar_t>, score_keys_fused<6, scalar_t>};
  kByRows[R - 1](qt, rp, k, scales, len, D, s, values, value_bytes, next_keys, next_bytes);
  return true;
}
#endif  // __FMA__
#endif

// kt[d][j] = k[j][d] for j < len (8x8 blocks where AVX2 is built in, element by element elsewhere and
// for the edges). Along the way, in step with the keys moved, this chunk's values (used once the keys
// are scored) and the next chunk's keys are prefetched, so memory keeps streaming while this one is
// computed instead of stalling at each first touch.
template <typename scalar_t>
void transpose_keys(const scalar_t* k, int64_t len, int64_t D, float* kt, const char* values,
                    int64_t value_bytes, const char* next_keys, int64_t next_bytes) {
  int64_t j8 = 0, d8 = 0;
#if defined(__AVX2__)
  j8 = len / 8 * 8, d8 = D / 8 * 8;
  for (int64_t j = 0; j < j8; j += 8) {
    prefetch_share(values, value_bytes, next_keys, next_bytes, len, j, j + 8);
    for (int64_t d = 0; d < d8; d += 8) transpose8_into(k + j * D + d, D, kt + d * kKeyStride + j);
  }
#endif
  prefetch_share(values, value_bytes, next_keys, next_bytes, len, j8, len);
  for (int64_t d = 0; d < D; ++d) {
    float* row = kt + d * kKeyStride;
    for (int64_t j = d < d8 ? j8 : 0; j < len; ++j) row[j] = to_float(k[j * D + d]);
  }
}

void score_by_keys(const float* qt, int64_t rp, const float* kt, float* s, int64_t D, int64_t R, int64_t len) {
  for (int64_t j0 = 0; j0 < len; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, len - j0);
    for (int64_t r = 0; r < R; ++r) {
      float acc[kKeyBlock] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qt[d * rp + r];
        const float* kd = kt + d * kKeyStride + j0;
#pragma omp simd
        for (int64_t l = 0; l < kKeyBlock; ++l) acc[l] = madd(kd[l], qd, acc[l]);
      }
      float* sr = s + r * kChunk + j0;
      for (int64_t l = 0; l < n; ++l) sr[l] = acc[l];
    }
  }
}

struct Scratch {  // per thread, reused across calls
  std::vector<float> scores, keys, values, row, keys_t;
  std::vector<uint16_t> tiles;  // the tile path's key tail, weights and paired values
  std::vector<float> dequantized;  // the int8 path's block of keys or values as floats
  std::vector<float> weights;  // the tile path's softmax weights, keys as lanes [R][kChunk]
  std::vector<int64_t> seen;
};

// n elements of buf from a cache-line boundary, the buffer grown to hold them: a 64-byte store, load or tile row
// that straddles two lines costs two (aligning the tile path's buffers took a tenth off its time).
template <typename T>
T* on_lines(std::vector<T>& buf, int64_t n) {
  const int64_t pad = 64 / sizeof(T);
  if (static_cast<int64_t>(buf.size()) < n + pad) buf.resize(n + pad);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

template <typename scalar_t>
const float* as_floats(const scalar_t* src, int64_t n, std::vector<float>& buf);

template <>
const float* as_floats<float>(const float* src, int64_t, std::vector<float>&) {
  return src;
}

template <>
const float* as_floats<at::BFloat16>(const at::BFloat16* src, int64_t n, std::vector<float>& buf) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  float* out = buf.data();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(h[i]);
  return out;
}

// l[r] = the sum of s[r][0 .. len) in key order (as the row path adds), N rows' chains side by side:
// one chain is bound by the add's latency, several fill the pipeline.
template <int N>
void sum_rows_of(const float* s, int64_t len, float* l) {
  float acc[N] = {};
  for (int64_t j = 0; j < len; ++j)
    for (int q = 0; q < N; ++q) acc[q] += s[q * kChunk + j];
  for (int q = 0; q < N; ++q) l[q] = acc[q];
}

void sum_rows(const float* s, int64_t R, int64_t len, float* l) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) sum_rows_of<4>(s + r * kChunk, len, l + r);
  switch (R - r) {
    case 3: sum_rows_of<3>(s + r * kChunk, len, l + r); break;
    case 2: sum_rows_of<2>(s + r * kChunk, len, l + r); break;
    case 1: sum_rows_of<1>(s + r * kChunk, len, l + r); break;
    default: break;
  }
}

// The keys layout's softmax over one chunk (s[r][kChunk], keys as lanes): each row's unseen keys masked, its
// max, the exponentials in place and their in-order sum into m and l. Returns the keys every row sees
// (scratch.seen holds each row's count).
inline int64_t softmax_by_keys(const Shape& sh, float* s, int64_t c0, int64_t len, Scratch& scratch, float* m,
                               float* l) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t R = sh.R;
  int64_t seen_by_all = len;
  scratch.seen.resize(R);
  int64_t* seen = scratch.seen.data();
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;  // within kChunk: whole blocks of lanes
  for (int64_t r = 0; r < R; ++r) {
    seen[r] = std::clamp<int64_t>(sh.visible(r) - c0, 0, len);
    seen_by_all = std::min(seen_by_all, seen[r]);
    float* sr = s + r * kChunk;
    for (int64_t j = seen[r]; j < len; ++j) sr[j] = kNegInf;
    for (int64_t j = len; j < padded; ++j) sr[j] = kNegInf;
    float mx = kNegInf;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < len; ++j) mx = sr[j] > mx ? sr[j] : mx;
    float mxs[kLanes];
    std::fill(mxs, mxs + kLanes, mx);
    for (int64_t j0 = 0; j0 < padded; j0 += kLanes) exp2_lanes(sr + j0, mxs);
    m[r] = seen[r] > 0 ? mx : kNegInf;
  }
  sum_rows(s, R, len, l);
  return seen_by_all;
}

// Scores of keys k[0 .. n) (rows of D) for the keys-as-lanes layout, into s[r][kChunk] from s: fused in
// registers where this build and R allow, else through the transposed copy; `bytes` of `values` are asked for
// along the way.
template <typename scalar_t>
void score_keys_block(const float* qt, int64_t rp, const scalar_t* k, int64_t n, int64_t D, int64_t R, float* s,
                      const char* values, int64_t bytes, Scratch& scratch) {
#if defined(__AVX2__) && defined(__FMA__)
  if (score_fused(qt, rp, k, static_cast<const float*>(nullptr), n, D, R, s, values, bytes, nullptr, 0)) return;
#endif
  transpose_keys(k, n, D, scratch.keys_t.data(), values, bytes, nullptr, 0);
  score_by_keys(qt, rp, scratch.keys_t.data(), s, D, R, n);
}

// Keys per step of the keys-as-lanes weighing, each step asking for its share of the next chunk's keys: 8 keys'
// share is 32 lines, which the miss buffers absorb while the step's multiply-adds run; 32 keys' 128 lines at
// once stalled the weighing (part of the gain in attention-prefetch-ab.json, above).
constexpr int64_t kWeighKeys = 8;

// attend_chunk with keys as lanes (steps of at most sh.key_rows rows): the same outputs, bit for bit.
template <typename scalar_t>
void attend_chunk_by_keys(const Shape& sh, const float* qt, const scalar_t* kc, const scalar_t* vc, int64_t c0,
                          int64_t len, const scalar_t* next_k, int64_t next_len, Scratch& scratch, float* o,
                          float* m, float* l) {
  const int64_t D = sh.D, rp = sh.rp, R = sh.R;
  if (static_cast<int64_t>(scratch.keys_t.size()) < D * kKeyStride) scratch.keys_t.assign(D * kKeyStride, 0.0f);
  float* s = on_lines(scratch.scores, kChunk * rp);  // [R][kChunk]
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const char* values = reinterpret_cast<const char*>(vc);
  const char* next_keys = reinterpret_cast<const char*>(next_k);
  // The scoring asks for this chunk's values; the next chunk's keys are asked for while the values are weighed
  // (below), so memory is kept busy through both phases instead of taking both requests during the scoring.
  score_keys_block(qt, rp, kc, len, D, R, s, values, len * row_bytes, scratch);

  const int64_t seen_by_all = softmax_by_keys(sh, s, c0, len, scratch, m, l);
  const int64_t* seen = scratch.seen.data();
  const float* v = as_floats(vc, len * D, scratch.values);
  std::fill(o, o + R * D, 0.0f);
  // Keys in steps, each with its share of the next chunk's keys asked for (all at once when no key is seen by
  // every row): a step continues every (row, column) chain where the last one stopped, so the bits are those of
  // one pass.
  const int64_t next_bytes = next_len * row_bytes;
  if (seen_by_all == 0) prefetch_share(nullptr, 0, next_keys, next_bytes, 1, 0, 1);
  for (int64_t j0 = 0; j0 < seen_by_all; j0 += kWeighKeys) {
    const int64_t j1 = std::min(seen_by_all, j0 + kWeighKeys);
    prefetch_share(nullptr, 0, next_keys, next_bytes, seen_by_all, j0, j1);
    weigh(s, 1, kChunk, v, D, 0, R, j0, j1, o);
  }
  for (int64_t r = 0; r < R; ++r)
    if (seen[r] > seen_by_all) weigh(s, 1, kChunk, v, D, r, r + 1, seen_by_all, seen[r], o);
}

// Rows [v0, v0 + W) of the row layout's softmax over one chunk (s[j][rp], rows as lanes): the max, the
// exponentials in place and their in-order sum into m and l. While the first block's exponentials are taken,
// the next chunk's keys are asked for (no load waits on memory then).
template <int W, typename scalar_t>
void softmax_rows_block(const Shape& sh, float* s, int64_t v0, int64_t len, const scalar_t* next_k, int64_t next_len,
                        const int64_t* seen, float* m, float* l) {
  const int64_t D = sh.D, rp = sh.rp, R = sh.R;
  float mx[W], sum[W];
  for (int x = 0; x < W; ++x) mx[x] = -std::numeric_limits<float>::infinity();
  for (int64_t jj = 0; jj < len; ++jj) {
    const float* sj = s + jj * rp + v0;
#pragma omp simd
    for (int x = 0; x < W; ++x) mx[x] = sj[x] > mx[x] ? sj[x] : mx[x];
  }
  for (int x = 0; x < W; ++x) sum[x] = 0.0f;
  for (int64_t jj = 0; jj < len; ++jj) {
    if (v0 == 0 && jj < next_len) {
      const char* key = reinterpret_cast<const char*>(next_k + jj * D);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(scalar_t)); b += 64) prefetch_l2(key + b);
    }
    float* sj = s + jj * rp + v0;
    for (int x = 0; x < W; x += kLanes) exp2_lanes(sj + x, mx + x);
#pragma omp simd
    for (int x = 0; x < W; ++x) sum[x] += sj[x];
  }
  for (int64_t x = 0; x < W && v0 + x < R; ++x) {
    m[v0 + x] = seen[v0 + x] > 0 ? mx[x] : -std::numeric_limits<float>::infinity();
    l[v0 + x] = sum[x];
  }
}

// The row layout's softmax over one chunk: each row's unseen keys masked, then the rows in passes of 16 (each
// pass reads every key's scores, so two AVX2 blocks of 8 share one; a last block of 8 alone).
// Returns the keys every row sees (scratch.seen holds each row's count).
template <typename scalar_t>
int64_t softmax_by_rows(const Shape& sh, float* s, int64_t c0, int64_t len, const scalar_t* next_k,
                        int64_t next_len, Scratch& scratch, float* m, float* l) {
  constexpr int kPass = 16;
  static_assert(kPass % kLanes == 0);
  const int64_t rp = sh.rp, R = sh.R;
  int64_t seen_by_all = len;  // keys every row sees; beyond it, rows stop at their own bound
  scratch.seen.resize(R);
  int64_t* seen = scratch.seen.data();
  for (int64_t r = 0; r < R; ++r) {
    seen[r] = std::clamp<int64_t>(sh.visible(r) - c0, 0, len);
    seen_by_all = std::min(seen_by_all, seen[r]);
    for (int64_t jj = seen[r]; jj < len; ++jj) s[jj * rp + r] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t v0 = 0; v0 < rp; v0 += kPass) {
    if (rp - v0 >= kPass)
      softmax_rows_block<kPass>(sh, s, v0, len, next_k, next_len, seen, m, l);
    else
      softmax_rows_block<static_cast<int>(kLanes)>(sh, s, v0, len, next_k, next_len, seen, m, l);
  }
  return seen_by_all;
}

// One chunk of one (batch, kv head): writes o [R][D] (unnormalised), m [R] (row max, -inf when the
// row sees none of these keys) and l [R] (sum of exponentials).
template <typename scalar_t>
void attend_chunk(const Shape& sh, const float* qt, const scalar_t* kc, const scalar_t* vc, int64_t c0,
                  int64_t len, const scalar_t* next_k, int64_t next_len, Scratch& scratch, float* o, float* m,
                  float* l) {
  const int64_t D = sh.D, rp = sh.rp, R = sh.R;
  if (R <= sh.key_rows) {
    attend_chunk_by_keys(sh, qt, kc, vc, c0, len, next_k, next_len, scratch, o, m, l);
    return;
  }
  float* s = on_lines(scratch.scores, kChunk * rp);

  const float* k = as_floats(kc, len * D, scratch.keys);
  // float keys are read in place and asked for ahead of the scoring (which reaches into the next chunk's, when
  // it follows in memory); others (bf16, widened into scratch) have the next chunk's asked for in the softmax
  constexpr bool in_place = std::is_same_v<scalar_t, float> && kKeysAhead > 0;
  score(qt, k, s, D, rp, len, reinterpret_cast<const char*>(vc), D * static_cast<int64_t>(sizeof(scalar_t)),
        in_place);

  const int64_t seen_by_all = softmax_by_rows(sh, s, c0, len, next_k, in_place ? 0 : next_len, scratch, m, l);
  const int64_t* seen = scratch.seen.data();

  const float* v = as_floats(vc, len * D, scratch.values);
  std::fill(o, o + R * D, 0.0f);
  weigh(s, rp, 1, v, D, 0, R, 0, seen_by_all, o);
  for (int64_t r = 0; r < R; ++r)
    if (seen[r] > seen_by_all) weigh(s, rp, 1, v, D, r, r + 1, seen_by_all, seen[r], o);
}

#if SPARSEDRAFT_TILES || SPARSEDRAFT_DOTS
// AMX tiles for bf16 caches (built where the compiler targets AMX-BF16, run once the OS grants the
// tile state). A tile product adds each (row, column)'s products in one fixed order whatever else the
// tile holds, so padding rows and keys never change a row's bits, and a decode and a verification of
// the same rows agree exactly, as on the other paths (with other bits: q is multiplied unscaled, each row's
// sum of exponentials is 16 lane sums joined by a tree, and the softmax weights are rounded to bf16 before
// they weigh the values, as flash attention does on GPUs).
//
// Scores come out transposed, s^T = K Q^T, so the cached keys load into tiles as they lie (16 keys x 32
// dims per tile) and only the small query block is rearranged (pack_operand, once per call). A 16x16
// transpose per block turns them into rows of keys, where the softmax runs over the rows that exist
// (softmax_tiles) and the weights P [rows][keys] are the first operand of the weighted sum o = P V as they
// lie; the values go in with key pairs interleaved (the tile unit's operand layout), made per chunk.

// out[c] = column c of the 16x16 block in[0..15] (rows to columns), exactly.
inline void transpose16(const __m512 in[16], __m512 out[16]) {
  __m512 u[16];
  for (int i = 0; i < 16; i += 4) {
    const __m512 t0 = _mm512_unpacklo_ps(in[i], in[i + 1]), t1 = _mm512_unpackhi_ps(in[i], in[i + 1]);
    const __m512 t2 = _mm512_unpacklo_ps(in[i + 2], in[i + 3]), t3 = _mm512_unpackhi_ps(in[i + 2], in[i + 3]);
    u[i] = _mm512_shuffle_ps(t0, t2, 0x44), u[i + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t1, t3, 0x44), u[i + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // u[4i + c]'s 128-bit lane L: rows 4i .. 4i+3 of column 4L + c
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_f32x4(x0, y0, 0x88), out[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    out[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88), out[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// st[r][j] = s[j][r] * qscale for the rows of each block of 16 up to rp that has rows below R, keys j < len
// (kChunk apart): the tile scores turned into the keys-as-lanes layout, so the softmax runs over the rows that
// exist (a decode's 3 of 16 lanes in the row layout). Scaled after the transpose: the product rounds as before.
void scores_by_keys(const float* s, int64_t rp, int64_t R, int64_t len, float qscale, float* st) {
  const __m512 scale = _mm512_set1_ps(qscale);
  __m512 in[16], out[16];
  for (int64_t v0 = 0; v0 < R; v0 += 16)
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      for (int i = 0; i < 16; ++i)
        in[i] = j0 + i < len ? _mm512_loadu_ps(s + (j0 + i) * rp + v0) : _mm512_setzero_ps();
      transpose16(in, out);
      for (int64_t r = 0; r < 16 && v0 + r < R; ++r)
        _mm512_storeu_ps(st + (v0 + r) * kChunk + j0, _mm512_mul_ps(out[r], scale));
    }
}

// The tile path's softmax over one chunk, keys as lanes (st[r][kChunk]): for each row r < R its unseen keys
// masked, the max, the exponentials in place, and their sum as 16 lane sums (lane x adding keys x, x + 16, ...
// in order) joined by one fixed tree. A row's operations depend on its own scores and bound alone, so a decode
// and a verification give it the same bits; the tree's order is this path's own (the vector paths add each
// row's keys in order), as the tile products are. In the row layout a verification's 21 rows took 32 lanes of
// exponentials and one dependent chain of adds per lane. Returns the keys every row sees; scratch.seen holds
// each row's count.
int64_t softmax_tiles(const Shape& sh, float* st, int64_t c0, int64_t len, Scratch& scratch, float* m, float* l) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t R = sh.R, blocks = (len + 15) / 16;
  int64_t seen_by_all = len;
  scratch.seen.resize(R);
  int64_t* seen = scratch.seen.data();
  for (int64_t r = 0; r < R; ++r) {
    seen[r] = std::clamp<int64_t>(sh.visible(r) - c0, 0, len);
    seen_by_all = std::min(seen_by_all, seen[r]);
    float* sr = st + r * kChunk;
    std::fill(sr + seen[r], sr + blocks * 16, kNegInf);
    __m512 top[4] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf),
                     _mm512_set1_ps(kNegInf)};
    for (int64_t b = 0; b < blocks; ++b) top[b % 4] = _mm512_max_ps(_mm512_loadu_ps(sr + 16 * b), top[b % 4]);
    const float mx =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 e = exp2_nonpositive_lanes<Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * b), mv));
      _mm512_storeu_ps(sr + 16 * b, e);
      sum = _mm512_add_ps(sum, e);
    }
    m[r] = seen[r] > 0 ? mx : kNegInf;
    l[r] = _mm512_reduce_add_ps(sum);  // a fixed tree over the 16 lanes
  }
  return seen_by_all;
}

// pt[r][j] = bf16(st[r][j]) for rows r < R and keys j < len, zero for keys len .. n32 and rows R .. rp: the
// softmax weights as the tile unit's first operand.
void weights_bf16(const float* st, int64_t R, int64_t rp, int64_t len, int64_t n32, uint16_t* pt) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j0 = 0; j0 < n32; j0 += 32) {
      const auto keep = [&](int64_t j) {  // lanes j .. j + 15 that hold keys
        return static_cast<__mmask16>(j >= len ? 0 : (len - j >= 16 ? 0xFFFF : (1u << (len - j)) - 1));
      };
      const __m512 lo = _mm512_maskz_loadu_ps(keep(j0), st + r * kChunk + j0);
      const __m512 hi = _mm512_maskz_loadu_ps(keep(j0 + 16), st + r * kChunk + j0 + 16);
      _mm512_storeu_si512(pt + r * kChunk + j0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  std::fill(pt + R * kChunk, pt + rp * kChunk, uint16_t{0});
}

// vv[p][d][e] = v[2p + e][d] for key pairs p < n32 / 2 (keys from len on are zero): the values as the tile
// unit's second operand. next_bytes of next_keys are asked for along the way, a pair of keys' span at a time.
void pair_values(const uint16_t* v, int64_t len, int64_t n32, int64_t D, uint16_t* vv, const char* next_keys,
                 int64_t next_bytes) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  const int64_t pair_bytes = 4 * D;
  for (int64_t j = 0; j < n32; j += 2) {
    if (next_keys != nullptr) prefetch_span(next_keys, j * 2 * D, std::min(next_bytes, j * 2 * D + pair_bytes));
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = j < len ? _mm512_loadu_si512(v + j * D + d) : _mm512_setzero_si512();
      const __m512i b = j + 1 < len ? _mm512_loadu_si512(v + (j + 1) * D + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vv + j * D + 2 * d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(vv + j * D + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
    }
  }
  if (next_keys != nullptr) prefetch_span(next_keys, n32 * 2 * D, next_bytes);  // a longer next chunk's rest
}

#endif
#if SPARSEDRAFT_TILES

// Scores of the 16 keys at `keys` (D = 64, rows `bytes` apart) against the query tiles Q0 and Q1 (dims 0-31 and
// 32-63) into tile C, the keys loaded into K0 and K1. A macro, not a template: GCC's tile intrinsics paste their
// tile numbers into the instruction text, so they must be literal numbers where the intrinsic is written (a
// template parameter there fails to assemble, and the build falls back to the portable one).
#define SPARSEDRAFT_SCORE16(C, K0, K1, Q0, Q1, keys, bytes) \
  do {                                                      \
    const uint16_t* score16_keys = (keys);                  \
    _tile_loadd(K0, score16_keys, bytes);                   \
    _tile_loadd(K1, score16_keys + 32, bytes);              \
    _tile_zero(C);                                          \
    _tile_dpbf16ps(C, K0, Q0);                              \
    _tile_dpbf16ps(C, K1, Q1);                              \
  } while (0)

// attend_chunk on tiles (bf16, D a multiple of 32): the same outputs as every path gives, in its own bits.
void attend_chunk_tiles(const Shape& sh, const uint16_t* qv, float qscale, const uint16_t* kc, const uint16_t* vc,
                        int64_t c0, int64_t len, const uint16_t* next_k, int64_t next_len, Scratch& scratch,
                        float* o, float* m, float* l) {
  const int64_t D = sh.D, rp = sh.rp, R = sh.R, DS = D / 32;
  const int64_t n32 = (len + 31) / 32 * 32;
  const int64_t front = 2 * rp * D;  // the last block's keys (16 x D bf16), later the output (rp x D fp32)
  float* s = on_lines(scratch.scores, kChunk * rp);
  uint16_t* tail = on_lines(scratch.tiles, front + rp * kChunk + kChunk * D);
  uint16_t* pt = tail + front;
  uint16_t* vv = pt + rp * kChunk;
  const int64_t bytes = D * 2;
  const auto keys_at = [&](int64_t j0) {  // the 16 keys from j0, the last block zero-padded
    prefetch_span(reinterpret_cast<const char*>(vc), j0 * bytes, (j0 + 16) * bytes);
    if (j0 + 16 <= len) return kc + j0 * D;
    std::fill(tail, tail + 16 * D, uint16_t{0});
    std::copy(kc + j0 * D, kc + len * D, tail);
    return static_cast<const uint16_t*>(tail);
  };
  if (D == 64 && rp == 16) {  // two key blocks in flight: alone, each block's store waited on its products
    _tile_loadd(4, qv, 64);
    _tile_loadd(5, qv + 512, 64);
    for (int64_t j0 = 0; j0 < len; j0 += 32) {
      const bool two = j0 + 16 < len;  // only the last block can be partial, so `a` never is when `b` exists
      SPARSEDRAFT_SCORE16(0, 2, 3, 4, 5, keys_at(j0), bytes);
      if (two) SPARSEDRAFT_SCORE16(1, 6, 7, 4, 5, keys_at(j0 + 16), bytes);
      _tile_stored(0, s + j0 * rp, rp * 4);
      if (two) _tile_stored(1, s + (j0 + 16) * rp, rp * 4);
    }
  } else if (D == 64 && rp == 32) {  // the query tiles stay loaded across the chunk's key blocks
    _tile_loadd(4, qv, 64);
    _tile_loadd(5, qv + 512, 64);
    _tile_loadd(6, qv + 1024, 64);
    _tile_loadd(7, qv + 1536, 64);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      SPARSEDRAFT_SCORE16(0, 2, 3, 4, 5, keys_at(j0), bytes);  // rows 0-15, then 16-31 over the same keys
      _tile_zero(1);
      _tile_dpbf16ps(1, 2, 6);
      _tile_dpbf16ps(1, 3, 7);
      _tile_stored(0, s + j0 * rp, rp * 4);
      _tile_stored(1, s + j0 * rp + 16, rp * 4);
    }
  } else {
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const uint16_t* keys = keys_at(j0);
      for (int64_t qb = 0; qb < rp / 16; ++qb) {
        _tile_zero(0);
        for (int64_t ds = 0; ds < DS; ++ds) {
          _tile_loadd(2, keys + ds * 32, bytes);
          _tile_loadd(4, qv + (qb * DS + ds) * 512, 64);
          _tile_dpbf16ps(0, 2, 4);
        }
        _tile_stored(0, s + j0 * rp + qb * 16, rp * 4);
      }
    }
  }
  float* st = on_lines(scratch.weights, R * kChunk);
  scores_by_keys(s, rp, R, len, qscale, st);
  softmax_tiles(sh, st, c0, len, scratch, m, l);
  weights_bf16(st, R, rp, len, n32, pt);
  pair_values(vc, len, n32, D, vv, reinterpret_cast<const char*>(next_k), next_len * bytes);  // asks for them
  // keys past a row's bound got weight 0, and adding 0 changes no bits, so every row takes every key below
  float* acc = reinterpret_cast<float*>(tail);  // [rp][D]; the keys' tail is no longer needed
  for (int64_t qb = 0; qb < rp / 16; ++qb) {
    const uint16_t* p = pt + qb * 16 * kChunk;
    float* a = acc + qb * 16 * D;
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {  // four column tiles share each load of the weights
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j0 = 0; j0 < n32; j0 += 32) {
        const uint16_t* vj = vv + j0 * D + 2 * d0;
        _tile_loadd(4, p + j0, kChunk * 2);
        _tile_loadd(5, vj, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vj + 32, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, vj + 64, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vj + 96, D * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, a + d0, D * 4);
      _tile_stored(1, a + d0 + 16, D * 4);
      _tile_stored(2, a + d0 + 32, D * 4);
      _tile_stored(3, a + d0 + 48, D * 4);
    }
    for (; d0 < D; d0 += 16) {
      _tile_zero(0);
      for (int64_t j0 = 0; j0 < n32; j0 += 32) {
        _tile_loadd(4, p + j0, kChunk * 2);
        _tile_loadd(5, vv + j0 * D + 2 * d0, D * 4);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, a + d0, D * 4);
    }
  }
  std::copy(acc, acc + R * D, o);
}
#endif

#if SPARSEDRAFT_DOTS
// bf16 caches where the build has AVX512-BF16 but not AMX: the tile path's steps (scores s^T = K Q^T over the
// packed queries, the softmax with keys as lanes, the weights rounded to bf16, o = P V over paired values), each
// tile product done by VDPBF16PS, which adds two products (a pair of dims, or of keys) into one fp32 lane. A
// (key, row) score takes the dim pairs in order and a (row, column) output the key pairs in order, each in a lane
// of its own, so a row's bits never depend on the other rows of its step (the contract); they are this path's
// own. Why: widening bf16 to fp32 for a multiply-add does one product per lane and instruction; a verification
// at long context is compute-bound on a 2-core CPU, and this does two.

// The dot-product operations on the 16 lanes of a 512-bit register (a block of 16 query rows) or the 8 of a
// 256-bit one (a last block of at most 8 rows: its padding rows 8 .. 15 are left out). Each lane's operation is
// the same at either width, so a row's bits do not depend on which one its block took.
struct Dots16 {
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V dot(V acc, const uint16_t* pairs, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(pairs),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
};
struct Dots8 {
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V dot(V acc, const uint16_t* pairs, uint32_t pair) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs)),
                            (__m256bh)_mm256_set1_epi32(static_cast<int>(pair)));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
};

// s[(j0 + i) rp + 16 qb + lane] for the KB keys at k (rows D apart): query rows 16 qb .. 16 qb + 15 (qv as
// pack_operand lays them out, so dims 2p and 2p + 1 of the block's rows are the 64 bytes at 32 p) against key i,
// on O's lanes.
template <int KB, class O>
inline void score_keys_dots(const uint16_t* qv, const uint16_t* k, int64_t D, int64_t rp, int64_t qb, float* s) {
  typename O::V acc[KB];
  for (int i = 0; i < KB; ++i) acc[i] = O::zero();
  const uint16_t* rows = qv + qb * 16 * D;
  for (int64_t p = 0; p < D / 2; ++p)
    for (int i = 0; i < KB; ++i) {
      uint32_t pair;
      std::memcpy(&pair, k + i * D + 2 * p, sizeof pair);
      acc[i] = O::dot(acc[i], rows + 32 * p, pair);
    }
  for (int i = 0; i < KB; ++i) O::store(s + i * rp + qb * 16, acc[i]);
}

// The KB keys at k against every block of query rows, a last block of at most 8 rows on 8 lanes.
template <int KB>
inline void score_blocks_dots(const uint16_t* qv, const uint16_t* k, int64_t D, int64_t R, int64_t rp, float* s) {
  for (int64_t qb = 0; qb < rp / 16; ++qb) {
    if (R - 16 * qb <= 8) score_keys_dots<KB, Dots8>(qv, k, D, rp, qb, s);
    else score_keys_dots<KB, Dots16>(qv, k, D, rp, qb, s);
  }
}

// o[r][d0 + 16 c + lane] for RB rows from r0 and NC column vectors from d0: the weights' key pairs pt[r][2p, 2p + 1]
// against the paired values (vv as pair_values lays them out), pairs p < n32 / 2 in order.
template <int RB, int NC>
inline void weigh_dots(const uint16_t* pt, const uint16_t* vv, int64_t n32, int64_t D, int64_t r0, int64_t d0,
                       float* o) {
  __m512 acc[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n32 / 2; ++p) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vv + p * 2 * D + 2 * (d0 + 16 * c));
    for (int r = 0; r < RB; ++r) {
      uint32_t pair;
      std::memcpy(&pair, pt + (r0 + r) * kChunk + 2 * p, sizeof pair);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], w);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (r0 + r) * D + d0 + 16 * c, acc[r][c]);
}

// Steps of at most this many rows per KV head (and sh.key_rows) score with keys as lanes (score_lanes_dots): at 32K
// on a 2-core Zen 4 EPYC a decode's attention (3 rows) took 37.1 ms against 43.1 with rows as lanes, while 6 rows
// took 49.4 against 47.2 (docs/engine.md, "On an AVX512-BF16 machine without AMX").
constexpr int64_t kDotKeyRows = 4;

// How far ahead of the keys it scores the dot-product path asks for more, keys or rows as lanes: past a chunk's
// end, the next chunk's keys, which follow in memory (a prefetch never faults). Without it perf put half of the
// decode scoring's samples on its key loads, and on a 2-core Zen 4 EPYC a 32K decode's attention took 11-15%
// longer, a 2-8 token step's 4-12% (both builds in one process; 2048 and 8192 bytes ahead gained less;
// docs/engine.md).
constexpr int64_t kDotKeysAhead = 4096;

// st[r][j0 + lane] = qscale * the scores of the 16 keys at k (rows D apart; those from `len` on zero) against rows
// r < R, keys as lanes: each 32-dim block of the 16 keys transposed (a key's dim pair is one 32-bit element), then
// per row one VDPBF16PS per dim pair, in d order. A lane's operation is the rows-as-lanes one with its two operands
// swapped, and each pair's products are exact in fp32, so a (key, row) score gets the same bits either way; a
// decode's 3 rows then fill 16 lanes instead of 3 of them.
template <int R>
inline void score_lanes_dots(const uint16_t* qv, const uint16_t* k, int64_t len, int64_t D, float qscale,
                             float* st) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512 in[16], kt[16];
    for (int i = 0; i < 16; ++i)
      in[i] = i < len ? _mm512_loadu_ps(reinterpret_cast<const float*>(k + i * D + d0)) : _mm512_setzero_ps();
    transpose16(in, kt);  // kt[p]: dims d0 + 2p, d0 + 2p + 1 of the 16 keys
    for (int r = 0; r < R; ++r) {
      const uint16_t* q = qv + (r / 16) * 16 * D + r % 16 * 2;  // row r's pair p at q + 32 p (pack_operand)
      for (int p = 0; p < 16; ++p) {
        uint32_t pair;
        std::memcpy(&pair, q + 32 * (d0 / 2 + p), sizeof pair);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_castps_si512(kt[p]),
                                  (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(st + r * kChunk, _mm512_mul_ps(acc[r], _mm512_set1_ps(qscale)));
}

template <int... Rs>
void score_lanes_pick(int64_t R, const uint16_t* qv, const uint16_t* k, int64_t len, int64_t D, float qscale,
                      float* st, std::integer_sequence<int, Rs...>) {
  ((R == Rs + 1 ? (score_lanes_dots<Rs + 1>(qv, k, len, D, qscale, st), 0) : 0), ...);
}

// Rows r0 .. r0 + rows (rows <= 4) over every column: 64 at a time, then 16.
template <int RB>
void weigh_rows_dots(const uint16_t* pt, const uint16_t* vv, int64_t n32, int64_t D, int64_t r0, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weigh_dots<RB, 4>(pt, vv, n32, D, r0, d0, o);
  for (; d0 < D; d0 += 16) weigh_dots<RB, 1>(pt, vv, n32, D, r0, d0, o);
}

// attend_chunk on AVX512-BF16 dot products (bf16, D a multiple of 32): the same outputs as every path gives, in
// its own bits.
void attend_chunk_dots(const Shape& sh, const uint16_t* qv, float qscale, const uint16_t* kc, const uint16_t* vc,
                       int64_t c0, int64_t len, const uint16_t* next_k, int64_t next_len, Scratch& scratch,
                       float* o, float* m, float* l) {
  constexpr int64_t kKeys = 8;  // keys scored side by side: 8 accumulators, each query load used 8 times
  const int64_t D = sh.D, rp = sh.rp, R = sh.R, bytes = 2 * D, n32 = (len + 31) / 32 * 32;
  float* s = on_lines(scratch.scores, kChunk * rp);
  uint16_t* pt = on_lines(scratch.tiles, rp * kChunk + kChunk * D);
  uint16_t* vv = pt + rp * kChunk;
  float* st = on_lines(scratch.weights, R * kChunk);
  const auto ask_for = [&](int64_t j0, int64_t j1) {  // keys j0 .. j1's values, and keys kDotKeysAhead on
    prefetch_span(reinterpret_cast<const char*>(vc), j0 * bytes, j1 * bytes);
    prefetch_span(reinterpret_cast<const char*>(kc), j0 * bytes + kDotKeysAhead, j1 * bytes + kDotKeysAhead);
  };
  if (R <= std::min(sh.key_rows, kDotKeyRows)) {
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      ask_for(j0, std::min(j0 + 16, len));
      score_lanes_pick(R, qv, kc + j0 * D, len - j0, D, qscale, st + j0,
                       std::make_integer_sequence<int, kDotKeyRows>{});
    }
  } else {
    int64_t j0 = 0;
    for (; j0 + kKeys <= len; j0 += kKeys) {  // these keys' values asked for while they are scored
      ask_for(j0, j0 + kKeys);
      score_blocks_dots<kKeys>(qv, kc + j0 * D, D, R, rp, s + j0 * rp);
    }
    for (; j0 < len; ++j0)
      score_blocks_dots<1>(qv, kc + j0 * D, D, R, rp, s + j0 * rp);
    scores_by_keys(s, rp, R, len, qscale, st);
  }
  softmax_tiles(sh, st, c0, len, scratch, m, l);
  weights_bf16(st, R, rp, len, n32, pt);
  pair_values(vc, len, n32, D, vv, reinterpret_cast<const char*>(next_k), next_len * bytes);  // asks for them
  // keys past a row's bound got weight 0, and adding 0 changes no bits, so every row takes every key below
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) weigh_rows_dots<4>(pt, vv, n32, D, r0, o);
  switch (R - r0) {
    case 3: weigh_rows_dots<3>(pt, vv, n32, D, r0, o); break;
    case 2: weigh_rows_dots<2>(pt, vv, n32, D, r0, o); break;
    case 1: weigh_rows_dots<1>(pt, vv, n32, D, r0, o); break;
    default: break;
  }
}
#endif

// Row r of (b, kv): merge its chunks in order into out.
template <typename scalar_t>
void merge_row(const Shape& sh, const float* o, const float* m, const float* l, int64_t r, float* acc,
               scalar_t* out) {
  const int64_t D = sh.D, R = sh.R, n = sh.chunks;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) top = std::max(top, m[c * R + r]);
  std::fill(acc, acc + D, 0.0f);
  float total = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    const float mc = m[c * R + r];
    if (mc == -std::numeric_limits<float>::infinity()) continue;
    const float w = exp2_nonpositive(mc - top);
    total = madd(l[c * R + r], w, total);
    const float* oc = o + (c * R + r) * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] = madd(oc[d], w, acc[d]);
  }
  for (int64_t d = 0; d < D; ++d) {
    const float y = acc[d] / total;
    if constexpr (std::is_same_v<scalar_t, float>) {
      out[d] = y;
    } else {
      reinterpret_cast<uint16_t*>(out)[d] = float_to_bf16(y);
    }
  }
}

// Whether bf16 attention with head_dim D runs on tiles or (without AMX) AVX512-BF16 dot products: built,
// allowed (and for tiles granted), and D a whole number of tile columns. It depends on nothing a step's length
// changes, so decodes and verifications agree.
bool takes_tiles(int64_t D) {
#if SPARSEDRAFT_TILES
  return D % 32 == 0 && tiles_on();
#elif SPARSEDRAFT_DOTS
  return D % 32 == 0 && tiles_allowed.load(std::memory_order_relaxed);
#else
  (void)D;
  return false;
#endif
}

// The queries of every head as the vector paths read them: qt [heads][D][rp], scaled by qscale, rows past R zero.
template <typename scalar_t>
std::vector<float> fold_queries(const scalar_t* qp, int64_t heads, int64_t R, int64_t D, int64_t rp, float qscale) {
  std::vector<float> qt(heads * D * rp, 0.0f);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) qt[(h * D + d) * rp + r] = static_cast<float>(qp[(h * R + r) * D + d]) * qscale;
  return qt;
}

// What every variant shares: items (head, chunk) in contiguous runs per thread, one parallel region, each
// item's partial result (o, m, l) kept, and whichever thread finishes a head's last chunk merges that head
// in chunk order (so who merges does not matter). chunk(item, end, scratch, o, m, l) computes one item;
// `end` is the end of the calling thread's run, so it can prefetch the next item's keys.
template <typename out_t, typename Chunk>
void drive(const Shape& sh, bool tiles, out_t* op, const Chunk& chunk) {
  const int64_t D = sh.D, R = sh.R, heads = sh.B * sh.KV, n = sh.chunks;
  thread_local std::vector<float> partial;  // per calling thread: no page faults on every call
  if (static_cast<int64_t>(partial.size()) < heads * n * R * (D + 2)) partial.resize(heads * n * R * (D + 2));
  float* part_o = partial.data();  // [heads][n][R][D]
  float* part_m = part_o + heads * n * R * D;  // [heads][n][R]
  float* part_l = part_m + heads * n * R;
  std::unique_ptr<std::atomic<int64_t>[]> finished(new std::atomic<int64_t>[heads]);
  for (int64_t h = 0; h < heads; ++h) finished[h].store(0, std::memory_order_relaxed);
  (void)tiles;

  at::parallel_for(0, heads * n, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    scratch.row.resize(D);
#if SPARSEDRAFT_TILES
    if (tiles) configure_tiles();
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / n, c = item % n;
      float* ho = part_o + h * n * R * D;
      float* hm = part_m + h * n * R;
      float* hl = part_l + h * n * R;
      chunk(item, end, scratch, ho + c * R * D, hm + c * R, hl + c * R);
      if (finished[h].fetch_add(1, std::memory_order_acq_rel) + 1 == n)
        for (int64_t r = 0; r < R; ++r) merge_row<out_t>(sh, ho, hm, hl, r, scratch.row.data(), op + (h * R + r) * D);
    }
#if SPARSEDRAFT_TILES
    if (tiles) _tile_release();
#endif
  });
}

template <typename scalar_t>
void run(const Shape& sh, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
         at::Tensor& out) {
  const int64_t D = sh.D, R = sh.R, rp = sh.rp, heads = sh.B * sh.KV, n = sh.chunks;
  const float qscale = static_cast<float>(scale) * kLog2e;  // scores in log2 units: exp2 in the softmax

  const scalar_t* qp = q.data_ptr<scalar_t>();
  const bool tiles = std::is_same_v<scalar_t, at::BFloat16> && takes_tiles(D);
  const std::vector<float> qt = tiles ? std::vector<float>() : fold_queries(qp, heads, R, D, rp, qscale);
  std::vector<uint16_t> qv(tiles ? heads * D * rp : 0);  // per head, as pack_operand lays it out
  for (int64_t h = 0; tiles && h < heads; ++h)
    pack_operand(reinterpret_cast<const uint16_t*>(qp) + h * R * D, R, rp, D, qv.data() + h * D * rp);
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const int64_t kb = k.stride(0), kh = k.stride(1), vb = v.stride(0), vh = v.stride(1);
  const auto keys_of = [&](int64_t item) {
    const int64_t h = item / n;
    return kp + h / sh.KV * kb + h % sh.KV * kh + item % n * kChunk * D;
  };
  const auto length_of = [&](int64_t item) { return std::min(kChunk, sh.S - item % n * kChunk); };

  drive(sh, tiles, out.data_ptr<scalar_t>(), [&](int64_t item, int64_t end, Scratch& scratch, float* o, float* m,
                                                 float* l) {
    const int64_t h = item / n, c = item % n;
    const scalar_t* vc = vp + h / sh.KV * vb + h % sh.KV * vh + c * kChunk * D;
    const bool more = item + 1 < end;
    const scalar_t* next = more ? keys_of(item + 1) : nullptr;
    const int64_t next_len = more ? length_of(item + 1) : 0;
#if SPARSEDRAFT_TILES || SPARSEDRAFT_DOTS
    if (tiles) {
      const auto bits = [](const scalar_t* x) { return reinterpret_cast<const uint16_t*>(x); };
#if SPARSEDRAFT_TILES
      attend_chunk_tiles(sh, qv.data() + h * D * rp, qscale, bits(keys_of(item)), bits(vc), c * kChunk,
                         length_of(item), bits(next), next_len, scratch, o, m, l);
#else
      attend_chunk_dots(sh, qv.data() + h * D * rp, qscale, bits(keys_of(item)), bits(vc), c * kChunk,
                        length_of(item), bits(next), next_len, scratch, o, m, l);
#endif
      return;
    }
#endif
    attend_chunk<scalar_t>(sh, qt.data() + h * D * rp, keys_of(item), vc, c * kChunk, length_of(item), next,
                           next_len, scratch, o, m, l);
  });
}

// Keys [c0, c0 + len) of one head as float rows: below n_codes, int8 codes times their token's scale; from
// n_codes on, the full-precision tail as it is. Each key's floats depend on that key alone, so a row's bits
// stay independent of the step's length, as on the other paths.
void dequantize_keys(const int8_t* codes, int64_t code_stride, const float* scales, const float* tail,
                     int64_t n_codes, int64_t c0, int64_t len, int64_t D, float* out) {
  for (int64_t j = 0; j < len; ++j) {
    const int64_t key = c0 + j;
    float* row = out + j * D;
    if (key < n_codes) {
      const int8_t* cj = codes + key * code_stride;
      const float sj = scales[key];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(cj[d]) * sj;
    } else {
      std::memcpy(row, tail + (key - n_codes) * D, D * sizeof(float));
    }
  }
}

// One head's keys (or values) of a quantised view: codes and a scale per key below n_codes, the float tail
// from there on.
struct Int8Keys {
  const int8_t* codes;
  const float* scales;
  const float* tail;
  int64_t n_codes, D;
  void floats(int64_t c0, int64_t len, float* out) const {
    dequantize_keys(codes, D, scales, tail, n_codes, c0, len, D, out);
  }
  const char* code_bytes(int64_t key) const { return reinterpret_cast<const char*>(codes + key * D); }
#if SPARSEDRAFT_REGISTER_BLOCKS
  Int8Values from(int64_t key) const { return {codes + key * D, scales + key, D}; }  // keys key.. as codes
#endif
};

constexpr int64_t kInt8Block = 32;  // keys dequantised at a time: 8 KiB of floats, in L1

// attend_chunk over int8 keys and values, dequantised kInt8Block keys at a time into a buffer that stays in L1
// (a whole chunk's 128 KiB of floats did not: writing and reading it back cost about as much as the scores).
// Either lane layout, as attend_chunk picks: each (key, row) score is the same madd chain, the softmax is the
// chunk's, and each (row, column) output chain takes the keys in order, block after block (weigh resumes from
// o), so the bits are attend_chunk's over the chunk dequantised whole.
void attend_chunk_int8(const Shape& sh, const float* qt, const Int8Keys& kq, const Int8Keys& vq, int64_t c0,
                       int64_t len, Scratch& scratch, float* o, float* m, float* l) {
  const int64_t D = sh.D, rp = sh.rp, R = sh.R;
  const bool by_keys = R <= sh.key_rows;
  float* s = on_lines(scratch.scores, kChunk * rp);
  float* block = on_lines(scratch.dequantized, kInt8Block * D);
  if (by_keys && static_cast<int64_t>(scratch.keys_t.size()) < D * kKeyStride)
    scratch.keys_t.assign(D * kKeyStride, 0.0f);
  const int64_t pk = by_keys ? 1 : rp, pr = by_keys ? kChunk : 1;  // p[j][r] at s[j * pk + r * pr]
  const int64_t coded = std::clamp<int64_t>(kq.n_codes - c0, 0, len);  // this chunk's keys held as codes
  for (int64_t j0 = 0; j0 < len; j0 += kInt8Block) {
    const int64_t n = std::min(kInt8Block, len - j0);
    // the same keys' value codes come in while these are scored
    const int64_t vn = std::clamp<int64_t>(coded - j0, 0, n);
    const char* values = vn > 0 ? vq.code_bytes(c0 + j0) : nullptr;
#if SPARSEDRAFT_REGISTER_BLOCKS
    // a block of codes scored straight from them (score_keys_fused), keys as lanes
    if (by_keys && vn == n &&
        score_fused(qt, rp, kq.codes + (c0 + j0) * D, kq.scales + c0 + j0, n, D, R, s + j0, values, n * D,
                    nullptr, 0))
      continue;
#endif
    kq.floats(c0 + j0, n, block);
    if (by_keys) {
      score_keys_block(qt, rp, block, n, D, R, s + j0, values, vn * D, scratch);
    } else {
      score(qt, block, s + j0 * rp, D, rp, n, values, vn > 0 ? D : 0);
    }
  }
  const int64_t seen_by_all = by_keys ? softmax_by_keys(sh, s, c0, len, scratch, m, l)
                                      : softmax_by_rows(sh, s, c0, len, static_cast<const float*>(nullptr), 0,
                                                        scratch, m, l);
  const int64_t* seen = scratch.seen.data();
  int64_t last = seen_by_all;  // keys any row sees
  for (int64_t r = 0; r < R; ++r) last = std::max(last, seen[r]);
  std::fill(o, o + R * D, 0.0f);
  for (int64_t j0 = 0; j0 < last; j0 += kInt8Block) {
    const int64_t j1 = std::min(last, j0 + kInt8Block);
    const float* p = s + j0 * pk;  // weigh reads p[j * pk + r * pr] for keys j from j0
    const auto weigh_block = [&](auto&& weigh_rows_of) {
      if (seen_by_all > j0) weigh_rows_of(0, R, 0, std::min(j1, seen_by_all) - j0);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t from = std::max(j0, seen_by_all), to = std::min(j1, seen[r]);
        if (to > from) weigh_rows_of(r, r + 1, from - j0, to - j0);
      }
    };
#if SPARSEDRAFT_REGISTER_BLOCKS
    if (j1 <= coded && D % 8 == 0) {  // a block of codes weighed straight from them
      const Int8Values codes = vq.from(c0 + j0);
      weigh_block([&](int64_t r0, int64_t r1, int64_t a, int64_t b) {
        weigh_in_registers(p, pk, pr, codes, D, r0, r1, a, b, o);
      });
      continue;
    }
#endif
    vq.floats(c0 + j0, j1 - j0, block);
    weigh_block([&](int64_t r0, int64_t r1, int64_t a, int64_t b) { weigh(p, pk, pr, block, D, r0, r1, a, b, o); });
  }
}

// attend over int8 codes plus a float tail (a quantised draft view): each chunk's keys and values are
// dequantised a block at a time into this thread's scratch (in L1) and computed as the float path computes
// them (attend_chunk_int8), so what streams from memory is the codes, a quarter of fp32's bytes.
void run_int8(const Shape& sh, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& ks,
              const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& kt, const at::Tensor& vt, double scale,
              at::Tensor& out) {
  const int64_t D = sh.D, R = sh.R, rp = sh.rp, heads = sh.B * sh.KV, n = sh.chunks, N = kc.size(2);
  const float qscale = static_cast<float>(scale) * kLog2e;
  const std::vector<float> qt = fold_queries(q.data_ptr<float>(), heads, R, D, rp, qscale);
  const auto head_of = [&](const at::Tensor& x, int64_t h) { return h / sh.KV * x.stride(0) + h % sh.KV * x.stride(1); };
  drive(sh, false, out.data_ptr<float>(), [&](int64_t item, int64_t end, Scratch& scratch, float* o, float* m,
                                               float* l) {
    const int64_t h = item / n, c0 = item % n * kChunk, len = std::min(kChunk, sh.S - c0);
    if (item + 1 < end) {  // the next item's codes come in while this one is computed
      const int64_t h1 = (item + 1) / n, n0 = (item + 1) % n * kChunk, n1 = std::min(n0 + kChunk, N);
      if (n0 < n1) {
        const char* base = reinterpret_cast<const char*>(kc.data_ptr<int8_t>() + head_of(kc, h1));
        prefetch_span(base, n0 * D, n1 * D);
        base = reinterpret_cast<const char*>(vc.data_ptr<int8_t>() + head_of(vc, h1));
        prefetch_span(base, n0 * D, n1 * D);
      }
    }
    const Int8Keys keys{kc.data_ptr<int8_t>() + head_of(kc, h), ks.data_ptr<float>() + head_of(ks, h),
                        kt.data_ptr<float>() + head_of(kt, h), N, D};
    const Int8Keys values{vc.data_ptr<int8_t>() + head_of(vc, h), vs.data_ptr<float>() + head_of(vs, h),
                          vt.data_ptr<float>() + head_of(vt, h), N, D};
    attend_chunk_int8(sh, qt.data() + h * D * rp, keys, values, c0, len, scratch, o, m, l);
  });
}

}  // namespace

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale, int64_t T,
                  int64_t key_rows) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: q, k, v must be 4-d [B, KV, rows, D]");
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend: CPU tensors only");
  TORCH_CHECK(q_in.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "attend: q, k, v must share one dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "attend: dtype must be float32 or bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes(), "attend: k and v shapes differ");
  const int64_t B = q_in.size(0), KV = q_in.size(1), R = q_in.size(2), D = q_in.size(3), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == KV && k.size(3) == D, "attend: k is ", k.sizes(), ", q is ",
              q_in.sizes());
  TORCH_CHECK(T >= 1 && R % T == 0, "attend: rows (", R, ") must be a multiple of T (", T, ")");
  TORCH_CHECK(S >= T, "attend: S (", S, ") must be >= T (", T, "): the last T keys are the new tokens");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
              "attend: k and v need contiguous rows of D values, consecutive keys D apart");
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({B, KV, R, D}, q.options());
  if (B == 0 || KV == 0 || R == 0 || D == 0) return out;
  const Shape sh{B, KV, R, T, S, D, key_rows, (R + kLanes - 1) / kLanes * kLanes, (S + kChunk - 1) / kChunk};
  if (q.scalar_type() == at::kFloat) {
    run<float>(sh, q, k, v, scale, out);
  } else {
    run<at::BFloat16>(sh, q, k, v, scale, out);
  }
  return out;
}

int64_t attend_chunk() { return kChunk; }

int64_t attend_lanes() { return kLanes; }

int64_t attend_dots() { return SPARSEDRAFT_DOTS && tiles_allowed.load() ? 1 : 0; }

int64_t attend_dots_for(int64_t D) { return SPARSEDRAFT_DOTS && takes_tiles(D) ? 1 : 0; }

at::Tensor attend_int8(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& vc,
                       const at::Tensor& vs, const at::Tensor& kt, const at::Tensor& vt, double scale, int64_t T,
                       int64_t key_rows) {
  TORCH_CHECK(q.dim() == 4 && kc.dim() == 4 && vc.dim() == 4 && kt.dim() == 4 && vt.dim() == 4 && ks.dim() == 3 &&
                  vs.dim() == 3, "attend_int8: q, codes and tails are [B, KV, *, D], scales [B, KV, N]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kt.scalar_type() == at::kFloat && vt.scalar_type() == at::kFloat &&
                  ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat,
              "attend_int8: q, scales and tails must be float32");
  TORCH_CHECK(kc.scalar_type() == at::kChar && vc.scalar_type() == at::kChar, "attend_int8: codes must be int8");
  TORCH_CHECK(q.is_contiguous(), "attend_int8: q must be contiguous");
  const int64_t B = q.size(0), KV = q.size(1), R = q.size(2), D = q.size(3), N = kc.size(2), S = N + kt.size(2);
  for (const at::Tensor* x : {&kc, &vc, &kt, &vt})
    TORCH_CHECK(x->size(0) == B && x->size(1) == KV && x->size(3) == D && x->stride(3) == 1 && x->stride(2) == D,
                "attend_int8: codes and tails must be [B, KV, *, D] with rows of D contiguous values, got ",
                x->sizes());
  TORCH_CHECK(vc.size(2) == N && vt.size(2) == kt.size(2), "attend_int8: keys and values differ in length");
  for (const at::Tensor* x : {&ks, &vs})
    TORCH_CHECK(x->size(0) == B && x->size(1) == KV && x->size(2) == N && x->stride(2) == 1,
                "attend_int8: scales must be [B, KV, N] with N contiguous");
  TORCH_CHECK(T >= 1 && R % T == 0 && S >= T, "attend_int8: rows (", R, ") must be a multiple of T (", T,
              ") and S (", S, ") >= T");
  at::Tensor out = at::empty({B, KV, R, D}, q.options());
  if (B == 0 || KV == 0 || R == 0 || D == 0) return out;
  const Shape sh{B, KV, R, T, S, D, key_rows, (R + kLanes - 1) / kLanes * kLanes, (S + kChunk - 1) / kChunk};
  run_int8(sh, q, kc, ks, vc, vs, kt, vt, scale, out);
  return out;
}
