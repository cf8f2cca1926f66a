// Internal declarations shared by ggml-zipmoe's source files (not part of the public API).

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// order-0 Huffman (zstd's huff0), implemented in zipmoe-huf.c around the zstd amalgamation

#define ZIPMOE_HUF_BLOCK_SIZE   (128 * 1024) // huff0's largest block
#define ZIPMOE_HUF_STREAM_HEADER 8           // u64 LE: decoded size of the whole stream
#define ZIPMOE_HUF_BLOCK_HEADER  4           // u32 LE: payload size (30 bits) | mode (2 bits)

struct zipmoe_huf_decoder;

struct zipmoe_huf_decoder * zipmoe_huf_decoder_new(void);
void                        zipmoe_huf_decoder_free(struct zipmoe_huf_decoder * dec);

size_t  zipmoe_huf_compress_bound(size_t n);
int64_t zipmoe_huf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity);
int     zipmoe_huf_decompress(struct zipmoe_huf_decoder * dec, const uint8_t * src, size_t n,
                              uint8_t * dst, size_t dst_size);

// thin wrappers over zstd's internal huff0 API (zipmoe-zstd.c, the one file that compiles zstd)

// compress one block of at most ZIPMOE_HUF_BLOCK_SIZE bytes: returns the size, 0 when not
// compressible into dst_capacity bytes (store raw), 1 when all bytes are equal (store RLE)
size_t zipmoe_huff0_compress(void * dst, size_t dst_capacity, const void * src, size_t n);

void * zipmoe_huff0_state_new(void);
void   zipmoe_huff0_state_free(void * state);

// decode one block to exactly dst_size bytes: 0 on success, -1 on corrupt input
int    zipmoe_huff0_decompress(void * state, void * dst, size_t dst_size, const void * src, size_t n);

// XXH64 with seed 0 (zstd's bundled xxHash)
uint64_t zipmoe_xxh64(const void * data, size_t n);

#ifdef __cplusplus
}
#endif
