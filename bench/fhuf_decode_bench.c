// fhuf's decoder alone: ns per exponent symbol on one core, on the exponent planes of
// Gaussian (sigma 0.02) BF16 experts of the full Qwen / DeepSeek geometry (2048 x 1408), each cut
// into 5 equal shards (the converter's K; its split also spreads n mod 5, 4 symbols left out here),
// decoded into NEXP distinct experts' slots as the runtime does
// (the upper half of each shard's own bytes). Best of 7 passes; checks the first expert's bytes.
//
//   S=ggml-zipmoe/src
//   cc -O3 -DNDEBUG -std=gnu11 -I$S -o /tmp/fhuf_decode_bench bench/fhuf_decode_bench.c
//      $S/codec/zipmoe-fhuf.c $S/codec/zipmoe-fhuf-encode.c -lm   (one line)
//   taskset -c 1 /tmp/fhuf_decode_bench 16
//
// The library's flags (-O3, no -march); add e.g. -DFH_GROUP=5 for the kernel's compile-time variants
// (zipmoe-fhuf-impl.h). Times vary by up to 2x on a shared VM: run variants in turn, several times.
#include "codec/zipmoe-fhuf.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double) t.tv_sec + (double) t.tv_nsec * 1e-9;
}

static uint64_t rng_state = 88172645463325252ull;

static double uniform01(void) { // xorshift64
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return ((double) (rng_state >> 11) + 0.5) / 9007199254740992.0;
}

static double gaussian(void) { // Box-Muller
    const double u = uniform01(), v = uniform01();
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

int main(int argc, char ** argv) {
    const size_t n = 2048 * 1408, shards = 5;
    const int    n_exp = argc > 1 ? atoi(argv[1]) : 16;
    if (argc > 2 || n_exp < 1) {
        fprintf(stderr, "usage: %s [NEXP (experts' slots written, default 16)]\n", argv[0]);
        return 2;
    }
    uint8_t * plane = malloc(n);
    for (size_t i = 0; i < n; i++) {
        const float f = (float) (gaussian() * 0.02);
        uint32_t    b;
        memcpy(&b, &f, 4);
        plane[i] = (uint8_t) (b >> 23); // the BF16 exponent byte
    }
    const size_t cnt = n / shards, cap = zipmoe_fhuf_compress_bound(cnt);
    uint8_t *    comp = malloc(cap * shards);
    size_t       csz[5], total = 0;
    for (size_t k = 0; k < shards; k++) {
        const int64_t r = zipmoe_fhuf_compress(plane + k * cnt, cnt, comp + k * cap, cap);
        if (r < 0) {
            fprintf(stderr, "compression failed: %lld\n", (long long) r);
            return 1;
        }
        csz[k] = (size_t) r;
        total += csz[k];
    }
    uint8_t * slots = aligned_alloc(4096, (size_t) n_exp * n * 2);
    memset(slots, 1, (size_t) n_exp * n * 2);
    struct zipmoe_fhuf_decoder * dec  = zipmoe_fhuf_decoder_new();
    double                       best = 1e30;
    for (int pass = 0; pass < 7; pass++) {
        const double t = now();
        for (int e = 0; e < n_exp; e++) {
            for (size_t k = 0; k < shards; k++) {
                uint8_t * dst = slots + (size_t) e * n * 2 + k * cnt * 2 + cnt;
                if (zipmoe_fhuf_decompress(dec, comp + k * cap, csz[k], dst, cnt) != 0) {
                    fprintf(stderr, "decoding failed: shard %zu\n", k);
                    return 1;
                }
            }
        }
        best = fmin(best, now() - t);
    }
    for (size_t k = 0; k < shards; k++) {
        if (memcmp(slots + k * cnt * 2 + cnt, plane + k * cnt, cnt) != 0) {
            fprintf(stderr, "shard %zu decoded wrong\n", k);
            return 1;
        }
    }
    const double syms = (double) n_exp * (double) (cnt * shards);
    printf("%.3f bits/symbol, %.3f ns/symbol (%.2f Gsymbols/s)\n", 8.0 * (double) total / (double) (cnt * shards),
           best / syms * 1e9, syms / best / 1e9);
    zipmoe_fhuf_decoder_free(dec);
    free(slots);
    free(comp);
    free(plane);
    return 0;
}
