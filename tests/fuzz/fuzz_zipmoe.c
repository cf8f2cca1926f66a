// Fuzz harness for ggml-zipmoe's untrusted-input paths: the ZipMoE GGUF parser (and, on a file it
// accepts, every chunk read and expert decode) and each exponent-plane decoder.
//
// The input's first byte picks the target: even: the file parser, the rest of the input being the
// file; odd: a decoder, codec = (byte >> 1) % GGML_ZIPMOE_CODEC_COUNT, the next 3 bytes the decoded
// size (at most 16 MiB), the rest the stored bytes.
//
// Built with clang -fsanitize=fuzzer it is a libFuzzer target (LLVMFuzzerTestOneInput). Built without
// (gcc, this project's CI), main() below is a small deterministic mutational driver:
//   fuzz_zipmoe CORPUS_DIR SECONDS SEED [CRASH_DIR]
// It runs every corpus file, then mutates them (bit flips, byte sets, interesting values,
// truncation, duplication, splicing) until SECONDS have passed. Each input is written to
// CRASH_DIR/current before it runs, so an input that crashes the process (a sanitizer report) is
// left there; it prints the number of runs at the end. The seed corpus is tests/fuzz/make_corpus.py's.

#define _GNU_SOURCE
#include "ggml-zipmoe.h"

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static void fuzz_file(const uint8_t * data, size_t size) {
    const int fd = memfd_create("zipmoe-fuzz", 0);
    if (fd < 0) {
        return;
    }
    size_t done = 0;
    while (done < size) {
        const ssize_t w = write(fd, data + done, size - done);
        if (w <= 0) {
            break;
        }
        done += (size_t) w;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    char err[512];
    struct ggml_zipmoe_file * f = ggml_zipmoe_file_open(path, 0, err, sizeof(err));
    if (f != NULL) {
        struct ggml_zipmoe_reader * r = ggml_zipmoe_reader_new(f);
        const size_t cap = ggml_zipmoe_file_chunk_buffer_size(f);
        uint8_t * buf = cap <= (64u << 20) ? (uint8_t *) malloc(cap) : NULL;
        for (int t = 0; t < ggml_zipmoe_file_n_tensors(f); t++) {
            int64_t ne[3];
            ggml_zipmoe_file_tensor_shape(f, t, ne);
            const uint64_t n = (uint64_t) ne[0] * (uint64_t) ne[1];
            for (int64_t e = 0; e < ne[2] && e < 8; e++) {
                for (int c = 0; buf != NULL && c <= ggml_zipmoe_file_n_shards(f); c++) {
                    ggml_zipmoe_file_read_chunk(f, t, (int) e, c, buf, cap);
                }
                if (r != NULL && n <= (1u << 20)) {
                    uint16_t * dst = (uint16_t *) malloc(n * sizeof(uint16_t) + 1);
                    ggml_zipmoe_read_expert(r, t, (int) e, dst);
                    free(dst);
                }
            }
        }
        free(buf);
        ggml_zipmoe_reader_free(r);
        ggml_zipmoe_file_close(f);
    }
    close(fd);
}

static struct ggml_zipmoe_decoder * decoder;

static void fuzz_decoder(const uint8_t * data, size_t size) {
    if (size < 4) {
        return;
    }
    const int codec = (data[0] >> 1) % GGML_ZIPMOE_CODEC_COUNT;
    const size_t out = ((size_t) data[1] | (size_t) data[2] << 8 | (size_t) data[3] << 16) & ((1u << 24) - 1);
    uint8_t * dst = (uint8_t *) malloc(out + 1);
    if (decoder == NULL) {
        decoder = ggml_zipmoe_decoder_new();
    }
    if (dst != NULL && decoder != NULL) {
        ggml_zipmoe_decompress(decoder, codec, data + 4, size - 4, dst, out);
    }
    free(dst);
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) {
        return 0;
    }
    if (data[0] % 2 == 0) {
        fuzz_file(data + 1, size - 1);
    } else {
        fuzz_decoder(data, size);
    }
    return 0;
}

#ifndef ZIPMOE_LIBFUZZER
// --- a deterministic mutational driver, for builds without libFuzzer ---

struct input {
    uint8_t * data;
    size_t    size;
};

static uint64_t rng_state;

static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void run_saved(const char * crash_dir, const uint8_t * data, size_t size) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/current", crash_dir);
    FILE * f = fopen(path, "wb");
    if (f != NULL) {
        fwrite(data, 1, size, f);
        fclose(f);
    }
    LLVMFuzzerTestOneInput(data, size);
}

