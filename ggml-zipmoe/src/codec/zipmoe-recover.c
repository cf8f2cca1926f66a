// BF16 <-> (exponent plane, sign+mantissa plane), with SIMD recovery chosen at run time.
//
// BF16 bits: s eeeeeeee mmmmmmm. E byte = bits 14..7; SM byte = (s << 7) | mmmmmmm.

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-test.h"
#include "codec/zipmoe-recover-grid.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define ZIPMOE_X86 1
#endif

void ggml_zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm) {
    // plain loop: compilers vectorize it, and splitting runs only at conversion time
    for (size_t i = 0; i < n; i++) {
        const uint16_t v = src[i];
        exp[i] = (uint8_t) (v >> 7);
        sm[i]  = (uint8_t) (((v >> 8) & 0x80) | (v & 0x7F));
    }
}

static inline uint16_t recover_one(uint8_t e, uint8_t s) {
    return (uint16_t) (((uint16_t) (s & 0x80) << 8) | ((uint16_t) e << 7) | (s & 0x7F));
}

static void recover_scalar(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    for (size_t i = 0; i < n; i++) {
        dst[i] = recover_one(exp[i], sm[i]);
    }
}

#ifdef ZIPMOE_X86
__attribute__((target("avx2")))
static void recover_avx2(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    const __m256i sign_mask = _mm256_set1_epi16(0x80);
    const __m256i mant_mask = _mm256_set1_epi16(0x7F);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i e = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) (exp + i)));
        const __m256i s = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) (sm + i)));
        const __m256i v = _mm256_or_si256(
            _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(s, sign_mask), 8), _mm256_slli_epi16(e, 7)),
            _mm256_and_si256(s, mant_mask));
        _mm256_storeu_si256((__m256i *) (dst + i), v);
    }
    recover_scalar(exp + i, sm + i, n - i, dst + i);
}

__attribute__((target("avx512f,avx512bw")))
static void recover_avx512bw(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    const __m512i sign_mask = _mm512_set1_epi16(0x80);
    const __m512i mant_mask = _mm512_set1_epi16(0x7F);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512i e = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) (exp + i)));
        const __m512i s = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) (sm + i)));
        // (s & 0x80) << 8 | e << 7 | (s & 0x7F): one ternary-logic op merges the two masked terms
        const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(s, sign_mask), 8);
        const __m512i v  = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(e, 7), _mm512_and_si512(s, mant_mask), 0xFE);
        _mm512_storeu_si512((void *) (dst + i), v);
    }
    recover_scalar(exp + i, sm + i, n - i, dst + i);
}
#endif

// the CUDA kernel's arithmetic run on the host, thread by thread of its grid: never chosen by
// default, it lets the tests check the kernel's indexing against every bit pattern without a GPU
static void recover_cuda_grid(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    const uint64_t n_threads = zipmoe_grid_blocks(n) * ZIPMOE_GRID_BLOCK;
    for (uint64_t i = 0; i < n_threads; i++) {
        zipmoe_grid_thread(i, exp, sm, n, dst);
    }
}

typedef void (*recover_fn)(const uint8_t *, const uint8_t *, size_t, uint16_t *);

struct recover_impl {
    const char * name;
    recover_fn   fn;
    int        (*supported)(void);
};

static int always(void) { return 1; }
#ifdef ZIPMOE_X86
static int has_avx2(void)     { return __builtin_cpu_supports("avx2"); }
static int has_avx512bw(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
#endif

// best first
static const struct recover_impl recover_impls[] = {
#ifdef ZIPMOE_X86
    { "avx512bw", recover_avx512bw, has_avx512bw },
    { "avx2",     recover_avx2,     has_avx2     },
#endif
    { "scalar",   recover_scalar,   always       },
    { "cuda-grid", recover_cuda_grid, always     }, // last: only when asked for
};
#define N_RECOVER_IMPLS (sizeof(recover_impls) / sizeof(recover_impls[0]))

// chosen once; a pointer-sized store, so concurrent first calls agree on the value
static const struct recover_impl * volatile recover_chosen = NULL;

static const struct recover_impl * best_recover_impl(void) {
    for (size_t i = 0; i < N_RECOVER_IMPLS; i++) {
        if (recover_impls[i].supported()) {
            return &recover_impls[i];
        }
    }
    return &recover_impls[N_RECOVER_IMPLS - 2]; // scalar
}

static const struct recover_impl * current_recover_impl(void) {
    const struct recover_impl * impl = recover_chosen;
    if (impl == NULL) {
        impl = best_recover_impl();
        recover_chosen = impl;
    }
    return impl;
}

void ggml_zipmoe_recover_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    current_recover_impl()->fn(exp, sm, n, dst);
}

const char * ggml_zipmoe_recover_impl(void) {
    return current_recover_impl()->name;
}

int ggml_zipmoe_set_recover_impl(const char * name) {
    if (name == NULL) {
        recover_chosen = best_recover_impl();
        return GGML_ZIPMOE_OK;
    }
    for (size_t i = 0; i < N_RECOVER_IMPLS; i++) {
        if (strcmp(recover_impls[i].name, name) == 0) {
            if (!recover_impls[i].supported()) {
                return GGML_ZIPMOE_ERR_ARG;
            }
            recover_chosen = &recover_impls[i];
            return GGML_ZIPMOE_OK;
        }
    }
    return GGML_ZIPMOE_ERR_ARG;
}
