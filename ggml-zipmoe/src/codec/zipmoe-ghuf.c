// zipmoe-ghuf: order-0 Huffman in independent 1024-value segments (format: zipmoe-ghuf.h). The
// code lengths come from zipmoe-fhuf.c's construction; the segment decoder is the GPU's
// (zipmoe-ghuf-seg.h), so the host checks the GPU's arithmetic on every stream it decodes.

#include "codec/zipmoe-ghuf.h"

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-test.h"
#include "codec/zipmoe-fhuf.h"

#include <string.h>

enum { TAG = 0xE0 };

static void put_u32(uint8_t * p, uint32_t v) {
    p[0] = (uint8_t) v;
    p[1] = (uint8_t) (v >> 8);
    p[2] = (uint8_t) (v >> 16);
    p[3] = (uint8_t) (v >> 24);
}

size_t zipmoe_ghuf_compress_bound(size_t n) {
    return n + 1 + 10; // raw fallback: tag + varint size
}

static int64_t store_raw(const uint8_t * src, size_t n, uint8_t * dst, size_t cap) {
    uint8_t head[11];
    head[0] = TAG | ZIPMOE_GHUF_RAW;
    const size_t h = 1 + zipmoe_fhuf_put_varint(head + 1, n);
    if (cap < h + n) {
        return -3;
    }
    memcpy(dst, head, h);
    if (n) {
        memcpy(dst + h, src, n);
    }
    return (int64_t) (h + n);
}

static uint32_t n_segments(uint64_t n) {
    return (uint32_t) ((n + ZIPMOE_GHUF_SEGMENT - 1) / ZIPMOE_GHUF_SEGMENT);
}

int64_t zipmoe_ghuf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity) {
    if (dst == NULL || (src == NULL && n > 0)) {
        return -1;
    }
    uint64_t cnt[256];
    zipmoe_fhuf_histogram(src, n, cnt);
    unsigned lo = 256, hi = 0, used = 0;
    for (unsigned s = 0; s < 256; s++) {
        if (cnt[s]) {
            lo = s < lo ? s : lo;
            hi = s;
            used++;
        }
    }
    if (used == 1 && dst_capacity >= 12) { // one value repeated (a constant plane)
        dst[0] = TAG | ZIPMOE_GHUF_RLE;
        const size_t h = 1 + zipmoe_fhuf_put_varint(dst + 1, n);
        dst[h] = src[0];
        return (int64_t) (h + 1);
    }
    if (used < 2 || n >= ((uint64_t) 1 << 32) || (uint64_t) n_segments(n) * 4 >= n) {
        return store_raw(src, n, dst, dst_capacity); // empty, or too large or small to pay for its offsets
    }
    uint8_t len[256];
    unsigned rcode[256];
    uint8_t sorted[256];
    zipmoe_fhuf_code_lengths(cnt, ZIPMOE_GHUF_MAXLEN, len);
    zipmoe_fhuf_canonical_codes(len, lo, hi, rcode, sorted);
    uint64_t bits = 0;
    for (unsigned s = lo; s <= hi; s++) {
        bits += cnt[s] * len[s];
    }
    const uint32_t S = n_segments(n);
    const size_t header = 1 + 10 + 2 + (hi - lo + 2) / 2 + 4 * (size_t) S;
    // each segment pads to a byte: at most S bytes beyond the bits
    if (header + bits / 8 + S >= n || header + bits / 8 + S > dst_capacity) {
        return store_raw(src, n, dst, dst_capacity);
    }
    uint8_t * o = dst;
    *o++ = TAG | ZIPMOE_GHUF_HUF;
    o += zipmoe_fhuf_put_varint(o, n);
    *o++ = (uint8_t) lo;
    *o++ = (uint8_t) hi;
    for (unsigned s = lo; s <= hi; s += 2) {
        *o++ = (uint8_t) (len[s] | (s + 1 <= hi ? len[s + 1] << 4 : 0));
    }
    uint8_t * offsets = o;
    uint8_t * area    = o + 4 * (size_t) S;
    uint8_t * w       = area;
    for (uint32_t i = 0; i < S; i++) {
        put_u32(offsets + 4 * (size_t) i, (uint32_t) (w - area));
        const size_t first = (size_t) i * ZIPMOE_GHUF_SEGMENT;
        const size_t last  = first + ZIPMOE_GHUF_SEGMENT < n ? first + ZIPMOE_GHUF_SEGMENT : n;
        uint64_t acc = 0;
        unsigned nb  = 0;
        for (size_t v = first; v < last; v++) {
            acc |= (uint64_t) rcode[src[v]] << nb;
            nb += len[src[v]];
            while (nb >= 8) {
                *w++ = (uint8_t) acc;
                acc >>= 8;
                nb -= 8;
            }
        }
        if (nb) {
            *w++ = (uint8_t) acc;
        }
    }
    return (int64_t) (w - dst);
}