static void mutate(struct input * in, const struct input * corpus, size_t n_corpus) {
    static const uint8_t interesting[] = { 0x00, 0x01, 0x7f, 0x80, 0xff, 0x10, 0x20, 0x40 };
    const int n_mut = 1 + (int) (rnd() % 4);
    for (int m = 0; m < n_mut; m++) {
        const size_t pos = in->size > 1 ? 1 + rnd() % (in->size - 1) : 0; // keep the target byte
        switch (rnd() % 7) {
            case 0: if (in->size > 1) in->data[pos] ^= (uint8_t) (1u << (rnd() % 8)); break;
            case 1: if (in->size > 1) in->data[pos] = (uint8_t) rnd(); break;
            case 2: if (in->size > 1) in->data[pos] = interesting[rnd() % sizeof(interesting)]; break;
            case 3: if (in->size > 1) in->size = pos + rnd() % (in->size - pos); break;    // truncate
            case 4: {                                                                         // 8 bytes at once
                for (size_t i = 0; i < 8 && pos + i < in->size; i++) in->data[pos + i] = (uint8_t) (rnd() >> 3);
                break;
            }
            case 5: {                                                                         // splice another input
                const struct input * o = &corpus[rnd() % n_corpus];
                if (o->size > 1 && in->size > 1) {
                    const size_t from = 1 + rnd() % (o->size - 1);
                    const size_t len = rnd() % (o->size - from + 1);
                    for (size_t i = 0; i < len && pos + i < in->size; i++) in->data[pos + i] = o->data[from + i];
                }
                break;
            }
            default: {                                                                        // a length field
                if (pos + 8 <= in->size) {
                    uint64_t v = rnd() % 3 == 0 ? UINT64_MAX - rnd() % 4096 : rnd() % 1000000;
                    memcpy(in->data + pos, &v, 8);
                }
                break;
            }
        }
    }
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s CORPUS_DIR SECONDS SEED [CRASH_DIR]\n", argv[0]);
        return 2;
    }
    const double seconds = atof(argv[2]);
    rng_state = strtoull(argv[3], NULL, 10) | 1;
    const char * crash_dir = argc > 4 ? argv[4] : ".";
    struct input corpus[256];
    size_t n_corpus = 0;
    DIR * d = opendir(argv[1]);
    if (d == NULL) {
        fprintf(stderr, "fuzz_zipmoe: cannot open corpus %s\n", argv[1]);
        return 2;
    }
    for (struct dirent * e; (e = readdir(d)) != NULL && n_corpus < 256;) {
        if (e->d_name[0] == '.') {
            continue;
        }
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", argv[1], e->d_name);
        FILE * f = fopen(path, "rb");
        if (f == NULL) {
            continue;
        }
        fseek(f, 0, SEEK_END);
        const long size = ftell(f);
        fseek(f, 0, SEEK_SET);
        corpus[n_corpus].data = (uint8_t *) malloc((size_t) size + 1);
        corpus[n_corpus].size = fread(corpus[n_corpus].data, 1, (size_t) size, f);
        fclose(f);
        n_corpus++;
    }
    closedir(d);
    if (n_corpus == 0) {
        fprintf(stderr, "fuzz_zipmoe: empty corpus %s\n", argv[1]);
        return 2;
    }
    unsigned long runs = 0;
    for (size_t i = 0; i < n_corpus; i++, runs++) {
        run_saved(crash_dir, corpus[i].data, corpus[i].size);
    }
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t cap = 0;
    uint8_t * buf = NULL;
    for (;; runs++) {
        if (runs % 16 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double) (t.tv_sec - t0.tv_sec) + 1e-9 * (double) (t.tv_nsec - t0.tv_nsec) >= seconds) {
                break;
            }
        }
        const struct input * base = &corpus[rnd() % n_corpus];
        if (base->size > cap) {
            cap = base->size;
            buf = (uint8_t *) realloc(buf, cap);
        }
        memcpy(buf, base->data, base->size);
        struct input in = { buf, base->size };
        mutate(&in, corpus, n_corpus);
        run_saved(crash_dir, in.data, in.size);
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/current", crash_dir);
    remove(path); // no crash: nothing to keep
    printf("fuzz_zipmoe: %lu runs in %.0f s, %zu corpus inputs, no crash\n", runs, seconds, n_corpus);
    ggml_zipmoe_decoder_free(decoder);
    free(buf);
    for (size_t i = 0; i < n_corpus; i++) {
        free(corpus[i].data);
    }
    return 0;
}
#endif
