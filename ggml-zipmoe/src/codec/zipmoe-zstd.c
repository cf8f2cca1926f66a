// The zstd amalgamation, compiled into ggml-zipmoe once, here.
//
// huff0 (zstd's order-0 Huffman coder) is not part of zstd's public API, so the single-file
// zstd.c is compiled in this translation unit and thin wrappers expose what zipmoe-huf.c
// needs. With hidden visibility, none of zstd's symbols leave the library (no clash with
// another zstd in the process). Warnings are off for this file only: it is third-party code.

#define _GNU_SOURCE // qsort_r in zstd's dictionary builder
#define ZSTDLIB_VISIBLE
#define ZSTDERRORLIB_VISIBLE
#define ZDICTLIB_VISIBLE
#include "zstd.c"

#include "common/zipmoe-impl.h"

#include <stdlib.h>

struct huff0_state {
    HUF_DTable dtable[HUF_DTABLE_SIZE(HUF_TABLELOG_MAX)];
    U32        workspace[HUF_DECOMPRESS_WORKSPACE_SIZE_U32];
    int        flags;
};

size_t zipmoe_huff0_compress(void * dst, size_t dst_capacity, const void * src, size_t n) {
    U64 workspace[HUF_WORKSPACE_SIZE_U64];
    const size_t r = HUF_compress4X_repeat(dst, dst_capacity, src, n, HUF_SYMBOLVALUE_MAX, HUF_TABLELOG_DEFAULT,
                                           workspace, sizeof(workspace), NULL, NULL, 0);
    return HUF_isError(r) ? 0 : r; // an error here means "does not fit": the caller stores raw
}

void * zipmoe_huff0_state_new(void) {
    struct huff0_state * st = (struct huff0_state *) calloc(1, sizeof(*st));
    if (st != NULL) {
        st->dtable[0] = (U32) HUF_TABLELOG_MAX * 0x01000001; // table capacity, as HUF_CREATE_STATIC_DTABLEX2
#if defined(__x86_64__)
        st->flags = __builtin_cpu_supports("bmi2") ? HUF_flags_bmi2 : 0;
#endif
    }
    return st;
}

void zipmoe_huff0_state_free(void * state) {
    free(state);
}

int zipmoe_huff0_decompress(void * state, void * dst, size_t dst_size, const void * src, size_t n) {
    struct huff0_state * st = (struct huff0_state *) state;
    const size_t r = HUF_decompress4X_hufOnly_wksp(st->dtable, dst, dst_size, src, n, st->workspace,
                                                   sizeof(st->workspace), st->flags);
    return !HUF_isError(r) && r == dst_size ? 0 : -1;
}

uint64_t zipmoe_xxh64(const void * data, size_t n) {
    return XXH64(data, n, 0);
}
