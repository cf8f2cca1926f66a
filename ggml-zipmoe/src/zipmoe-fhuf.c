// zipmoe-fhuf: order-0 length-limited Huffman with a multi-symbol decoding table.
//
// Stream format (all integers little-endian, varint = LEB128):
//   byte    0xF0 | mode          mode 0 = raw, 1 = rle, 2 = huffman
//   varint  decoded size
//   raw:    the bytes
//   rle:    1 byte, repeated
//   huf:    byte S (streams, 1..16), byte lo, byte hi, (hi-lo+2)/2 bytes of 4-bit code lengths
//           for symbols lo..hi (low nibble first, 0 = absent, max FHUF_MAXLEN, complete code),
//           S-1 varints: byte sizes of streams 0..S-2 (the last one takes the rest), streams.
//   Output is split into S contiguous segments (segment i has n/S + (i < n%S) bytes); stream i
//   codes segment i from its last byte to its first (the decoder writes backwards), bits
//   LSB-first, canonical codes bit-reversed, zero-padded to a byte.
//
// Decoding: a table indexed by the next FHUF_TBITS bits gives as many whole codes as fit (up to
// 6 symbols) packed in a uint64 (layout above fh_kernel).
// One load + one unconditional 8-byte store per lookup; 4 streams interleaved hide the load
// latency; branchless refill every FH_LPR lookups. Bounds are guaranteed by computing, before
// each run of the inner loop, how many iterations are safe for every stream; the last few
// symbols of each segment go through a careful path.

#include "zipmoe-fhuf.h"

#include <stdlib.h>
#include <string.h>

#ifndef FHUF_ENC_LEN
#define FHUF_ENC_LEN 12 // encoder's code length limit (11 costs ~0.15% more here)
#endif
#ifndef FHUF_ENC_STREAMS
#define FHUF_ENC_STREAMS FH_GROUP
#endif
#ifndef FHUF_TBITS
#define FHUF_TBITS 12 // decoder lookup bits; >= FHUF_MAXLEN so each lookup yields >= 1 symbol
#endif

#ifndef FHUF_MAXLEN
#define FHUF_MAXLEN      12 // format limit on code lengths
#endif
#define FHUF_MAXSTREAMS  16
#define FHUF_MIN_MULTI   4096 // below this, one stream (header and tail cost dominate)
#define FH_TSIZE         (1u << FHUF_TBITS)
#define FH_TMASK         (FH_TSIZE - 1)
#define FH_LPR           (56 / FHUF_TBITS) // lookups per refill: a refill leaves >= 56 bits
#define FH_SPI           (6 * FH_LPR)      // max symbols written per stream per iteration
#ifndef FH_CACHE
#define FH_CACHE 1 // reuse the table when a buffer has the same code lengths as the previous one
#endif
#ifndef FH_GROUP
#define FH_GROUP         4                 // streams interleaved by the fast kernel (3..6)
#endif

#if FHUF_TBITS < FHUF_MAXLEN || FHUF_TBITS > 13 || FHUF_ENC_LEN > FHUF_MAXLEN
#error "bad FHUF parameters" // > 13 bits could need 7 symbols per entry
#endif

enum { MODE_RAW = 0, MODE_RLE = 1, MODE_HUF = 2, MODE_TAG = 0xF0 };

