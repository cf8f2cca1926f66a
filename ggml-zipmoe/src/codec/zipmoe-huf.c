// Order-0 Huffman codec for exponent planes, built on zstd's huff0 (4 interleaved streams).
//
// Exponents are i.i.d.-like bytes: an entropy coder with no match finding reaches the
// order-0 bound at the highest decode speed. huff0 codes at most 128 KiB per block, so a
// plane is a u64 little-endian count of decoded bytes (huff0 cannot tell a wrong output size
// from a right one) followed by a sequence of blocks, each:
//   u32 little-endian header: payload size in bits 0..29, mode in bits 30..31
//   payload: mode 0 = huff0 4-stream data, 1 = raw bytes, 2 = one byte repeated (RLE)
// The output size of every block is implied by the plane size (all blocks full but the last).

#include "common/zipmoe-impl.h"

#include "ggml-zipmoe.h"

#include <stdlib.h>
#include <string.h>

enum { HUF_MODE_HUF = 0, HUF_MODE_RAW = 1, HUF_MODE_RLE = 2 };

struct zipmoe_huf_decoder {
    void * state; // huff0 decoding table and workspace (zipmoe-zstd.c)
};

struct zipmoe_huf_decoder * zipmoe_huf_decoder_new(void) {
    struct zipmoe_huf_decoder * dec = (struct zipmoe_huf_decoder *) calloc(1, sizeof(*dec));
    if (dec != NULL && (dec->state = zipmoe_huff0_state_new()) == NULL) {
        free(dec);
        return NULL;
    }
    return dec;
}

void zipmoe_huf_decoder_free(struct zipmoe_huf_decoder * dec) {
    if (dec != NULL) {
        zipmoe_huff0_state_free(dec->state);
        free(dec);
    }
}

size_t zipmoe_huf_compress_bound(size_t n) {
    const size_t blocks = n == 0 ? 0 : (n + ZIPMOE_HUF_BLOCK_SIZE - 1) / ZIPMOE_HUF_BLOCK_SIZE;
    return ZIPMOE_HUF_STREAM_HEADER + n + blocks * ZIPMOE_HUF_BLOCK_HEADER; // raw fallback: a block never grows beyond its header
}

static void put_header(uint8_t * p, size_t size, unsigned mode) {
    const uint32_t h = (uint32_t) size | ((uint32_t) mode << 30);
    p[0] = (uint8_t) h; p[1] = (uint8_t) (h >> 8); p[2] = (uint8_t) (h >> 16); p[3] = (uint8_t) (h >> 24);
}

int64_t zipmoe_huf_compress(const uint8_t * src, size_t n, uint8_t * dst, size_t dst_capacity) {
    if (dst_capacity < zipmoe_huf_compress_bound(n)) {
        return GGML_ZIPMOE_ERR_CAPACITY;
    }
    for (int i = 0; i < ZIPMOE_HUF_STREAM_HEADER; i++) {
        dst[i] = (uint8_t) ((uint64_t) n >> (8 * i));
    }
    size_t out = ZIPMOE_HUF_STREAM_HEADER;
    for (size_t pos = 0; pos < n; pos += ZIPMOE_HUF_BLOCK_SIZE) {
        const size_t len = n - pos < ZIPMOE_HUF_BLOCK_SIZE ? n - pos : ZIPMOE_HUF_BLOCK_SIZE;
        uint8_t * payload = dst + out + ZIPMOE_HUF_BLOCK_HEADER;
        // capacity len - 1: a huff0 block is only kept if it is smaller than the raw bytes
        size_t r = len > 1 ? zipmoe_huff0_compress(payload, len - 1, src + pos, len) : 0;
        if (r == 1) {
            payload[0] = src[pos];
            put_header(dst + out, 1, HUF_MODE_RLE);
        } else if (r == 0) {
            memcpy(payload, src + pos, len);
            put_header(dst + out, len, HUF_MODE_RAW);
            r = len;
        } else {
            put_header(dst + out, r, HUF_MODE_HUF);
        }
        out += ZIPMOE_HUF_BLOCK_HEADER + r;
    }
    return (int64_t) out;
}

int zipmoe_huf_decompress(struct zipmoe_huf_decoder * dec, const uint8_t * src, size_t n,
                          uint8_t * dst, size_t dst_size) {
    if (n < ZIPMOE_HUF_STREAM_HEADER) {
        return GGML_ZIPMOE_ERR_CORRUPT;
    }
    uint64_t total = 0;
    for (int i = 0; i < ZIPMOE_HUF_STREAM_HEADER; i++) {
        total |= (uint64_t) src[i] << (8 * i);
    }
    if (total != dst_size) {
        return GGML_ZIPMOE_ERR_CORRUPT;
    }
    size_t in = ZIPMOE_HUF_STREAM_HEADER;
    for (size_t pos = 0; pos < dst_size; pos += ZIPMOE_HUF_BLOCK_SIZE) {
        const size_t len = dst_size - pos < ZIPMOE_HUF_BLOCK_SIZE ? dst_size - pos : ZIPMOE_HUF_BLOCK_SIZE;
        if (n - in < ZIPMOE_HUF_BLOCK_HEADER) {
            return GGML_ZIPMOE_ERR_CORRUPT;
        }
        const uint32_t h = (uint32_t) src[in] | ((uint32_t) src[in + 1] << 8) | ((uint32_t) src[in + 2] << 16) |
                           ((uint32_t) src[in + 3] << 24);
        in += ZIPMOE_HUF_BLOCK_HEADER;
        const size_t size = h & 0x3FFFFFFFu;
        const unsigned mode = h >> 30;
        if (size > n - in) {
            return GGML_ZIPMOE_ERR_CORRUPT;
        }
        switch (mode) {
            case HUF_MODE_HUF: {
                if (zipmoe_huff0_decompress(dec->state, dst + pos, len, src + in, size) != 0) {
                    return GGML_ZIPMOE_ERR_CORRUPT;
                }
            } break;
            case HUF_MODE_RAW:
                if (size != len) {
                    return GGML_ZIPMOE_ERR_CORRUPT;
                }
                memcpy(dst + pos, src + in, len);
                break;
            case HUF_MODE_RLE:
                if (size != 1) {
                    return GGML_ZIPMOE_ERR_CORRUPT;
                }
                memset(dst + pos, src[in], len);
                break;
            default:
                return GGML_ZIPMOE_ERR_CORRUPT;
        }
        in += size;
    }
    return in == n ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CORRUPT; // trailing bytes mean a corrupt chunk
}
