// zipmoe-fhuf's encoder (the format: zipmoe-fhuf.c): length-limited Huffman code lengths, the
// canonical code, and the streams coded backwards, or a raw / rle fallback.

#include "codec/zipmoe-fhuf.h"
#include "codec/zipmoe-fhuf-impl.h"

#include <stdlib.h>
#include <string.h>

static size_t varint_len(uint64_t v) {
    size_t k = 1;
    while (v >= 0x80) {
        v >>= 7;
        k++;
    }
    return k;
}

//
// encoder
//

size_t zipmoe_fhuf_compress_bound(size_t n) {
    return n + 1 + 10; // raw fallback: tag + varint size
}

// Huffman code lengths for the m >= 2 used symbols, limited to maxlen (zlib/miniz-style
// rebalancing of the length histogram: near optimal when only rare symbols are affected)
static void build_lengths(const uint64_t cnt[256], unsigned maxlen, uint8_t len[256]) {
    int      sym[256];
    int      m = 0;
    uint64_t w[512];
    int      parent[512];
    int      depth[512];

    for (int s = 0; s < 256; s++) {
        len[s] = 0;
        if (cnt[s]) {
            sym[m++] = s;
        }
    }
    // insertion sort ascending by count, ties by symbol: deterministic
    for (int i = 1; i < m; i++) {
        const int x = sym[i];
        int       j = i - 1;
        while (j >= 0 && (cnt[sym[j]] > cnt[x] || (cnt[sym[j]] == cnt[x] && sym[j] > x))) {
            sym[j + 1] = sym[j];
            j--;
        }
        sym[j + 1] = x;
    }
    for (int i = 0; i < m; i++) {
        w[i] = cnt[sym[i]];
    }
    // two-queue Huffman: leaves [0, m) sorted, internal nodes created in increasing weight
    int leaf = 0, inode = m;
    for (int k = m; k < 2 * m - 1; k++) {
        int pick[2];
        for (int t = 0; t < 2; t++) {
            if (leaf < m && (inode >= k || w[leaf] <= w[inode])) {
                pick[t] = leaf++;
            } else {
                pick[t] = inode++;
            }
        }
        w[k]            = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = k;
        parent[pick[1]] = k;
    }
    depth[2 * m - 2] = 0;
    for (int k = 2 * m - 3; k >= 0; k--) {
        depth[k] = depth[parent[k]] + 1;
    }
    unsigned bl[64] = { 0 };
    for (int i = 0; i < m; i++) {
        bl[depth[i] > (int) maxlen ? maxlen : (unsigned) depth[i]]++;
    }
    uint64_t total = 0;
    for (unsigned l = 1; l <= maxlen; l++) {
        total += (uint64_t) bl[l] << (maxlen - l);
    }
    while (total > (1ull << maxlen)) {
        bl[maxlen]--;
        for (unsigned l = maxlen - 1; l > 0; l--) {
            if (bl[l]) {
                bl[l]--;
                bl[l + 1] += 2;
                break;
            }
        }
        total--;
    }
    // most frequent symbols get the shortest codes
    int idx = m - 1;
    for (unsigned l = 1; l <= maxlen; l++) {
        for (unsigned c = bl[l]; c > 0; c--) {
            len[sym[idx--]] = (uint8_t) l;
        }
    }
}

static void histogram(const uint8_t * src, size_t n, uint64_t out[256]) {
    // 4 sub-histograms break the store-to-load dependency on runs of equal bytes
    uint32_t h[4][256];
    memset(h, 0, sizeof(h));
    memset(out, 0, 256 * sizeof(uint64_t));
    while (n > 0) {
        const size_t chunk = n < (1u << 30) ? n : (1u << 30);
        size_t       i     = 0;
        for (; i + 4 <= chunk; i += 4) {
            h[0][src[i]]++;
            h[1][src[i + 1]]++;
            h[2][src[i + 2]]++;
            h[3][src[i + 3]]++;
        }
        for (; i < chunk; i++) {
            h[0][src[i]]++;
        }
        for (int s = 0; s < 256; s++) {
            out[s] += (uint64_t) h[0][s] + h[1][s] + h[2][s] + h[3][s];
            h[0][s] = h[1][s] = h[2][s] = h[3][s] = 0;
        }
        src += chunk;
        n -= chunk;
    }
}

