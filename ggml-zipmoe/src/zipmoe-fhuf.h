// zipmoe-fhuf: fast order-0 entropy coder for low-entropy byte planes (BF16 exponent bytes).
//
// Length-limited canonical Huffman, several independent bitstreams per buffer, decoded with a
// multi-symbol lookup table (one table load yields up to 6 symbols). Self-describing stream:
// the decoded size is stored and checked. Thread-safe: no global mutable state.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZIPMOE_FHUF_ERR_ARG      (-1) // invalid argument (NULL pointer with n > 0)
#define ZIPMOE_FHUF_ERR_CAPACITY (-3) // dst_capacity too small
#define ZIPMOE_FHUF_ERR_CORRUPT  (-4) // malformed stream or wrong decoded size

// worst-case compressed size of n input bytes (incompressible input is stored raw)
size_t zipmoe_fhuf_compress_bound(size_t n);

// compress n bytes; returns the compressed size (> 0) or a negative error
int64_t zipmoe_fhuf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity);

// per-thread reusable decoder state (tables + workspace); decompression allocates nothing
struct zipmoe_fhuf_decoder;

struct zipmoe_fhuf_decoder * zipmoe_fhuf_decoder_new(void);
void                         zipmoe_fhuf_decoder_free(struct zipmoe_fhuf_decoder * dec);

// decode src (n bytes) into exactly dst_size bytes; 0 on success, ZIPMOE_FHUF_ERR_CORRUPT otherwise.
// Safe on arbitrary input: never reads outside [src, src+n) nor writes outside [dst, dst+dst_size).
int zipmoe_fhuf_decompress(struct zipmoe_fhuf_decoder * dec, const uint8_t * src, size_t n,
                           uint8_t * dst, size_t dst_size);

#ifdef __cplusplus
}
#endif
