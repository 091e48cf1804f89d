// y = (q(x) Q^T) * sx * sw (+ b) for the few rows of a draft step: int8 weight codes Q times each row of x
// rounded to int8 (q(x), one scale sx per row), summed exactly in int32.
//
// Why: a level-2 draft step (the target over its retrieval view, draft_weights int8) reads int8 weights, yet
// widening each code to a float for a multiply-add ran it at half fp32's byte rate on an AVX2 machine
// (docs/engine.md, "Quantised draft levels"). With x rounded to 8 bits as well, 32 products are one
// VPMADDUBSW and one VPMADDWD (llama.cpp's Q8 dot): a quarter of the instructions per weight byte. A draft
// only has to be accepted, so the rounding of x is the draft's business; the verifier never runs this.
//
// Exactness: the int32 sums are exact, so any order, any vector width and any number of rows give the same
// bits; rounding x uses one row alone (amax, 127 / amax, round half to even), so a row's result never
// depends on the other rows of its step. The portable path and quant.py's torch path compute the same bits
// (tests/test_rounded_rows.py holds all three to each other).
//
// Layout: the codes are packed once per model (quant.py's pack_codes): [N4 / 4, K32 / 32, 4, 32], four weight
// rows side by side per 32 inputs, N and K padded with zero codes to multiples of 4 and 32, so a group of
// four rows is one contiguous stream (an int8 row of SmolLM2 is only 9 cache lines). x [..., K] float32 or
// bfloat16 (M <= 16 rows), scale [N] float32, bias [N] of x's dtype or empty; out [..., N] in x's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "prefetch.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// VNNI's VPDPBUSD sums four u8 x s8 products into each int32 lane in one instruction, 64 bytes at a time: a
// group's block (four rows of 32 codes, 128 bytes) is two of them per row of x, against sixteen AVX2
// instructions. It wants one operand unsigned, and AVX-512 has no VPSIGNB to move w's sign onto x, so x goes
// in biased by 128 (x ^ 0x80 = x + 128 in [1, 255]) and 128 * (the row's code sum) comes off after: still
// exact int32 arithmetic, so the same bits as the other paths.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPARSEDRAFT_VNNI 1
#else
#define SPARSEDRAFT_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 4;   // weight rows packed side by side
constexpr int64_t kBlock = 32;  // inputs per packed block of a row

// max |x[k]| over k < n (NaNs skipped, as std::max skips them): a max is the same in any order, so the lanes
// below give the scalar loop's bits. Written out because GCC leaves that loop scalar, one dependent max per
// input, run by one thread while the other waits: it was half of this kernel's serial time in a w8a8 level-2
// step (scratch, in the message of the commit that added this).
float abs_max(const float* x, int64_t n) {
  float amax = 0.0f;
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; k + 32 <= n; k += 32)  // MAXPS keeps its second operand where the first is NaN
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k + 8 * i)), acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3])));
  for (const float lane : lanes) amax = std::max(amax, lane);
#endif
  for (; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// Row x [K] -> codes q [k32] (zero past K) and its scale: amax / 127, codes round(x * (127 / amax)) half to even.
void round_row(const float* x, int64_t k_len, int64_t k32, int8_t* q, float* s) {
  const float amax = abs_max(x, k_len);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int64_t k = 0;
#if defined(__AVX2__)
  // Clamped before rounding (the same codes: |x * inv| exceeds 127 by a rounding error at most), then rounded
  // half to even by the conversion, as std::nearbyint does below, and narrowed without saturating.
  const __m256 scale = _mm256_set1_ps(inv), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  for (; k + 8 <= k_len; k += 8) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), scale), low), high);
    alignas(32) int32_t codes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm256_cvtps_epi32(v));
    for (int l = 0; l < 8; ++l) q[k + l] = static_cast<int8_t>(codes[l]);
  }
#endif
  for (; k < k_len; ++k) q[k] = static_cast<int8_t>(std::nearbyint(std::clamp(x[k] * inv, -127.0f, 127.0f)));
  std::fill(q + k_len, q + k32, int8_t{0});
  *s = amax / 127.0f;
}