// encode one segment, last byte first (the decoder fills segments from the end), into exactly
// its precomputed byte size; 8-byte stores while they stay below `limit` (bytes past the
// stream's end are overwritten by the next stream)
static uint8_t * encode_stream(const uint8_t * in, size_t n, const uint32_t code[256], uint8_t * o,
                               const uint8_t * limit) {
    uint64_t acc = 0;
    unsigned nb  = 0;
    size_t   i   = n;
    if (limit - o >= 8) {
        const uint8_t * const safe = limit - 8;
        for (; i >= 4 && o <= safe; i -= 4) {
            // 4 codes <= 48 bits on top of <= 7 pending bits
            const uint32_t c0 = code[in[i - 1]], c1 = code[in[i - 2]], c2 = code[in[i - 3]], c3 = code[in[i - 4]];
            acc |= (uint64_t) (c0 & 0xFFFF) << nb;
            nb += c0 >> 16;
            acc |= (uint64_t) (c1 & 0xFFFF) << nb;
            nb += c1 >> 16;
            acc |= (uint64_t) (c2 & 0xFFFF) << nb;
            nb += c2 >> 16;
            acc |= (uint64_t) (c3 & 0xFFFF) << nb;
            nb += c3 >> 16;
            wr64(o, acc);
            o += nb >> 3;
            acc >>= (nb & 56);
            nb &= 7;
        }
    }
    for (; i > 0; i--) {
        const uint32_t c = code[in[i - 1]];
        acc |= (uint64_t) (c & 0xFFFF) << nb;
        nb += c >> 16;
        while (nb >= 8) {
            *o++ = (uint8_t) acc;
            acc >>= 8;
            nb -= 8;
        }
    }
    if (nb) {
        *o++ = (uint8_t) acc;
    }
    return o;
}

static int64_t store_raw(const uint8_t * src, size_t n, uint8_t * dst, size_t cap) {
    const size_t h = 1 + varint_len(n);
    if (cap < h + n) {
        return ZIPMOE_FHUF_ERR_CAPACITY;
    }
    dst[0] = MODE_TAG | MODE_RAW;
    zipmoe_fhuf_put_varint(dst + 1, n);
    if (n) {
        memcpy(dst + h, src, n);
    }
    return (int64_t) (h + n);
}

// histogram each of the S segments (split as evenly as n allows) and their sum
static void segment_histograms(const uint8_t * src, size_t n, unsigned S, size_t seg_len[],
                               uint64_t seg_hist[][256], uint64_t cnt[256]) {
    memset(cnt, 0, 256 * sizeof(uint64_t));
    const uint8_t * p = src;
    for (unsigned i = 0; i < S; i++) {
        seg_len[i] = n / S + (i < n % S);
        histogram(p, seg_len[i], seg_hist[i]);
        for (int s = 0; s < 256; s++) {
            cnt[s] += seg_hist[i][s];
        }
        p += seg_len[i];
    }
}

// the number of distinct symbols, and the smallest (*lo) and largest (*hi) of them
static int symbol_range(const uint64_t cnt[256], int * lo, int * hi) {
    int m = 0;
    *lo   = 256;
    *hi   = -1;
    for (int s = 0; s < 256; s++) {
        if (cnt[s]) {
            m++;
            *lo = *lo < s ? *lo : s;
            *hi = s;
        }
    }
    return m;
}

// n copies of one byte value
static int64_t store_rle(uint8_t value, size_t n, uint8_t * dst, size_t cap) {
    const size_t h = 1 + varint_len(n);
    if (cap < h + 1) {
        return ZIPMOE_FHUF_ERR_CAPACITY;
    }
    dst[0] = MODE_TAG | MODE_RLE;
    zipmoe_fhuf_put_varint(dst + 1, n);
    dst[h] = value;
    return (int64_t) (h + 1);
}

