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

// transparent huge pages asked for [addr, addr + size): memory written for the first time goes about
// twice as fast (zipmoe-pages.c); a no-op where the kernel has none
void zipmoe_advise_huge_pages(void * addr, size_t size);
// the whole pages within [addr, addr + size) given back to the system (MADV_DONTNEED: read again as zeros)
void zipmoe_release_pages(void * addr, size_t size);
// whether zipmoe_move_pages can move pages here (Linux 5.7+, probed once)
int zipmoe_can_move_pages(void);
// the pages of [src, src + size) moved to dst, replacing what was mapped there; src stays mapped, empty
// (read again as zeros). Page-aligned src, dst and size, in private anonymous memory. Returns size, or 0
// where nothing moved (the kernel refused; dst is then mapped, empty): the caller gives src's pages back.
// ZIPMOE_MOVE_LOST: refused after the kernel took dst down, and dst could not be mapped again
#define ZIPMOE_MOVE_LOST ((size_t) -1)
size_t zipmoe_move_pages(void * src, void * dst, size_t size);
// whether every page of [addr, addr + size) is in memory (page-aligned; 0 where unknown)
int zipmoe_pages_resident(void * addr, size_t size);
// memory mappings this process may still make (vm.max_map_count less those it has); -1 where unknown
int64_t zipmoe_map_headroom(void);

// XXH64 with seed 0 (zstd's bundled xxHash)
uint64_t zipmoe_xxh64(const void * data, size_t n);

// ZipMoE GGUF files (zipmoe-format.c builds the index, zipmoe-io.c reads chunks)

struct zipmoe_chunk {
    uint64_t offset;   // absolute file offset
    uint64_t size;     // stored bytes
    uint64_t checksum; // XXH64 of the stored bytes
    int      codec;
};

struct zipmoe_tensor {
    char *                name;        // GGUF name of the served tensor ("blk.3.ffn_up_exps.weight")
    int                   layer;
    int64_t               ne[3];       // [ne0, ne1, n_expert]
    uint64_t              n;           // values per expert
    int                   type;        // ggml type served: BF16 (split), or any other (raw, format version 3)
    int                   raw;         // not BF16: chunk 0 holds the expert's bytes as they are, chunks 1..K are empty
    uint64_t              sm_size;     // chunk 0's bytes: the SM plane (n), or a raw expert's bytes
    uint64_t              bytes;       // one expert in its served type (a slot's share): 2n, or sm_size when raw
    struct zipmoe_chunk * chunks;      // n_expert * (1 + K), expert-major
};

struct ggml_zipmoe_file {
    char *                 path;
    int                    fd;
    unsigned               flags;
    int                    n_shards;
    int                    version;     // zipmoe.format_version (2: codec ghuf may appear)
    int                    n_tensors;
    struct zipmoe_tensor * tensors;
    uint64_t               max_chunk_size;  // largest stored chunk
    uint64_t               max_sm_size;      // largest SM-chunk (chunk 0) in bytes: the SM plane, or a raw expert
};

// the chunk record, or NULL when tensor/expert/chunk is out of range
const struct zipmoe_chunk * zipmoe_file_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk);

// [first, first + count) values of shard k of an expert of n values: the converter's split, shard k holds
// [k*n/K, (k+1)*n/K) (arithmetic the codec and the format both use, so it lives here, below them)
static inline void zipmoe_shard_range(uint64_t n, int shards, int k, uint64_t * first, uint64_t * count) {
    const uint64_t lo = n * (uint64_t) k / (uint64_t) shards;
    const uint64_t hi = n * (uint64_t) (k + 1) / (uint64_t) shards;
    *first = lo;
    *count = hi - lo;
}
// the same for a tensor's expert: a raw tensor's shards are empty (0, 0)
void zipmoe_tensor_shard_range(const struct zipmoe_tensor * t, int shards, int k, uint64_t * first, uint64_t * count);

uint64_t zipmoe_align_up(uint64_t x, uint64_t a);

// pools of the hierarchy, by index (enum ggml_zipmoe_pool); NO_POOL: not cached
#define NO_POOL (-1)

// The one decode + recover routine (zipmoe-codec.c): the expert cache's workers, the reader and
// ggml_zipmoe_decode_expert all run it. Shard k (0-based) of an expert of n values, dst the
// expert's n BF16 values: its E-chunk (src, size stored bytes) decodes into the upper half of the
// shard's own bytes of dst, and recovery with the expert's SM plane (n bytes) rewrites them in place.
// The cache decodes as soon as the E-chunk is in memory and recovers once the SM-chunk is.
struct ggml_zipmoe_decoder;
int  zipmoe_shard_decode(struct ggml_zipmoe_decoder * dec, int codec, const void * src, size_t size, uint64_t n,
                         int n_shards, int k, uint16_t * dst);
void zipmoe_shard_recover(const uint8_t * sm, uint64_t n, int n_shards, int k, uint16_t * dst);
int  zipmoe_shard_decode_recover(struct ggml_zipmoe_decoder * dec, int codec, const void * src, size_t size,
                                 const uint8_t * sm, uint64_t n, int n_shards, int k, uint16_t * dst);

// reads a chunk's stored bytes without checking them (the caller checks the checksum, maybe on
// another thread); buffer rules as ggml_zipmoe_file_read_chunk; *sys_errno: errno of a failed read
int zipmoe_read_chunk_unchecked(const struct ggml_zipmoe_file * file, const struct zipmoe_chunk * c, uint8_t * buf,
                                size_t capacity, int * sys_errno);

// the message naming the chunk and the reason of a failed read, check or decode
void zipmoe_describe_failure(const struct ggml_zipmoe_file * file, int status, int tensor, int expert, int chunk,
                             int sys_errno, char * buf, size_t size);

#ifdef __cplusplus
}
#endif
