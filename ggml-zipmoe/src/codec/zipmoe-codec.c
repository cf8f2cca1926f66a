// Exponent-plane codecs: raw, zstd, lz4, lz4hc and order-0 Huffman, behind one interface.

#include "ggml-zipmoe.h"
#include "codec/zipmoe-fhuf.h"
#include "codec/zipmoe-ghuf.h"
#include "common/zipmoe-impl.h"

#include "lz4.h"
#include "lz4hc.h"
#include "zstd.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

struct ggml_zipmoe_decoder {
    ZSTD_DCtx *                 zstd;
    struct zipmoe_huf_decoder * huf;
    struct zipmoe_fhuf_decoder * fhuf;
};

const char * ggml_zipmoe_status_string(int status) {
    switch (status) {
        case GGML_ZIPMOE_OK:           return "success";
        case GGML_ZIPMOE_ERR_ARG:      return "invalid argument";
        case GGML_ZIPMOE_ERR_NOMEM:    return "out of memory";
        case GGML_ZIPMOE_ERR_CAPACITY: return "output buffer too small";
        case GGML_ZIPMOE_ERR_CORRUPT:  return "corrupt compressed data";
        case GGML_ZIPMOE_ERR_IO:       return "read failed or file truncated";
        case GGML_ZIPMOE_ERR_FORMAT:   return "not a supported ZipMoE GGUF";
        case GGML_ZIPMOE_ERR_CHECKSUM: return "checksum mismatch";
        default:                       return "unknown status";
    }
}

const char * ggml_zipmoe_codec_name(int codec) {
    static const char * names[GGML_ZIPMOE_CODEC_COUNT] = { "raw", "zstd", "lz4", "lz4hc", "huf", "fhuf", "ghuf" };
    return codec >= 0 && codec < GGML_ZIPMOE_CODEC_COUNT ? names[codec] : NULL;
}

size_t ggml_zipmoe_compress_bound(int codec, size_t n) {
    switch (codec) {
        case GGML_ZIPMOE_CODEC_RAW:   return n;
        case GGML_ZIPMOE_CODEC_ZSTD:  return ZSTD_compressBound(n);
        case GGML_ZIPMOE_CODEC_LZ4:
        case GGML_ZIPMOE_CODEC_LZ4HC: return n > LZ4_MAX_INPUT_SIZE ? 0 : (size_t) LZ4_compressBound((int) n);
        case GGML_ZIPMOE_CODEC_HUF:   return zipmoe_huf_compress_bound(n);
        case GGML_ZIPMOE_CODEC_FHUF:  return zipmoe_fhuf_compress_bound(n);
        case GGML_ZIPMOE_CODEC_GHUF:  return zipmoe_ghuf_compress_bound(n);
        default:                      return 0;
    }
}

int64_t ggml_zipmoe_compress(int codec, int level, const void * src, size_t n, void * dst, size_t dst_capacity) {
    if ((src == NULL && n > 0) || dst == NULL || ggml_zipmoe_codec_name(codec) == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    switch (codec) {
        case GGML_ZIPMOE_CODEC_RAW:
            if (dst_capacity < n) {
                return GGML_ZIPMOE_ERR_CAPACITY;
            }
            memcpy(dst, src, n);
            return (int64_t) n;
        case GGML_ZIPMOE_CODEC_ZSTD: {
            if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel() || level == 0) {
                return GGML_ZIPMOE_ERR_ARG;
            }
            const size_t r = ZSTD_compress(dst, dst_capacity, src, n, level);
            if (ZSTD_isError(r)) {
                return ZSTD_getErrorCode(r) == ZSTD_error_dstSize_tooSmall ? GGML_ZIPMOE_ERR_CAPACITY
                                                                           : GGML_ZIPMOE_ERR_NOMEM;
            }
            return (int64_t) r;
        }
        case GGML_ZIPMOE_CODEC_LZ4:
        case GGML_ZIPMOE_CODEC_LZ4HC: {
            if (n > LZ4_MAX_INPUT_SIZE) {
                return GGML_ZIPMOE_ERR_ARG;
            }
            const int cap = dst_capacity > INT_MAX ? INT_MAX : (int) dst_capacity;
            int r;
            if (codec == GGML_ZIPMOE_CODEC_LZ4) {
                if (level < 1) {
                    return GGML_ZIPMOE_ERR_ARG;
                }
                r = LZ4_compress_fast((const char *) src, (char *) dst, (int) n, cap, level);
            } else {
                if (level < 1 || level > LZ4HC_CLEVEL_MAX) {
                    return GGML_ZIPMOE_ERR_ARG;
                }
                r = LZ4_compress_HC((const char *) src, (char *) dst, (int) n, cap, level);
            }
            if (r <= 0 && n > 0) {
                return GGML_ZIPMOE_ERR_CAPACITY;
            }
            return r;
        }
        case GGML_ZIPMOE_CODEC_HUF:
            return zipmoe_huf_compress((const uint8_t *) src, n, (uint8_t *) dst, dst_capacity);
        case GGML_ZIPMOE_CODEC_FHUF: {
            const int64_t r = zipmoe_fhuf_compress((const uint8_t *) src, n, (uint8_t *) dst, dst_capacity);
            return r == ZIPMOE_FHUF_ERR_CAPACITY ? GGML_ZIPMOE_ERR_CAPACITY : r < 0 ? GGML_ZIPMOE_ERR_ARG : r;
        }
        case GGML_ZIPMOE_CODEC_GHUF: {
            const int64_t r = zipmoe_ghuf_compress((const uint8_t *) src, n, (uint8_t *) dst, dst_capacity);
            return r == -3 ? GGML_ZIPMOE_ERR_CAPACITY : r < 0 ? GGML_ZIPMOE_ERR_ARG : r;
        }
        default:
            return GGML_ZIPMOE_ERR_ARG;
    }
}

