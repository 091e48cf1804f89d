// AMX tiles, shared by the attention and the few-row linear: whether the build has them, the OS's grant,
// the one tile layout both use, and the switch that turns them off (benches' A/B, tests).
//
// Built where the compiler targets AMX-BF16 (-march=native on such a CPU); used once Linux grants the
// process the tile state. A tile product adds each (row, column)'s products in one fixed order whatever
// else the tiles hold, so rows padded with zeros or computed beside others keep their bits: the
// exactness contract (a row's result independent of the step's length) holds on tiles as elsewhere.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define SPARSEDRAFT_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SPARSEDRAFT_TILES 0
#endif

inline std::atomic<bool> tiles_allowed{true};  // allow_tiles(false): the same build's vector code instead

#if SPARSEDRAFT_TILES
inline bool tiles_granted() {  // Linux hands out AMX's 8 KB of tile state only on request, once per process
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {  // every tile 16 rows of 64 bytes; per thread, and oneDNN may have set its own
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

inline bool tiles_on() { return tiles_allowed.load(std::memory_order_relaxed) && tiles_granted(); }
#endif

// out[b][c][p][r][e] = x[16 b + r][32 c + 2 p + e]: rows [rows][K] of bf16 (K a multiple of 32) as the tile
// unit's second operand, one 16 x 32 block after another, rows from ``rows`` to ``padded`` (a multiple of 16)
// zero. The attention packs its query rows this way (on tiles and on AVX512-BF16 dot products), the linear its
// input rows.
inline void pack_operand(const uint16_t* x, int64_t rows, int64_t padded, int64_t K, uint16_t* out) {
  std::fill(out, out + padded * K, uint16_t{0});
  const int64_t blocks = K / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      out[(((r / 16) * blocks + k / 32) * 16 + k % 32 / 2) * 32 + r % 16 * 2 + k % 2] = x[r * K + k];
}
