// BF16 <-> (exponent plane, sign+mantissa plane), with SIMD recovery chosen at run time.
//
// BF16 bits: s eeeeeeee mmmmmmm. E byte = bits 14..7; SM byte = (s << 7) | mmmmmmm.

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-test.h"
#include "codec/zipmoe-recover-grid.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define ZIPMOE_X86 1
#elif defined(__aarch64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#    include <arm_neon.h>
#    include <asm/hwcap.h>
#    include <sys/auxv.h>
#    define ZIPMOE_ARM64 1
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

#ifdef ZIPMOE_ARM64
// Byte-wise, no widening: BF16's low byte is (e << 7) | (s & 0x7F), its high byte (s & 0x80) | (e >> 1);
// one interleaving store (ST2) writes both as little-endian 16-bit values.
static void recover_neon(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    const uint8x16_t sign_mask = vdupq_n_u8(0x80);
    const uint8x16_t mant_mask = vdupq_n_u8(0x7F);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const uint8x16_t e = vld1q_u8(exp + i);
        const uint8x16_t s = vld1q_u8(sm + i);
        uint8x16x2_t     v;
        v.val[0] = vbslq_u8(mant_mask, s, vshlq_n_u8(e, 7));
        v.val[1] = vbslq_u8(sign_mask, s, vshrq_n_u8(e, 1));
        vst2q_u8((uint8_t *) (dst + i), v);
    }
    recover_scalar(exp + i, sm + i, n - i, dst + i);
}

// GCC 10+ compiles SVE for these two functions only, so the library stays runnable on NEON-only
// cores (a "#pragma GCC target" region instead leaked SVE into functions after it); other compilers
// get it when the whole build targets SVE
#    if defined(__ARM_FEATURE_SVE) || (!defined(__clang__) && __GNUC__ >= 10)
#        define ZIPMOE_SVE 1
#        include <arm_sve.h>
#        define ZIPMOE_SVE_FN __attribute__((target("+sve")))
// the same byte-wise recovery, predicated, so the tail needs no scalar loop
ZIPMOE_SVE_FN static void recover_sve(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    const size_t step = svcntb();
    for (size_t i = 0; i < n; i += step) {
        const svbool_t    pg = svwhilelt_b8_u64(i, n);
        const svuint8_t   e  = svld1_u8(pg, exp + i);
        const svuint8_t   s  = svld1_u8(pg, sm + i);
        const svuint8_t   lo = svorr_u8_x(pg, svand_n_u8_x(pg, s, 0x7F), svlsl_n_u8_x(pg, e, 7));
        const svuint8_t   hi = svorr_u8_x(pg, svand_n_u8_x(pg, s, 0x80), svlsr_n_u8_x(pg, e, 1));
        svst2_u8(pg, (uint8_t *) (dst + i), svcreate2_u8(lo, hi));
    }
}

// noipa: never inlined, so the compiler cannot hoist CNTB above has_wide_sve's HWCAP test (it did:
// SIGILL on cores without SVE)
ZIPMOE_SVE_FN __attribute__((noipa)) static size_t sve_vector_bytes(void) {
    return svcntb();
}
#    endif
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
#ifdef ZIPMOE_ARM64
static int has_neon(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }
#    ifdef ZIPMOE_SVE
// only where SVE's vectors are wider than NEON's 16 bytes: at 16 bytes NEON's interleave does the
// same work in fewer instructions, so a 128-bit SVE core gets (and can only be given) NEON
static int has_wide_sve(void) { return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0 && sve_vector_bytes() > 16; }
#    endif
#endif

// best first
static const struct recover_impl recover_impls[] = {
#ifdef ZIPMOE_X86
    { "avx512bw", recover_avx512bw, has_avx512bw },
    { "avx2",     recover_avx2,     has_avx2     },
#endif
#ifdef ZIPMOE_SVE
    { "sve",      recover_sve,      has_wide_sve },
#endif
#ifdef ZIPMOE_ARM64
    { "neon",     recover_neon,     has_neon     },
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

static char           recover_path_names[64];
static pthread_once_t recover_path_names_once = PTHREAD_ONCE_INIT;

static void join_recover_path_names(void) {
    size_t len = 0;
    for (size_t i = 0; i + 1 < N_RECOVER_IMPLS; i++) { // not cuda-grid, a test path
        len += (size_t) snprintf(recover_path_names + len, sizeof(recover_path_names) - len, "%s%s",
                                 i ? " " : "", recover_impls[i].name);
    }
}

const char * ggml_zipmoe_recover_paths(void) {
    pthread_once(&recover_path_names_once, join_recover_path_names);
    return recover_path_names;
}

// the build info (ggml-zipmoe.h) names the recovery paths compiled in, so it is made here, above common/'s
// version
#if defined(__clang__)
#    define ZIPMOE_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#    define ZIPMOE_COMPILER "gcc " __VERSION__
#else
#    define ZIPMOE_COMPILER "unknown compiler"
#endif

static char           build_info[256];
static pthread_once_t build_info_once = PTHREAD_ONCE_INIT;

static void format_build_info(void) {
    snprintf(build_info, sizeof(build_info), "ggml-zipmoe %s (%s; recovery: %s)", ggml_zipmoe_version(),
             ZIPMOE_COMPILER, ggml_zipmoe_recover_paths());
}

const char * ggml_zipmoe_build_info(void) {
    pthread_once(&build_info_once, format_build_info);
    return build_info;
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
