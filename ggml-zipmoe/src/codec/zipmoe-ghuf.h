// zipmoe-ghuf: an order-0 Huffman layout for exponent planes that a GPU decodes: one code table
// per stream, many small independent segments with their start offsets (in the spirit of
// DFloat11), so that one GPU thread decodes one segment (docs/FORMAT.md, codec "ghuf").
//
// Stream format (integers little-endian, varint = LEB128):
//   byte    0xE0 | mode          mode 0 = raw, 1 = rle, 2 = huffman
//   varint  decoded size n
//   raw:    the n bytes
//   rle:    1 byte, repeated n times
//   huf:    byte lo, byte hi, (hi-lo+2)/2 bytes of 4-bit code lengths for symbols lo..hi (low
//           nibble first, 0 = absent, at most 12, a prefix code), then S = ceil(n / 1024) u32
//           offsets (segment i's start in the bit-stream area; the first is 0, none decreases),
//           then the area: segment i codes values [1024 i, min(n, 1024 (i + 1))) in order, codes
//           LSB-first, canonical codes bit-reversed, zero-padded to a byte.
#pragma once

#include "codec/zipmoe-ghuf-seg.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { ZIPMOE_GHUF_RAW = 0, ZIPMOE_GHUF_RLE = 1, ZIPMOE_GHUF_HUF = 2 };

// a parsed stream: what the GPU decoder needs to be handed
struct zipmoe_ghuf_stream {
    int                     mode;
    uint64_t                n;         // decoded size
    const uint8_t *         raw;       // raw: the bytes
    uint8_t                 rle_byte;  // rle: the byte
    struct zipmoe_ghuf_code code;      // huf: the code
    const uint8_t *         offsets;   // huf: n_seg u32
    uint32_t                n_seg;
    const uint8_t *         area;      // huf: the segments
    uint64_t                area_size;
};

size_t  zipmoe_ghuf_compress_bound(size_t n);

// compresses n bytes; the compressed size (> 0), or -1 (bad argument), -3 (dst too small)
int64_t zipmoe_ghuf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity);

// checks a stream's header, code and offsets; 0, or -1 if malformed
int     zipmoe_ghuf_parse(const uint8_t * src, size_t size, struct zipmoe_ghuf_stream * s);

// the decoding table of a code (ZIPMOE_GHUF_TABLE entries), as zipmoe_ghuf_entry gives them
void    zipmoe_ghuf_table(const struct zipmoe_ghuf_code * c, uint16_t * table);

// decodes into exactly dst_size bytes; 0, or -1 for a corrupt stream or another size. Reads nothing
// outside [src, src + size) and writes nothing outside [dst, dst + dst_size).
int     zipmoe_ghuf_decompress(const uint8_t * src, size_t size, uint8_t * dst, size_t dst_size);

#ifdef __cplusplus
}
#endif
