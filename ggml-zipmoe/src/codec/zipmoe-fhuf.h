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

// internal, shared with zipmoe-ghuf.c: the histogram of n bytes; varints; code lengths limited to maxlen
// (<= 12) for a histogram using >= 2 symbols; the canonical codes of symbols lo..hi, bit-reversed,
// with the used symbols listed by (length, symbol) in sorted (returns how many)
void     zipmoe_fhuf_histogram(const uint8_t * src, size_t n, uint64_t out[256]);
size_t   zipmoe_fhuf_put_varint(uint8_t * p, uint64_t v);                                  // LEB128; bytes written
int      zipmoe_fhuf_get_varint(const uint8_t * src, size_t n, size_t * pos, uint64_t * out); // 0, or -1 if malformed
void     zipmoe_fhuf_code_lengths(const uint64_t cnt[256], unsigned maxlen, uint8_t len[256]);
unsigned zipmoe_fhuf_canonical_codes(const uint8_t len[256], unsigned lo, unsigned hi, unsigned rcode[256],
                                     uint8_t sorted[256]);

#ifdef __cplusplus
}
#endif
