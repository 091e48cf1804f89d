// Software prefetches that the compiler keeps where they are written.
//
// Why: GCC 12 at -O3 deleted the __builtin_prefetch loops inlined into the attention kernel's scoring and
// weighing (objdump of the build showed no prefetcht1 left in score_keys_fused or attend_chunk_by_keys), so
// the prefetches those loops were written with never ran. An asm volatile instruction cannot be dropped or
// moved by the optimiser; the portable fallback is the builtin.
#pragma once

// Ask for the cache line holding p into L2 (more misses in flight than L1's fill buffers allow).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}