// Sums of J of the group's four rows (from j0) against M rows of codes xq (k32 apart), over all blocks of
// group g (nb blocks of kGroup * kBlock bytes); acc[j][m].
template <int M, int J>
void group_sums(const int8_t* xq, const int8_t* g, int64_t nb, int64_t k32, int j0, bool ask,
                int32_t (*acc)[kLinearRows]) {
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum[J][M];
  for (int j = 0; j < J; ++j)
    for (int m = 0; m < M; ++m) sum[j][m] = _mm256_setzero_si256();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* blk = g + b * kGroup * kBlock;
    if (ask) {  // the stream kWeightsAheadBytes on, one request per line this group's blocks hold
      prefetch_l2(reinterpret_cast<const char*>(blk) + kWeightsAheadBytes);
      prefetch_l2(reinterpret_cast<const char*>(blk) + kWeightsAheadBytes + 64);
    }
    __m256i w[J], aw[J];
    for (int j = 0; j < J; ++j) {
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (j0 + j) * kBlock));
      aw[j] = _mm256_abs_epi8(w[j]);  // |w| as unsigned (128 too); x takes w's sign below
    }
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k32 + b * kBlock));
      for (int j = 0; j < J; ++j) {  // |w| * (x signed by w) = w x; pairs <= 2 * 128 * 127 fit int16
        const __m256i pairs = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, w[j]));
        sum[j][m] = _mm256_add_epi32(sum[j][m], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int j = 0; j < J; ++j)
    for (int m = 0; m < M; ++m) {
      const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum[j][m]), _mm256_extracti128_si256(sum[j][m], 1));
      const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
      acc[j0 + j][m] = _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
    }
#else
  (void)ask;
  for (int j = 0; j < J; ++j)
    for (int m = 0; m < M; ++m) {
      int32_t s = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* w = g + b * kGroup * kBlock + (j0 + j) * kBlock;
        const int8_t* x = xq + m * k32 + b * kBlock;
        for (int64_t l = 0; l < kBlock; ++l) s += static_cast<int32_t>(w[l]) * static_cast<int32_t>(x[l]);
      }
      acc[j0 + j][m] = s;
    }
#endif
}

#if SPARSEDRAFT_VNNI
// A pair register of rows 0-1 (a) and one of rows 2-3 (b), eight lanes per row, as one whose 128-bit lane j holds
// four partial sums of row j.
inline __m512i by_row(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

// Four by_row registers as one: lane 4 j + i = the whole sum of row j in register i. One shuffle tree for sixteen
// sums: each alone (a masked reduction) cost about as much as the group's 18 blocks of products at K = 576.
inline __m512i four_sums(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  const __m512i d01 = _mm512_add_epi32(_mm512_unpacklo_epi32(c0, c1), _mm512_unpackhi_epi32(c0, c1));
  const __m512i d23 = _mm512_add_epi32(_mm512_unpacklo_epi32(c2, c3), _mm512_unpackhi_epi32(c2, c3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(d01, d23), _mm512_unpackhi_epi64(d01, d23));
}

// acc + the u8 x s8 dot products of a and b, lane by lane: VPDPBUSD in place. Register blocks: through the
// intrinsic, whose accumulator is tied to its destination, GCC 12 copied each of vnni_sums' accumulators out and
// back every block, and with its loops not all unrolled (the pragmas below) it also stored every accumulator to
// the stack every block (ten 64-byte stores per 128 bytes of codes at M = 5; perf put most of vnni_sums' samples
// on them). Written as the instruction on a "+v" operand, with every loop over rows unrolled, the accumulators
// stay in registers. The same instruction, so the same bits.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The group's four rows against M <= 8 rows of x (from row m0): rows 0-1 of a block in one register and rows
// 2-3 in another, x's 32 codes in both halves, so lane l of a sum belongs to weight row l / 8 of its pair.
template <int M>
void vnni_sums(const int8_t* xq, const int8_t* g, int64_t nb, int64_t k32, int m0, bool ask,
               int32_t (*acc)[kLinearRows]) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  __m512i sum[2][M], codes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) sum[0][m] = sum[1][m] = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* blk = g + b * kGroup * kBlock;
    if (ask) {
      prefetch_l2(reinterpret_cast<const char*>(blk) + kWeightsAheadBytes);
      prefetch_l2(reinterpret_cast<const char*>(blk) + kWeightsAheadBytes + 64);
    }
    const __m512i w[2] = {_mm512_loadu_si512(blk), _mm512_loadu_si512(blk + 2 * kBlock)};
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) codes[h] = dpbusd(codes[h], ones, w[h]);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256i x32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + m) * k32 + b * kBlock));
      const __m512i xu = _mm512_xor_si512(_mm512_broadcast_i64x4(x32), bias);
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) sum[h][m] = dpbusd(sum[h][m], xu, w[h]);
    }
  }
  // registers 0 .. M - 1: the rows of x; register M: the code sums. Exact int32 adds, so any tree gives the bits.
  constexpr int kSets = M / 4 + 1;
  __m512i rows[4 * kSets];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) rows[m] = by_row(sum[0][m], sum[1][m]);
  rows[M] = by_row(codes[0], codes[1]);
