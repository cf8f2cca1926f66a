// BF16 recovery laid out as the CUDA kernel runs it (zipmoe-cuda.cu): one source for the device
// and for the host's "cuda-grid" recovery (zipmoe-recover.c), so that the kernel's index
// arithmetic is tested on the CPU against every bit pattern and odd lengths.
//
// Thread i of the grid (block b, lane l: i = b * ZIPMOE_GRID_BLOCK + l) recovers the values
// [i * ZIPMOE_GRID_VALUES, min(n, (i + 1) * ZIPMOE_GRID_VALUES)): consecutive threads take
// consecutive runs, so a warp's loads and stores are contiguous.

#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#    define ZIPMOE_HD static inline __host__ __device__
#else
#    define ZIPMOE_HD static inline
#endif

#define ZIPMOE_GRID_BLOCK  256 // threads per block
#define ZIPMOE_GRID_VALUES 8   // values per thread

// BF16 bits s eeeeeeee mmmmmmm from the exponent byte and the sign+mantissa byte (s << 7 | m)
ZIPMOE_HD uint16_t zipmoe_grid_bf16(uint8_t e, uint8_t sm) {
    return (uint16_t) (((uint16_t) (sm & 0x80) << 8) | ((uint16_t) e << 7) | (sm & 0x7F));
}

// blocks of the grid that recovers n values
ZIPMOE_HD uint64_t zipmoe_grid_blocks(uint64_t n) {
    const uint64_t per_block = (uint64_t) ZIPMOE_GRID_BLOCK * ZIPMOE_GRID_VALUES;
    return (n + per_block - 1) / per_block;
}

// the work of grid thread i
ZIPMOE_HD void zipmoe_grid_thread(uint64_t i, const uint8_t * exp, const uint8_t * sm, uint64_t n, uint16_t * dst) {
    const uint64_t first = i * ZIPMOE_GRID_VALUES;
    const uint64_t last  = first + ZIPMOE_GRID_VALUES < n ? first + ZIPMOE_GRID_VALUES : n;
    for (uint64_t v = first; v < last; v++) {
        dst[v] = zipmoe_grid_bf16(exp[v], sm[v]);
    }
}