int zipmoe_ghuf_parse(const uint8_t * src, size_t size, struct zipmoe_ghuf_stream * s) {
    if (src == NULL || s == NULL || size < 2 || (src[0] & 0xF0) != TAG) {
        return -1;
    }
    memset(s, 0, sizeof(*s));
    s->mode = src[0] & 0x0F;
    size_t pos = 1;
    if (zipmoe_fhuf_get_varint(src, size, &pos, &s->n) != 0) {
        return -1;
    }
    switch (s->mode) {
        case ZIPMOE_GHUF_RAW:
            s->raw = src + pos;
            return size - pos == s->n ? 0 : -1;
        case ZIPMOE_GHUF_RLE:
            s->rle_byte = pos < size ? src[pos] : 0;
            return pos + 1 == size ? 0 : -1;
        case ZIPMOE_GHUF_HUF:
            break;
        default:
            return -1;
    }
    if (s->n == 0 || s->n >= ((uint64_t) 1 << 32) || pos + 2 > size || src[pos] > src[pos + 1]) {
        return -1;
    }
    const unsigned lo = src[pos], hi = src[pos + 1];
    pos += 2;
    if (pos + (hi - lo + 2) / 2 > size) {
        return -1;
    }
    uint8_t len[256] = { 0 };
    uint64_t kraft = 0; // in units of 2^-MAXLEN
    unsigned used = 0;
    for (unsigned sym = lo; sym <= hi; sym++) {
        const uint8_t b = src[pos + (sym - lo) / 2];
        len[sym] = (sym - lo) % 2 ? b >> 4 : b & 0x0F;
        if (len[sym] > ZIPMOE_GHUF_MAXLEN) {
            return -1;
        }
        if (len[sym]) {
            kraft += (uint64_t) 1 << (ZIPMOE_GHUF_MAXLEN - len[sym]);
            used++;
        }
    }
    pos += (hi - lo + 2) / 2;
    if (used == 0 || kraft > ZIPMOE_GHUF_TABLE) { // not a prefix code
        return -1;
    }
    unsigned rcode[256];
    uint8_t sorted[256];
    s->code.n_sym = zipmoe_fhuf_canonical_codes(len, lo, hi, rcode, sorted);
    for (uint32_t i = 0; i < s->code.n_sym; i++) {
        s->code.sym[i]   = sorted[i];
        s->code.len[i]   = len[sorted[i]];
        s->code.rcode[i] = (uint16_t) rcode[sorted[i]];
    }
    s->n_seg = n_segments(s->n);
    if ((size - pos) / 4 < s->n_seg) {
        return -1;
    }
    s->offsets   = src + pos;
    s->area      = src + pos + 4 * (size_t) s->n_seg;
    s->area_size = size - pos - 4 * (uint64_t) s->n_seg;
    uint32_t prev = 0;
    for (uint32_t i = 0; i < s->n_seg; i++) {
        const uint32_t off = zipmoe_ghuf_offset(s->offsets, i);
        if ((i == 0 && off != 0) || off < prev || off > s->area_size) {
            return -1;
        }
        prev = off;
    }
    return 0;
}