#pragma GCC unroll 16
  for (int i = M + 1; i < 4 * kSets; ++i) rows[i] = _mm512_setzero_si512();
  alignas(64) int32_t sums[kSets][16];
#pragma GCC unroll 16
  for (int t = 0; t < kSets; ++t)
    _mm512_store_si512(sums[t], four_sums(rows[4 * t], rows[4 * t + 1], rows[4 * t + 2], rows[4 * t + 3]));
#pragma GCC unroll 16
  for (int j = 0; j < kGroup; ++j) {
    const int32_t code_sum = sums[M / 4][4 * j + M % 4];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[j][m0 + m] = sums[m / 4][4 * j + m % 4] - 128 * code_sum;
  }
}
#endif

// The four rows of one group. VNNI: all four at once, for 8 rows of x at a time (the second eight read the
// group from L1), from 3 rows on; 1-2 rows take AVX2's sums there too, which on a 2-core Zen 4 EPYC read every
// w8a8 matrix of SmolLM2 10% faster for one row than VNNI's (its code sums are half of a one-row block's
// products; scratch, in the message of the commit that added this). AVX2 and portable: in one pass for up to
// 2 rows of x, in passes of two weight rows (the group's second pass from L1) up to 5, one at a time beyond, so
// the accumulators fit 16 registers.
template <int M>
void group_rows(const int8_t* xq, const int8_t* group, int64_t nb, int64_t k32, int32_t (*acc)[kLinearRows]) {
#if SPARSEDRAFT_VNNI
  if constexpr (M <= 2) {
    group_sums<M, 4>(xq, group, nb, k32, 0, true, acc);
  } else {
    vnni_sums<(M < 8 ? M : 8)>(xq, group, nb, k32, 0, true, acc);
    if constexpr (M > 8) vnni_sums<M - 8>(xq, group, nb, k32, 8, false, acc);
  }
#else
  if constexpr (M <= 2) {
    group_sums<M, 4>(xq, group, nb, k32, 0, true, acc);
  } else if constexpr (M <= 5) {
    group_sums<M, 2>(xq, group, nb, k32, 0, true, acc);
    group_sums<M, 2>(xq, group, nb, k32, 2, false, acc);
  } else {
    for (int j = 0; j < kGroup; ++j) group_sums<M, 1>(xq, group, nb, k32, j, j == 0, acc);
  }
#endif
}

using GroupFn = void (*)(const int8_t*, const int8_t*, int64_t, int64_t, int32_t (*)[kLinearRows]);

template <int... Ms>
GroupFn pick(int64_t m, std::integer_sequence<int, Ms...>) {
  GroupFn fn = nullptr;
  ((m == Ms + 1 ? (fn = &group_rows<Ms + 1>, 0) : 0), ...);
  return fn;
}

}  // namespace

bool rounded_rows_vnni() { return SPARSEDRAFT_VNNI; }

