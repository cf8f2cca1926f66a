// zipmoe-fhuf's parameters and byte helpers, shared by its encoder (zipmoe-fhuf-encode.c) and
// decoder (zipmoe-fhuf.c). Internal.

#pragma once

#include <stdint.h>
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