// length-limited code lengths and canonical codes, packed as code | length << 16 (0: unused)
static void build_codes(const uint64_t cnt[256], int lo, int hi, uint8_t len[256], uint32_t code[256]) {
    unsigned rcode[256];
    uint8_t  sorted[256];
    build_lengths(cnt, FHUF_ENC_LEN, len);
    zipmoe_fhuf_canonical_codes(len, (unsigned) lo, (unsigned) hi, rcode, sorted);
    for (int s = 0; s < 256; s++) {
        code[s] = len[s] ? rcode[s] | ((uint32_t) len[s] << 16) : 0;
    }
}

// each stream's exact byte size; returns the whole Huffman-mode output's size
static size_t huf_sizes(size_t n, unsigned S, const uint64_t seg_hist[][256], const uint8_t len[256], int lo,
                        int hi, size_t stream_size[]) {
    size_t total = 1 + varint_len(n) + 3 + (size_t) (hi - lo + 2) / 2;
    for (unsigned i = 0; i < S; i++) {
        uint64_t bits = 0;
        for (int s = lo; s <= hi; s++) {
            bits += seg_hist[i][s] * len[s];
        }
        stream_size[i] = (size_t) ((bits + 7) / 8);
        total += stream_size[i] + (i + 1 < S ? varint_len(stream_size[i]) : 0);
    }
    return total;
}

// mode, n, S, the symbol range, the code lengths (two to a byte) and all but the last stream's
// size; returns the header's size
static size_t write_huf_header(uint8_t * dst, size_t n, unsigned S, int lo, int hi, const uint8_t len[256],
                               const size_t stream_size[]) {
    size_t o = 0;
    dst[o++] = MODE_TAG | MODE_HUF;
    o += zipmoe_fhuf_put_varint(dst + o, n);
    dst[o++] = (uint8_t) S;
    dst[o++] = (uint8_t) lo;
    dst[o++] = (uint8_t) hi;
    for (int s = lo; s <= hi; s += 2) {
        dst[o++] = (uint8_t) (len[s] | (s + 1 <= hi ? len[s + 1] << 4 : 0));
    }
    for (unsigned i = 0; i + 1 < S; i++) {
        o += zipmoe_fhuf_put_varint(dst + o, stream_size[i]);
    }
    return o;
}

int64_t zipmoe_fhuf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity) {
    if (dst == NULL || (src == NULL && n > 0)) {
        return ZIPMOE_FHUF_ERR_ARG;
    }
    if (n == 0) {
        return store_raw(src, n, dst, dst_capacity);
    }
    const unsigned S = n >= FHUF_MIN_MULTI ? FHUF_ENC_STREAMS : 1;
    uint64_t       seg_hist[FHUF_MAXSTREAMS][256];
    uint64_t       cnt[256];
    size_t         seg_len[FHUF_MAXSTREAMS];
    segment_histograms(src, n, S, seg_len, seg_hist, cnt);
    int lo, hi;
    if (symbol_range(cnt, &lo, &hi) == 1) {
        return store_rle(src[0], n, dst, dst_capacity);
    }
    uint8_t  len[256];
    uint32_t code[256];
    build_codes(cnt, lo, hi, len, code);
    size_t       stream_size[FHUF_MAXSTREAMS];
    const size_t total = huf_sizes(n, S, (const uint64_t (*)[256]) seg_hist, len, lo, hi, stream_size);
    if (total >= 1 + varint_len(n) + n) {
        return store_raw(src, n, dst, dst_capacity);
    }
    if (dst_capacity < total) {
        return ZIPMOE_FHUF_ERR_CAPACITY;
    }
    size_t          o = write_huf_header(dst, n, S, lo, hi, len, stream_size);
    const uint8_t * p = src;
    for (unsigned i = 0; i < S; i++) {
        uint8_t * const end = encode_stream(p, seg_len[i], code, dst + o, dst + total);
        (void) end; // == dst + o + stream_size[i] by construction
        o += stream_size[i];
        p += seg_len[i];
    }
    return (int64_t) o;
}

//
// shared with zipmoe-ghuf.c (one Huffman construction for both layouts)
//

void zipmoe_fhuf_code_lengths(const uint64_t cnt[256], unsigned maxlen, uint8_t len[256]) {
    build_lengths(cnt, maxlen, len);
}

void zipmoe_fhuf_histogram(const uint8_t * src, size_t n, uint64_t out[256]) {
    histogram(src, n, out);
}