struct ggml_zipmoe_decoder * ggml_zipmoe_decoder_new(void) {
    struct ggml_zipmoe_decoder * dec = (struct ggml_zipmoe_decoder *) calloc(1, sizeof(*dec));
    if (dec == NULL) {
        return NULL;
    }
    dec->zstd = ZSTD_createDCtx();
    dec->huf  = zipmoe_huf_decoder_new();
    dec->fhuf = zipmoe_fhuf_decoder_new();
    if (dec->zstd == NULL || dec->huf == NULL || dec->fhuf == NULL) {
        ggml_zipmoe_decoder_free(dec);
        return NULL;
    }
    return dec;
}

void ggml_zipmoe_decoder_free(struct ggml_zipmoe_decoder * dec) {
    if (dec != NULL) {
        ZSTD_freeDCtx(dec->zstd);
        zipmoe_huf_decoder_free(dec->huf);
        zipmoe_fhuf_decoder_free(dec->fhuf);
        free(dec);
    }
}

int ggml_zipmoe_decompress(struct ggml_zipmoe_decoder * dec, int codec, const void * src, size_t n, void * dst,
                           size_t dst_size) {
    if (dec == NULL || (src == NULL && n > 0) || (dst == NULL && dst_size > 0)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    switch (codec) {
        case GGML_ZIPMOE_CODEC_RAW:
            if (n != dst_size) {
                return GGML_ZIPMOE_ERR_CORRUPT;
            }
            memcpy(dst, src, n);
            return GGML_ZIPMOE_OK;
        case GGML_ZIPMOE_CODEC_ZSTD: {
            const size_t r = ZSTD_decompressDCtx(dec->zstd, dst, dst_size, src, n);
            return !ZSTD_isError(r) && r == dst_size ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
        }
        case GGML_ZIPMOE_CODEC_LZ4:
        case GGML_ZIPMOE_CODEC_LZ4HC: {
            if (n > INT_MAX || dst_size > INT_MAX) {
                return GGML_ZIPMOE_ERR_CORRUPT;
            }
            const int r = LZ4_decompress_safe((const char *) src, (char *) dst, (int) n, (int) dst_size);
            return r >= 0 && (size_t) r == dst_size ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
        }
        case GGML_ZIPMOE_CODEC_HUF:
            return zipmoe_huf_decompress(dec->huf, (const uint8_t *) src, n, (uint8_t *) dst, dst_size);
        case GGML_ZIPMOE_CODEC_FHUF:
            return zipmoe_fhuf_decompress(dec->fhuf, (const uint8_t *) src, n, (uint8_t *) dst, dst_size) == 0
                       ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
        case GGML_ZIPMOE_CODEC_GHUF:
            return zipmoe_ghuf_decompress((const uint8_t *) src, n, (uint8_t *) dst, dst_size) == 0
                       ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT;
        default:
            return GGML_ZIPMOE_ERR_ARG;
    }
}

int zipmoe_shard_decode(struct ggml_zipmoe_decoder * dec, int codec, const void * src, size_t size, uint64_t n,
                       int n_shards, int k, uint16_t * dst) {
    uint64_t first, count;
    zipmoe_shard_range(n, n_shards, k, &first, &count);
    return ggml_zipmoe_decompress(dec, codec, src, size, (uint8_t *) (dst + first) + count, count);
}

void zipmoe_shard_recover(const uint8_t * sm, uint64_t n, int n_shards, int k, uint16_t * dst) {
    uint64_t first, count;
    zipmoe_shard_range(n, n_shards, k, &first, &count);
    // value i overwrites bytes 2i and 2i + 1 of the shard, exponents already consumed
    ggml_zipmoe_recover_bf16((const uint8_t *) (dst + first) + count, sm + first, count, dst + first);
}

int zipmoe_shard_decode_recover(struct ggml_zipmoe_decoder * dec, int codec, const void * src, size_t size,
                                const uint8_t * sm, uint64_t n, int n_shards, int k, uint16_t * dst) {
    const int status = zipmoe_shard_decode(dec, codec, src, size, n, n_shards, k, dst);
    if (status == GGML_ZIPMOE_OK) {
        zipmoe_shard_recover(sm, n, n_shards, k, dst);
    }
    return status;
}

int ggml_zipmoe_decode_expert(struct ggml_zipmoe_decoder * dec, int n_shards, const int32_t * codecs,
                              const void * const * chunks, const size_t * chunk_sizes, const uint8_t * sm, size_t n,
                              uint16_t * dst) {
    if (dec == NULL || n_shards < 1 || codecs == NULL || chunks == NULL || chunk_sizes == NULL ||
        ((sm == NULL || dst == NULL) && n > 0)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    for (int k = 0; k < n_shards; k++) {
        const int status = zipmoe_shard_decode_recover(dec, codecs[k], chunks[k], chunk_sizes[k], sm, n, n_shards, k, dst);
        if (status != GGML_ZIPMOE_OK) {
            return status;
        }
    }
    return GGML_ZIPMOE_OK;
}

uint64_t ggml_zipmoe_checksum(const void * data, size_t n) {
    return zipmoe_xxh64(data, n);
}
