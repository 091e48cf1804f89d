// Software prefetches that the compiler keeps where they are written.
//
// Why: GCC 12 at -O3 deleted the __builtin_prefetch loops inlined into the attention kernel's scoring and
// weighing (objdump of the build showed no prefetcht1 left in score_keys_fused or attend_chunk_by_keys), and
// the AVX-512 build's few-row linear prefetches too (no prefetcht0 in the module; the AVX2 build kept the
// linear kernel's prefetchnta). An asm volatile instruction cannot be dropped or moved by the optimiser;
// the portable fallback is the builtin.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#define SPARSEDRAFT_PREFETCH(insn, p, locality) asm volatile(insn " %0" : : "m"(*(p)))
#else
#define SPARSEDRAFT_PREFETCH(insn, p, locality) __builtin_prefetch((p), 0, (locality))
#endif

// How far ahead of the weight rows in use the few-row linear kernels ask for more (few_rows_linear.cpp,
// rounded_rows_linear.cpp): the hardware prefetcher cannot lock onto rows as short as a small model's.
constexpr int64_t kWeightsAheadBytes = 4096;

// Ask for the cache line holding p into L2 (more misses in flight than L1's fill buffers allow).
inline void prefetch_l2(const char* p) { SPARSEDRAFT_PREFETCH("prefetcht1", p, 2); }