at::Tensor rounded_rows_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                               const at::Tensor& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kGroup &&
                  packed.size(3) == kBlock && packed.is_contiguous(),
              "rounded_rows_linear takes codes packed [N4 / 4, K32 / 32, 4, 32] (quant.pack_codes), got ",
              packed.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(),
              "rounded_rows_linear takes a float32 scale per output row");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rounded_rows_linear takes float32 or bfloat16 x");
  const int64_t k_len = x.size(-1), n_len = scale.size(0), nb = packed.size(1), k32 = nb * kBlock;
  const int64_t m_len = k_len == 0 ? 0 : x.numel() / k_len, n_groups = packed.size(0);
  TORCH_CHECK(m_len >= 1 && m_len <= kLinearRows, "rounded_rows_linear takes 1..", kLinearRows, " rows, got ", m_len);
  TORCH_CHECK(k32 >= k_len && k32 - k_len < kBlock && n_groups * kGroup >= n_len && n_groups * kGroup - n_len < kGroup,
              "rounded_rows_linear: x has ", k_len, " features and ", n_len, " scales, but the codes are packed for ",
              k32, " inputs and ", n_groups * kGroup, " rows");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu(),
              "rounded_rows_linear takes CPU tensors");
  // x and the output in x's own dtype, widened and rounded here: a bf16 step's 210 calls through torch's
  // conversions cost ~10 us each at 3 rows (scratch, in the message of the commit that added this).
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto xc = x.contiguous();
  // Kept per calling thread (round_row writes every code, the padding too): zero-filled per call, these three
  // put 2.9% of the calling thread's samples of a w8a8 level-2 step in memset (scratch, in the message of the
  // commit that kept them). The parallel region below reads them through xqp and xsp: a thread_local named inside it
  // would be the worker's own.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs, wide;
  xq.resize(std::max<size_t>(xq.size(), m_len * k32));
  xs.resize(std::max<size_t>(xs.size(), m_len));
  wide.resize(std::max<size_t>(wide.size(), k_len));
  const int8_t* xqp = xq.data();
  const float* xsp = xs.data();
  for (int64_t m = 0; m < m_len; ++m) {
    const float* row = nullptr;
    if (bf16) {
      const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) + m * k_len;
      for (int64_t k = 0; k < k_len; ++k) wide[k] = bf16_to_float(xb[k]);
      row = wide.data();
    } else {
      row = xc.data_ptr<float>() + m * k_len;
    }
    round_row(row, k_len, k32, xq.data() + m * k32, &xs[m]);
  }
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n_len;
  auto out = at::empty(out_sizes, x.options());
  const auto sums = bf16 ? at::empty({m_len, n_len}, x.options().dtype(at::kFloat)) : out;  // not zeroed
  float* yp = sums.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const bool biased = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.dim() == 1 && bias.size(0) == n_len), "bias must be [N]");
  const auto b = biased ? bias.to(at::kFloat).contiguous() : at::Tensor();  // after the sum, in float32, as
  const float* bp = biased ? b.data_ptr<float>() : nullptr;                 // quant.py's torch path adds it
  const float* sp = scale.data_ptr<float>();
  const int8_t* pp = packed.data_ptr<int8_t>();
  const GroupFn fn = pick(m_len, std::make_integer_sequence<int, kLinearRows>{});
  at::parallel_for(0, n_groups, 4, [&](int64_t g0, int64_t g1) {
    int32_t acc[kGroup][kLinearRows];  // one group's sums, written out before the next (no buffer per call)
    for (int64_t g = g0; g < g1; ++g) {
      fn(xqp, pp + g * nb * kGroup * kBlock, nb, k32, acc);
      for (int64_t j = 0; j < kGroup && g * kGroup + j < n_len; ++j) {
        const int64_t n = g * kGroup + j;
        for (int64_t m = 0; m < m_len; ++m) yp[m * n_len + n] = static_cast<float>(acc[j][m]) * (xsp[m] * sp[n]);
      }
    }
    finish_outputs(yp, m_len, n_len, g0 * kGroup, std::min(g1 * kGroup, n_len), bp, yb);
  });
  return out;
}
