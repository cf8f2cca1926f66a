// ggml-zipmoe's test-only entry points: the test suite and the benchmarks call them, the runtime
// never does, and they may change without notice.

#pragma once

#include "ggml-zipmoe.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// test-only: force a recovery path (one of ggml_zipmoe_recover_paths(), or "cuda-grid": the CUDA
// kernel's index arithmetic run on the host; NULL = best available) for the
// whole process (tests and benchmarks compare the paths); returns GGML_ZIPMOE_ERR_ARG if the CPU
// lacks it. Must not race with recovery on another thread.
GGML_ZIPMOE_API int          ggml_zipmoe_set_recover_impl(const char * name);

// test-only: decodes a ghuf stream as the GPU does (zipmoe-cuda.cu), on the host: its decoding table
// built entry by entry and its segments decoded one by one, last first. OK or ERR_CORRUPT.
GGML_ZIPMOE_API int ggml_zipmoe_ghuf_decode_as_gpu(const void * src, size_t size, void * dst, size_t dst_size);

// test-only: the I/O thread sleeps this long before each SM-chunk read, for the whole process (0: not
// at all), so that decoding threads meet shards whose exponents are decoded before their SM-chunk
// is read (the paths that keep them aside: a slow disk's case)
GGML_ZIPMOE_API void ggml_zipmoe_set_sm_read_delay_us(unsigned us);

// test-only: the cache's page moves (a migration's stores handing pages to new slots), for the whole
// process: after `allowed` more moves, the next is refused as a kernel at its map count's limit
// refuses one: before the slots' block is touched, or with taken_down after the kernel has taken it
// down (the cache maps it again, empty). allowed < 0: none refused (the default)
GGML_ZIPMOE_API void ggml_zipmoe_set_page_move_refusal(int allowed, bool taken_down);

// test-only: begin (by thread 0) and end in one call, for callers without an op between them
GGML_ZIPMOE_API int ggml_zipmoe_cache_fetch(struct ggml_zipmoe_cache * cache, int layer, int pass,
                                            const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                                            int32_t * slot_ids, int ith, int nth);

#ifdef __cplusplus
}
#endif
