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

#include "codec/zipmoe-fhuf.h"
#include "codec/zipmoe-fhuf-impl.h"

#include <stdlib.h>
#include <string.h>

static size_t put_varint(uint8_t * p, uint64_t v) {
    size_t k = 0;
    while (v >= 0x80) {
        p[k++] = (uint8_t) (v | 0x80);
        v >>= 7;
    }
    p[k++] = (uint8_t) v;
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

// the header: mode and size (dst_size). A raw or run-length body is written here: FHUF_DONE; a
// Huffman body is left to the caller at *pos: FHUF_HUF; else ZIPMOE_FHUF_ERR_CORRUPT
enum { FHUF_DONE = 0, FHUF_HUF = 1 };

static int read_mode(const uint8_t * src, size_t n, size_t * pos, uint8_t * dst, size_t dst_size) {
    uint64_t size;
    *pos = 1;
    if (get_varint(src, n, pos, &size) || size != dst_size) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    switch (src[0]) {
        case MODE_TAG | MODE_RAW:
            if (n - *pos != dst_size) {
                return ZIPMOE_FHUF_ERR_CORRUPT;
            }
            if (dst_size) {
                memcpy(dst, src + *pos, dst_size);
            }
            return FHUF_DONE;
        case MODE_TAG | MODE_RLE:
            if (n - *pos != 1 || dst_size == 0) {
                return ZIPMOE_FHUF_ERR_CORRUPT;
            }
            memset(dst, src[*pos], dst_size);
            return FHUF_DONE;
        case MODE_TAG | MODE_HUF:
            return FHUF_HUF;
        default:
            return ZIPMOE_FHUF_ERR_CORRUPT;
    }
}

// a Huffman body's code: its stream count, the symbols [lo, hi] and their lengths (4 bits each) into
// len[256], the shortest; a complete code only (every table index then decodes to >= 1 symbol)
struct fh_code {
    unsigned S, lo, hi, minlen;
};

static int read_code(const uint8_t * src, size_t n, size_t * pos, size_t dst_size, uint8_t len[256],
                     struct fh_code * code) {
    if (n - *pos < 3) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    const unsigned S  = src[*pos];
    const unsigned lo = src[*pos + 1];
    const unsigned hi = src[*pos + 2];
    *pos += 3;
    if (S < 1 || S > FHUF_MAXSTREAMS || hi < lo || dst_size == 0 || n - *pos < (hi - lo + 2) / 2) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    unsigned kraft = 0, used = 0, minlen = FHUF_MAXLEN;
    for (unsigned s = lo; s <= hi; s++) {
        const unsigned l = (src[*pos + (s - lo) / 2] >> (4 * ((s - lo) & 1))) & 15;
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
    *pos += (hi - lo + 2) / 2;
    if (used < 2 || kraft != (1u << FHUF_MAXLEN)) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    *code = (struct fh_code) { S, lo, hi, minlen };
    return 0;
}

// the S streams' sizes: S - 1 varints, the last stream the rest of src
static int read_stream_sizes(const uint8_t * src, size_t n, size_t * pos, unsigned S, size_t ssize[FHUF_MAXSTREAMS]) {
    size_t sum = 0;
    for (unsigned i = 0; i + 1 < S; i++) {
        uint64_t v;
        if (get_varint(src, n, pos, &v) || v > n) {
            return ZIPMOE_FHUF_ERR_CORRUPT;
        }
        ssize[i] = (size_t) v;
        sum += ssize[i];
    }
    if (sum > n - *pos) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    ssize[S - 1] = n - *pos - sum;
    return 0;
}

// stream i reads from start[i] and writes its share of dst (dst_size / S, the first dst_size % S one more)
static void start_streams(struct fh_stream st[FHUF_MAXSTREAMS], size_t start[FHUF_MAXSTREAMS], unsigned S, size_t pos,
                          const size_t ssize[FHUF_MAXSTREAMS], uint8_t * dst, size_t dst_size) {
    uint8_t * o = dst;
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
}

int zipmoe_fhuf_decompress(struct zipmoe_fhuf_decoder * dec, const uint8_t * src, size_t n, uint8_t * dst,
                           size_t dst_size) {
    if (dec == NULL || (src == NULL && n > 0) || (dst == NULL && dst_size > 0) || n < 2) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    size_t pos;
    const int mode = read_mode(src, n, &pos, dst, dst_size);
    if (mode != FHUF_HUF) {
        return mode;
    }
    uint8_t        len[256] = { 0 };
    struct fh_code code;
    size_t         ssize[FHUF_MAXSTREAMS];
    if (read_code(src, n, &pos, dst_size, len, &code) || read_stream_sizes(src, n, &pos, code.S, ssize)) {
        return ZIPMOE_FHUF_ERR_CORRUPT;
    }
    const unsigned S = code.S;

    const uint64_t * const tab = FH_CACHE && dec->valid && memcmp(dec->len, len, 256) == 0
                                     ? dec->multi + FH_TSIZE
                                     : build_tables(dec, len, code.lo, code.hi, code.minlen);
    dec->valid = 1;

    struct fh_stream st[FHUF_MAXSTREAMS];
    size_t           start[FHUF_MAXSTREAMS];
    start_streams(st, start, S, pos, ssize, dst, dst_size);
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
// shared with zipmoe-ghuf.c and the encoder
//

unsigned zipmoe_fhuf_canonical_codes(const uint8_t len[256], unsigned lo, unsigned hi, unsigned rcode[256],
                                     uint8_t sorted[256]) {
    return canonical_codes(len, lo, hi, rcode, sorted);
}

size_t zipmoe_fhuf_put_varint(uint8_t * p, uint64_t v) {
    return put_varint(p, v);
}

int zipmoe_fhuf_get_varint(const uint8_t * src, size_t n, size_t * pos, uint64_t * out) {
    return get_varint(src, n, pos, out);
}