static inline uint64_t rd64(const uint8_t * p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void wr64(uint8_t * p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static size_t put_varint(uint8_t * p, uint64_t v) {
    size_t k = 0;
    while (v >= 0x80) {
        p[k++] = (uint8_t) (v | 0x80);
        v >>= 7;
    }
    p[k++] = (uint8_t) v;
    return k;
}

static size_t varint_len(uint64_t v) {
    size_t k = 1;
    while (v >= 0x80) {
        v >>= 7;
        k++;
    }
    return k;
}

// returns 0 on success; rejects truncation and values above 2^63
static int get_varint(const uint8_t * src, size_t n, size_t * pos, uint64_t * out) {
    uint64_t v = 0;
    for (unsigned shift = 0; shift < 63; shift += 7) {
        if (*pos >= n) {
            return -1;
        }
        const uint8_t b = src[(*pos)++];
        v |= (uint64_t) (b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static inline unsigned bitrev(unsigned code, unsigned len) {
    unsigned r = 0;
    for (unsigned i = 0; i < len; i++) {
        r = (r << 1) | ((code >> i) & 1);
    }
    return r;
}

// canonical codes (MSB-first order by (length, symbol)) of the symbols lo..hi, returned
// bit-reversed for LSB-first I/O; also lists the used symbols by increasing length
static unsigned canonical_codes(const uint8_t len[256], unsigned lo, unsigned hi, unsigned rcode[256],
                                uint8_t sorted[256]) {
    unsigned count[FHUF_MAXLEN + 1] = { 0 };
    unsigned next[FHUF_MAXLEN + 1], first[FHUF_MAXLEN + 1];
    for (unsigned s = lo; s <= hi; s++) {
        count[len[s]]++;
    }
    count[0]      = 0;
    unsigned code = 0, idx = 0;
    for (unsigned l = 1; l <= FHUF_MAXLEN; l++) {
        code     = (code + count[l - 1]) << 1;
        next[l]  = code;
        first[l] = idx;
        idx += count[l];
    }
    for (unsigned s = lo; s <= hi; s++) {
        const unsigned l = len[s];
        if (l) {
            sorted[first[l]++] = (uint8_t) s;
            rcode[s]           = bitrev(next[l]++, l);
        }
    }
    return idx;
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
    put_varint(dst + 1, n);
    if (n) {
        memcpy(dst + h, src, n);
    }
    return (int64_t) (h + n);
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
    uint64_t       cnt[256] = { 0 };
    size_t         seg_len[FHUF_MAXSTREAMS];
    {
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
    int m = 0, lo = 256, hi = -1;
    for (int s = 0; s < 256; s++) {
        if (cnt[s]) {
            m++;
            lo = lo < s ? lo : s;
            hi = s;
        }
    }
    if (m == 1) {
        const size_t h = 1 + varint_len(n);
        if (dst_capacity < h + 1) {
            return ZIPMOE_FHUF_ERR_CAPACITY;
        }
        dst[0] = MODE_TAG | MODE_RLE;
        put_varint(dst + 1, n);
        dst[h] = src[0];
        return (int64_t) (h + 1);
    }
    uint8_t  len[256];
    unsigned rcode[256];
    uint32_t code[256];
    build_lengths(cnt, FHUF_ENC_LEN, len);
    uint8_t  sorted[256];
    canonical_codes(len, (unsigned) lo, (unsigned) hi, rcode, sorted);
    for (int s = 0; s < 256; s++) {
        code[s] = len[s] ? rcode[s] | ((uint32_t) len[s] << 16) : 0;
    }
    size_t stream_size[FHUF_MAXSTREAMS];
    size_t total = 1 + varint_len(n) + 3 + (size_t) (hi - lo + 2) / 2;
    for (unsigned i = 0; i < S; i++) {
        uint64_t bits = 0;
        for (int s = lo; s <= hi; s++) {
            bits += seg_hist[i][s] * len[s];
        }
        stream_size[i] = (size_t) ((bits + 7) / 8);
        total += stream_size[i] + (i + 1 < S ? varint_len(stream_size[i]) : 0);
    }
    if (total >= 1 + varint_len(n) + n) {
        return store_raw(src, n, dst, dst_capacity);
    }
    if (dst_capacity < total) {
        return ZIPMOE_FHUF_ERR_CAPACITY;
    }
    size_t o = 0;
    dst[o++] = MODE_TAG | MODE_HUF;
    o += put_varint(dst + o, n);
    dst[o++] = (uint8_t) S;
    dst[o++] = (uint8_t) lo;
    dst[o++] = (uint8_t) hi;
    for (int s = lo; s <= hi; s += 2) {
        dst[o++] = (uint8_t) (len[s] | (s + 1 <= hi ? len[s + 1] << 4 : 0));
    }
    for (unsigned i = 0; i + 1 < S; i++) {
        o += put_varint(dst + o, stream_size[i]);
    }
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
// decoder
//

struct fh_stream {
    uint64_t  bb;  // bit buffer: next bit at bit 0
    uint64_t  bc;  // number of valid bits in bb (0..63)
    size_t    pos; // offset in src of the next byte to load
    uint8_t * out; // output cursor: the segment is filled from its end down to beg
    uint8_t * beg; // start of this stream's segment
};

typedef void (*fh_kernel_fn)(const uint64_t * tab, const uint8_t * src, size_t src_n, struct fh_stream * st);

struct zipmoe_fhuf_decoder {
    uint64_t     multi[2 * FH_TSIZE]; // level tables; the decoding table is the last FH_TSIZE entries
    uint16_t     d1[FH_TSIZE];        // single-symbol table (only for codes of length 1)
    uint8_t      len[256];            // code lengths of the current table
    int          valid;               // the tables match len (shards of one tensor often share codes)
    fh_kernel_fn kernel;
};

// Table entry: byte 0 = bits used, byte 1 = symbol count, bytes 7, 6, ... = symbols in decoding
// order. Segments are written backwards, so one 8-byte store at out - 8 puts the symbols in
// place without shifting the entry (the low bytes land below and are overwritten later).
//
// Fast kernel over FH_GROUP streams. Each iteration: one refill per stream, then FH_LPR lookups
// per stream. c -= x subtracts the whole entry: only the low byte (bits used) matters and it
// cannot borrow, so c is re-masked once per iteration instead of extracting a field per lookup.
#define FH_DECL(i)                                    \
    uint64_t        b##i = st[i].bb, c##i = st[i].bc; \
    const uint8_t * p##i = src + st[i].pos;           \
    uint8_t *       o##i = st[i].out;                 \
    uint8_t * const g##i = st[i].beg;
#define FH_LIMIT(i)                                                                \
    {                                                                              \
        const size_t ro = (size_t) (o##i - g##i), ri = (size_t) (src_end - p##i); \
        size_t       kk = 0;                                                       \
        if (ro >= 8 + FH_SPI && ri >= 15) {                                        \
            kk = (ro - 8) / FH_SPI;                                                \
            kk = kk < (ri - 8) / 7 ? kk : (ri - 8) / 7;                            \
        }                                                                          \
        k = k < kk ? k : kk;                                                       \
    }
#define FH_REFILL(i)            \
    b##i |= rd64(p##i) << c##i; \
    p##i += (63 - c##i) >> 3;   \
    c##i |= 56;
#define FH_LOOK(i)                                  \
    {                                               \
        const uint64_t x_ = tab[FH_IDX(b##i)];      \
        wr64(o##i - 8, x_);                         \
        o##i -= (uint8_t) (x_ >> 8);                \
        b##i >>= (x_ & 63);                         \
        c##i -= x_;                                 \
    }
#define FH_MASKC(i) c##i &= 0xFF;
#define FH_SAVE(i)                     \
    st[i].bb  = b##i;                  \
    st[i].bc  = c##i;                  \
    st[i].pos = (size_t) (p##i - src); \
    st[i].out = o##i;
#if FH_GROUP == 3
#define FH_EACH(M) M(0) M(1) M(2)
#elif FH_GROUP == 4
#define FH_EACH(M) M(0) M(1) M(2) M(3)
#elif FH_GROUP == 5
#define FH_EACH(M) M(0) M(1) M(2) M(3) M(4)
#elif FH_GROUP == 6
#define FH_EACH(M) M(0) M(1) M(2) M(3) M(4) M(5)
#endif

#define FH_KERNEL(NAME, ATTR)                                                                               \
    ATTR static void NAME(const uint64_t * tab, const uint8_t * src, size_t src_n, struct fh_stream * st) { \
        const uint8_t * const src_end = src + src_n;                                                        \
        FH_EACH(FH_DECL)                                                                                   \
        for (;;) {                                                                                          \
            size_t k = (size_t) -1;                                                                         \
            FH_EACH(FH_LIMIT)                                                                              \
            if (k == 0) {                                                                                   \
                break;                                                                                      \
            }                                                                                               \
            do {                                                                                            \
                FH_EACH(FH_REFILL)                                                                         \
                for (int r_ = 0; r_ < FH_LPR; r_++) {                                                       \
                    FH_EACH(FH_LOOK)                                                                       \
                }                                                                                           \
                FH_EACH(FH_MASKC)                                                                          \
            } while (--k);                                                                                  \
        }                                                                                                   \
        FH_EACH(FH_SAVE)                                                                                   \
    }

#define FH_IDX(b) ((b) & FH_TMASK)
FH_KERNEL(fh_kernel_base, )
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef FH_BZHI
#include <immintrin.h>
#endif
#define FH_HAVE_BMI2 1
#ifdef FH_BZHI // measured slower than mov + and on Skylake-SP
#undef FH_IDX
#define FH_IDX(b) _bzhi_u64((b), FHUF_TBITS)
#endif
FH_KERNEL(fh_kernel_bmi2, __attribute__((target("bmi2"))))
#endif

// careful path: reads clamped to [0, src_n) (zeros beyond), writes only inside the segment
static void fh_tail(const uint64_t * tab, const uint8_t * len, const uint8_t * src, size_t src_n,
                    struct fh_stream * s) {
    uint64_t  b = s->bb, c = s->bc;
    size_t    pos = s->pos;
    uint8_t * o   = s->out;
    while (o > s->beg) {
        if (c < FHUF_TBITS) { // the whole table index must be stream bits
            uint64_t v = 0;
            if (pos <= src_n && src_n - pos >= 8) {
                v = rd64(src + pos);
            } else {
                for (unsigned k = 0; k < 8 && pos + k < src_n; k++) {
                    v |= (uint64_t) src[pos + k] << (8 * k);
                }
            }
            b |= v << c;
            pos += (63 - c) >> 3;
            c |= 56;
        }
        const uint64_t x   = tab[b & FH_TMASK];
        const size_t   cnt = (x >> 8) & 0xFF;
        unsigned       nb  = x & 0xFF;
        if (cnt <= (size_t) (o - s->beg)) {
            for (size_t t = 0; t < cnt; t++) {
                *--o = (uint8_t) (x >> (56 - 8 * t));
            }
        } else { // entry runs past the segment start: take its first symbol only
            *--o = (uint8_t) (x >> 56);
            nb   = len[x >> 56];
        }
        b >>= nb;
        c -= nb;
    }
    s->bb  = b;
    s->bc  = c;
    s->pos = pos;
    s->out = o;
}

struct zipmoe_fhuf_decoder * zipmoe_fhuf_decoder_new(void) {
    const size_t                 sz  = (sizeof(struct zipmoe_fhuf_decoder) + 63) & ~(size_t) 63;
    struct zipmoe_fhuf_decoder * dec = (struct zipmoe_fhuf_decoder *) aligned_alloc(64, sz);
    if (dec == NULL) {
        return NULL;
    }
    memset(dec, 0, sizeof(*dec));
    dec->kernel = fh_kernel_base;
#ifdef FH_HAVE_BMI2
    if (__builtin_cpu_supports("bmi2")) {
        dec->kernel = fh_kernel_bmi2;
    }
#endif
    return dec;
}

void zipmoe_fhuf_decoder_free(struct zipmoe_fhuf_decoder * dec) {
    free(dec);
}

// builds the multi-symbol table from validated lengths (complete code); returns it
static const uint64_t * build_tables(struct zipmoe_fhuf_decoder * dec, const uint8_t len[256], unsigned lo,
                                     unsigned hi, unsigned minlen) {
    unsigned       rcode[256];
    uint8_t        syms[256];
    const unsigned ns = canonical_codes(len, lo, hi, rcode, syms);
    memcpy(dec->len, len, 256);
    uint64_t * const E = dec->multi;
    if (minlen >= 2) {
        // Level r (entries E[2^r .. 2^(r+1))) = greedy decode of every r-bit window. A window
        // whose first code s (length l <= r) is rc_s + k << l decodes to s followed by level
        // r - l's entry for k: so each level is built from lower ones with sequential loads and
        // no per-entry branches. Windows of <= 11 bits hold <= 5 codes of >= 2 bits, so
        // prepending never exceeds 6 symbols. Windows starting with a longer code stay empty.
        const unsigned top = FHUF_TBITS - minlen;
        memset(E, 0, sizeof(uint64_t) << (top + 1));
        for (unsigned r = minlen;; r++) { // levels minlen..top (the only ones referenced), then T
            if (r > top) {
                r = FHUF_TBITS;
            }
            uint64_t * const lvl = E + (1u << r);
            for (unsigned q = 0; q < ns && len[syms[q]] <= r; q++) {
                const unsigned        s   = syms[q], l = len[s];
                const uint64_t        add = ((uint64_t) s << 56) + 0x100 + l;
                const uint64_t *const sub = E + (1u << (r - l));
                uint64_t * const      dstp = lvl + rcode[s];
                for (unsigned k = 0; k < (1u << (r - l)); k++) {
                    const uint64_t e = sub[k];
                    dstp[(size_t) k << l] = ((e >> 8) & 0x00FFFFFFFFFF0000ull) + (e & 0xFFFF) + add;
                }
            }
            if (r == FHUF_TBITS) {
                break;
            }
        }
    } else {
        // a 1-bit code: greedy per entry with a cap of 6 symbols
        uint16_t * const d1 = dec->d1;
        for (unsigned q = 0; q < ns; q++) {
            const unsigned s = syms[q];
            {
                const uint16_t v = (uint16_t) (s | len[s] << 8);
                for (unsigned i = rcode[s]; i < FH_TSIZE; i += 1u << len[s]) {
                    d1[i] = v;
                }
            }
        }
        uint64_t * const tab = E + FH_TSIZE;
        for (unsigned i = 0; i < FH_TSIZE; i++) {
            unsigned x = i, rem = FHUF_TBITS, nb = 0, cnt = 0;
            uint64_t e = 0;
            while (cnt < 6) {
                const unsigned d = d1[x & FH_TMASK];
                const unsigned l = d >> 8;
                if (l > rem) {
                    break;
                }
                e |= (uint64_t) (d & 0xFF) << (56 - 8 * cnt);
                cnt++;
                nb += l;
                x >>= l;
                rem -= l;
            }
            tab[i] = e | nb | ((uint64_t) cnt << 8);
        }
    }
    return E + FH_TSIZE;
}

int zipmoe_fhuf_decompress(struct zipmoe_fhuf_decoder * dec, const uint8_t * src, size_t n, uint8_t * dst,
                           size_t dst_size) {
    if (dec == NULL || (src == NULL && n > 0) || (dst == NULL && dst_size > 0) || n < 2) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    size_t   pos = 1;
    uint64_t size;
    if (get_varint(src, n, &pos, &size) || size != dst_size) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    switch (src[0]) {
        case MODE_TAG | MODE_RAW:
            if (n - pos != dst_size) {
                return ZIPMOE_FHUF_ERR_CORRUPT;
            }
            if (dst_size) {
                memcpy(dst, src + pos, dst_size);
            }
            return 0;
        case MODE_TAG | MODE_RLE:
            if (n - pos != 1 || dst_size == 0) {
                return ZIPMOE_FHUF_ERR_CORRUPT;
            }
            memset(dst, src[pos], dst_size);
            return 0;
        case MODE_TAG | MODE_HUF:
            break;
        default:
            return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    if (n - pos < 3) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    const unsigned S  = src[pos];
    const unsigned lo = src[pos + 1];
    const unsigned hi = src[pos + 2];
    pos += 3;
    if (S < 1 || S > FHUF_MAXSTREAMS || hi < lo || dst_size == 0 || n - pos < (hi - lo + 2) / 2) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    uint8_t  len[256] = { 0 };
    unsigned kraft = 0, used = 0, minlen = FHUF_MAXLEN;
    for (unsigned s = lo; s <= hi; s++) {
        const unsigned l = (src[pos + (s - lo) / 2] >> (4 * ((s - lo) & 1))) & 15;
        if (l > FHUF_MAXLEN) {
            return ZIPMOE_FHUF_ERR_CORRUPT;
        }
        if (l) {
            len[s] = (uint8_t) l;
            kraft += 1u << (FHUF_MAXLEN - l);
            used++;
            minlen = l < minlen ? l : minlen;
        }
    }
    pos += (hi - lo + 2) / 2;
    // complete code only: every table index then decodes to >= 1 symbol
    if (used < 2 || kraft != (1u << FHUF_MAXLEN)) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    size_t ssize[FHUF_MAXSTREAMS];
    size_t sum = 0;
    for (unsigned i = 0; i + 1 < S; i++) {
        uint64_t v;
        if (get_varint(src, n, &pos, &v) || v > n) {
            return ZIPMOE_FHUF_ERR_CORRUPT;
        }
        ssize[i] = (size_t) v;
        sum += ssize[i];
    }
    if (sum > n - pos) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    ssize[S - 1] = n - pos - sum;

    const uint64_t * const tab =
        FH_CACHE && dec->valid && memcmp(dec->len, len, 256) == 0 ? dec->multi + FH_TSIZE : build_tables(dec, len, lo, hi, minlen);
    dec->valid = 1;

    struct fh_stream st[FHUF_MAXSTREAMS];
    size_t           start[FHUF_MAXSTREAMS];
    uint8_t *        o = dst;
    for (unsigned i = 0; i < S; i++) {
        const size_t seg = dst_size / S + (i < dst_size % S);
        start[i]         = pos;
        st[i].bb         = 0;
        st[i].bc         = 0;
        st[i].pos        = pos;
        st[i].beg        = o;
        st[i].out        = o + seg;
        pos += ssize[i];
        o += seg;
    }
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    // the kernel's unconditional 8-byte stores rely on the little-endian entry layout
    for (unsigned g = 0; g + FH_GROUP <= S; g += FH_GROUP) {
        dec->kernel(tab, src, n, st + g);
    }
#endif
    for (unsigned i = 0; i < S; i++) {
        fh_tail(tab, dec->len, src, n, &st[i]);
        // every stream must end inside its last byte: catches truncation and most corruption
        const uint64_t used_bits = (uint64_t) (st[i].pos - start[i]) * 8 - st[i].bc;
        const uint64_t have_bits = (uint64_t) ssize[i] * 8;
        if (used_bits > have_bits || used_bits + 8 <= have_bits) {
            return ZIPMOE_FHUF_ERR_CORRUPT;
        }
    }
    return 0;
}

//
// shared with zipmoe-ghuf.c (one Huffman construction for both layouts)
//

void zipmoe_fhuf_code_lengths(const uint64_t cnt[256], unsigned maxlen, uint8_t len[256]) {
    build_lengths(cnt, maxlen, len);
}

unsigned zipmoe_fhuf_canonical_codes(const uint8_t len[256], unsigned lo, unsigned hi, unsigned rcode[256],
                                     uint8_t sorted[256]) {
    return canonical_codes(len, lo, hi, rcode, sorted);
}

void zipmoe_fhuf_histogram(const uint8_t * src, size_t n, uint64_t out[256]) {
    histogram(src, n, out);
}

size_t zipmoe_fhuf_put_varint(uint8_t * p, uint64_t v) {
    return put_varint(p, v);
}

int zipmoe_fhuf_get_varint(const uint8_t * src, size_t n, size_t * pos, uint64_t * out) {
    return get_varint(src, n, pos, out);
}
