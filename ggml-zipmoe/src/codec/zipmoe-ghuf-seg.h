// zipmoe-ghuf's decoding steps that run on the GPU (zipmoe-cuda.cu) and on the host (zipmoe-ghuf.c)
// from one source: a table entry from the canonical code, a segment decoded with the table, and
// a segment's place in the stream. The GPU decodes every segment of a chunk in its own thread.

#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#    define ZIPMOE_GHUF_HD static inline __host__ __device__
#else
#    define ZIPMOE_GHUF_HD static inline
#endif

#define ZIPMOE_GHUF_SEGMENT 1024u                     // values per segment (the last one: the rest)
#define ZIPMOE_GHUF_MAXLEN  12u                       // longest code
#define ZIPMOE_GHUF_TABLE   (1u << ZIPMOE_GHUF_MAXLEN) // decoding table entries

// the canonical code of a stream: its symbols by (length, symbol), their lengths and their codes
// bit-reversed (the bit streams are LSB-first)
struct zipmoe_ghuf_code {
    uint32_t n_sym;
    uint8_t  sym[256];
    uint8_t  len[256];
    uint16_t rcode[256];
};

// decoding table entry j (the next MAXLEN bits of a stream): symbol << 4 | code length, or 0 when no
// code is a prefix of j (a corrupt stream)
ZIPMOE_GHUF_HD uint16_t zipmoe_ghuf_entry(const struct zipmoe_ghuf_code * c, uint32_t j) {
    for (uint32_t i = 0; i < c->n_sym; i++) {
        const uint32_t l = c->len[i];
        if ((j & ((1u << l) - 1u)) == c->rcode[i]) {
            return (uint16_t) ((uint32_t) c->sym[i] << 4 | l);
        }
    }
    return 0;
}

// segment i's start in the bit-stream area and its byte size, from the offsets table (n_seg
// little-endian u32, checked by the host when it parsed the stream)
ZIPMOE_GHUF_HD uint32_t zipmoe_ghuf_offset(const uint8_t * offsets, uint32_t i) {
    const uint8_t * p = offsets + 4u * i;
    return (uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24;
}

ZIPMOE_GHUF_HD uint32_t zipmoe_ghuf_segment_bytes(const uint8_t * offsets, uint32_t i, uint32_t n_seg,
                                                  uint64_t area_size) {
    const uint32_t end = i + 1 < n_seg ? zipmoe_ghuf_offset(offsets, i + 1) : (uint32_t) area_size;
    return end - zipmoe_ghuf_offset(offsets, i);
}

// decodes count symbols of one segment (seg_bytes bytes, codes LSB-first, zero-padded to a byte)
// into dst; 0, or -1 for a corrupt segment: an invalid code, a code past its end, or bytes left over
ZIPMOE_GHUF_HD int zipmoe_ghuf_decode_segment(const uint16_t * table, const uint8_t * seg, uint32_t seg_bytes,
                                              uint8_t * dst, uint32_t count) {
    uint64_t acc  = 0;
    uint32_t nb   = 0;
    uint32_t pos  = 0;
    uint64_t used = 0;
    for (uint32_t i = 0; i < count; i++) {
        while (nb <= 56 && pos < seg_bytes) {
            acc |= (uint64_t) seg[pos++] << nb;
            nb += 8;
        }
        const uint32_t e = table[acc & (ZIPMOE_GHUF_TABLE - 1u)];
        const uint32_t l = e & 15u;
        if (l == 0 || l > nb) {
            return -1;
        }
        dst[i] = (uint8_t) (e >> 4);
        acc >>= l;
        nb -= l;
        used += l;
    }
    return (used + 7) / 8 == seg_bytes ? 0 : -1;
}