void zipmoe_ghuf_table(const struct zipmoe_ghuf_code * c, uint16_t * table) {
    // each code fills every entry it is a prefix of (the codes are prefix-free: one fill per entry)
    memset(table, 0, ZIPMOE_GHUF_TABLE * sizeof(uint16_t));
    for (uint32_t i = 0; i < c->n_sym; i++) {
        const uint16_t e = (uint16_t) ((uint32_t) c->sym[i] << 4 | c->len[i]);
        for (uint32_t j = c->rcode[i]; j < ZIPMOE_GHUF_TABLE; j += 1u << c->len[i]) {
            table[j] = e;
        }
    }
}

// every segment of a parsed Huffman stream with a decoding table, first to last or (reverse) last to
// first; 0, or -1 at the first corrupt segment
static int decode_segments(const struct zipmoe_ghuf_stream * s, const uint16_t * table, uint8_t * dst, int reverse) {
    for (uint32_t j = 0; j < s->n_seg; j++) {
        const uint32_t i     = reverse ? s->n_seg - 1 - j : j;
        const uint64_t first = (uint64_t) i * ZIPMOE_GHUF_SEGMENT;
        const uint32_t count = (uint32_t) (s->n - first < ZIPMOE_GHUF_SEGMENT ? s->n - first : ZIPMOE_GHUF_SEGMENT);
        const uint32_t bytes = zipmoe_ghuf_segment_bytes(s->offsets, i, s->n_seg, s->area_size);
        if (zipmoe_ghuf_decode_segment(table, s->area + zipmoe_ghuf_offset(s->offsets, i), bytes, dst + first,
                                       count) != 0) {
            return -1;
        }
    }
    return 0;
}

int zipmoe_ghuf_decompress(const uint8_t * src, size_t size, uint8_t * dst, size_t dst_size) {
    struct zipmoe_ghuf_stream s;
    if ((dst == NULL && dst_size > 0) || zipmoe_ghuf_parse(src, size, &s) != 0 || s.n != dst_size) {
        return -1;
    }
    if (s.mode == ZIPMOE_GHUF_RAW) {
        if (dst_size) {
            memcpy(dst, s.raw, dst_size);
        }
        return 0;
    }
    if (s.mode == ZIPMOE_GHUF_RLE) {
        memset(dst, s.rle_byte, dst_size);
        return 0;
    }
    uint16_t table[ZIPMOE_GHUF_TABLE];
    zipmoe_ghuf_table(&s.code, table);
    return decode_segments(&s, table, dst, 0);
}

int ggml_zipmoe_ghuf_decode_as_gpu(const void * src, size_t size, void * dst, size_t dst_size) {
    struct zipmoe_ghuf_stream s;
    if ((src == NULL && size > 0) || (dst == NULL && dst_size > 0)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (zipmoe_ghuf_parse((const uint8_t *) src, size, &s) != 0 || s.n != dst_size) {
        return GGML_ZIPMOE_ERR_CORRUPT;
    }
    if (s.mode != ZIPMOE_GHUF_HUF) {
        return zipmoe_ghuf_decompress((const uint8_t *) src, size, (uint8_t *) dst, dst_size) == 0
                   ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
    }
    uint16_t table[ZIPMOE_GHUF_TABLE];
    for (uint32_t j = 0; j < ZIPMOE_GHUF_TABLE; j++) { // one GPU thread's entry each
        table[j] = zipmoe_ghuf_entry(&s.code, j);
    }
    // one GPU thread's segment each, in any order: last first
    return decode_segments(&s, table, (uint8_t *) dst, 1) == 0 ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
}
