// ggml-zipmoe: lossless on-demand expert serving for BF16 Mixture-of-Experts models.
//
// This is the one public header of ZipMoE's C library. llama.cpp (through our patch
// series) and the Python bindings (zipmoe_py/_lib.py, one ctypes declaration per
// function here) use nothing else. All functions are thread-safe; the library keeps
// no global mutable state.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && !defined(__MINGW32__)
#    ifdef GGML_ZIPMOE_BUILD
#        define GGML_ZIPMOE_API __declspec(dllexport)
#    else
#        define GGML_ZIPMOE_API __declspec(dllimport)
#    endif
#else
#    define GGML_ZIPMOE_API __attribute__((visibility("default")))
#endif

#define GGML_ZIPMOE_VERSION_MAJOR 0
#define GGML_ZIPMOE_VERSION_MINOR 1
#define GGML_ZIPMOE_VERSION_PATCH 0

// library version as "MAJOR.MINOR.PATCH" (static storage, never freed)
GGML_ZIPMOE_API const char * ggml_zipmoe_version(void);

// library version as MAJOR*10000 + MINOR*100 + PATCH, for compile/run-time checks
GGML_ZIPMOE_API int          ggml_zipmoe_version_number(void);

// short, human-readable build description: version, compiler, SIMD paths compiled in
GGML_ZIPMOE_API const char * ggml_zipmoe_build_info(void);

//
// status codes: every fallible function returns one (0 = success, negative = failure)
//

enum ggml_zipmoe_status {
    GGML_ZIPMOE_OK            =  0,
    GGML_ZIPMOE_ERR_ARG       = -1, // invalid argument (null pointer, unknown codec, bad level)
    GGML_ZIPMOE_ERR_NOMEM     = -2, // allocation failed
    GGML_ZIPMOE_ERR_CAPACITY  = -3, // output buffer too small
    GGML_ZIPMOE_ERR_CORRUPT   = -4, // compressed data is malformed or decodes to the wrong size
};

// short English description of a status code (static storage)
GGML_ZIPMOE_API const char * ggml_zipmoe_status_string(int status);

//
// BF16 split and recovery
//
// A BF16 value s|eeeeeeee|mmmmmmm is stored as two bytes in two planes:
//   exponent plane (E):        eeeeeeee            (low entropy: compressed)
//   sign+mantissa plane (SM):  s|mmmmmmm           (near 8 bits of entropy: stored raw)
// Recovery is bit-exact for every 16-bit pattern (zeros, infinities, NaN payloads, subnormals).
//

// split n BF16 values into n exponent bytes and n sign+mantissa bytes
GGML_ZIPMOE_API void ggml_zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);

// recover n BF16 values from their planes (SIMD path chosen once at run time)
GGML_ZIPMOE_API void ggml_zipmoe_recover_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);

// the recovery path in use: "avx512bw", "avx2" or "scalar"
GGML_ZIPMOE_API const char * ggml_zipmoe_recover_impl(void);

// force a recovery path ("avx512bw", "avx2", "scalar"; NULL = best available), for tests and
// benchmarks; returns GGML_ZIPMOE_ERR_ARG if the CPU lacks it. Not meant to race with recovery.
GGML_ZIPMOE_API int          ggml_zipmoe_set_recover_impl(const char * name);

//
// exponent-plane codecs
//

enum ggml_zipmoe_codec {
    GGML_ZIPMOE_CODEC_RAW   = 0, // stored as is
    GGML_ZIPMOE_CODEC_ZSTD  = 1, // zstd frame, level 1..22 (negative levels: fast modes)
    GGML_ZIPMOE_CODEC_LZ4   = 2, // lz4 block; level is the acceleration (1 = default)
    GGML_ZIPMOE_CODEC_LZ4HC = 3, // lz4hc block, level 1..12
    GGML_ZIPMOE_CODEC_HUF   = 4, // order-0 Huffman (zstd's huff0, 4 streams) in 128 KiB blocks; level ignored
    GGML_ZIPMOE_CODEC_COUNT,
};

// codec name ("raw", "zstd", "lz4", "lz4hc", "huf"), or NULL for an unknown codec
GGML_ZIPMOE_API const char * ggml_zipmoe_codec_name(int codec);

// worst-case compressed size of n input bytes (0 for an unknown codec)
GGML_ZIPMOE_API size_t       ggml_zipmoe_compress_bound(int codec, size_t n);

// compress n bytes of src into dst (capacity dst_capacity); returns the compressed size (> 0
// unless n == 0) or a negative status. Allocates per call: meant for conversion, not serving.
GGML_ZIPMOE_API int64_t      ggml_zipmoe_compress(int codec, int level, const void * src, size_t n,
                                                  void * dst, size_t dst_capacity);

// decoder context: holds the codecs' decompression state; make one per thread and reuse it
// (decompression then allocates nothing)
struct ggml_zipmoe_decoder;

GGML_ZIPMOE_API struct ggml_zipmoe_decoder * ggml_zipmoe_decoder_new(void);
GGML_ZIPMOE_API void                         ggml_zipmoe_decoder_free(struct ggml_zipmoe_decoder * dec);

// decompress src (n bytes) into exactly dst_size bytes of dst; anything else is GGML_ZIPMOE_ERR_CORRUPT
GGML_ZIPMOE_API int ggml_zipmoe_decompress(struct ggml_zipmoe_decoder * dec, int codec,
                                           const void * src, size_t n, void * dst, size_t dst_size);

// checksum of a stored chunk, as recorded in a ZipMoE GGUF: XXH64 with seed 0
GGML_ZIPMOE_API uint64_t ggml_zipmoe_checksum(const void * data, size_t n);

#ifdef __cplusplus
}
#endif
