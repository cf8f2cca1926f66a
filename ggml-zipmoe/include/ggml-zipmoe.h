// ggml-zipmoe: lossless on-demand expert serving for BF16 Mixture-of-Experts models.
//
// This is the one public header of ZipMoE's C library. llama.cpp (through our patch
// series) and the Python bindings (zipmoe_py/_lib.py, one ctypes declaration per
// function here) use nothing else. All functions are thread-safe; the library keeps
// no global mutable state.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && !defined(__MINGW32__)
#    ifdef GGML_ZIPMOE_BUILD
#        define GGML_ZIPMOE_API __declspec(dllexport)
#    else
#        define GGML_ZIPMOE_API __declspec(dllimport)
#    endif
#else
#    define GGML_ZIPMOE_API __attribute__((visibility("default")))
#endif

#define GGML_ZIPMOE_VERSION_MAJOR 0
#define GGML_ZIPMOE_VERSION_MINOR 1
#define GGML_ZIPMOE_VERSION_PATCH 0

// library version as "MAJOR.MINOR.PATCH" (static storage, never freed)
GGML_ZIPMOE_API const char * ggml_zipmoe_version(void);

// library version as MAJOR*10000 + MINOR*100 + PATCH, for compile/run-time checks
GGML_ZIPMOE_API int          ggml_zipmoe_version_number(void);

// short, human-readable build description: version, compiler, SIMD paths compiled in
GGML_ZIPMOE_API const char * ggml_zipmoe_build_info(void);

//
// status codes: every fallible function returns one (0 = success, negative = failure)
//

enum ggml_zipmoe_status {
    GGML_ZIPMOE_OK            =  0,
    GGML_ZIPMOE_ERR_ARG       = -1, // invalid argument (null pointer, unknown codec, bad level)
    GGML_ZIPMOE_ERR_NOMEM     = -2, // allocation failed
    GGML_ZIPMOE_ERR_CAPACITY  = -3, // output buffer too small
    GGML_ZIPMOE_ERR_CORRUPT   = -4, // compressed data is malformed or decodes to the wrong size
    GGML_ZIPMOE_ERR_IO        = -5, // a read failed or the file is shorter than its index says
    GGML_ZIPMOE_ERR_FORMAT    = -6, // not a ZipMoE GGUF, an unsupported version, or malformed metadata
    GGML_ZIPMOE_ERR_CHECKSUM  = -7, // a chunk's stored bytes do not match its recorded checksum
};

// short English description of a status code (static storage)
GGML_ZIPMOE_API const char * ggml_zipmoe_status_string(int status);

//
// BF16 split and recovery
//
// A BF16 value s|eeeeeeee|mmmmmmm is stored as two bytes in two planes:
//   exponent plane (E):        eeeeeeee            (low entropy: compressed)
//   sign+mantissa plane (SM):  s|mmmmmmm           (near 8 bits of entropy: stored raw)
// Recovery is bit-exact for every 16-bit pattern (zeros, infinities, NaN payloads, subnormals).
//

// split n BF16 values into n exponent bytes and n sign+mantissa bytes
GGML_ZIPMOE_API void ggml_zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);

// recover n BF16 values from their planes (SIMD path chosen once at run time)
GGML_ZIPMOE_API void ggml_zipmoe_recover_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);

// the recovery path in use: "avx512bw", "avx2" or "scalar"
GGML_ZIPMOE_API const char * ggml_zipmoe_recover_impl(void);

// force a recovery path ("avx512bw", "avx2", "scalar"; NULL = best available), for tests and
// benchmarks; returns GGML_ZIPMOE_ERR_ARG if the CPU lacks it. Not meant to race with recovery.
GGML_ZIPMOE_API int          ggml_zipmoe_set_recover_impl(const char * name);

//
// exponent-plane codecs
//

enum ggml_zipmoe_codec {
    GGML_ZIPMOE_CODEC_RAW   = 0, // stored as is
    GGML_ZIPMOE_CODEC_ZSTD  = 1, // zstd frame, level 1..22 (negative levels: fast modes)
    GGML_ZIPMOE_CODEC_LZ4   = 2, // lz4 block; level is the acceleration (1 = default)
    GGML_ZIPMOE_CODEC_LZ4HC = 3, // lz4hc block, level 1..12
    GGML_ZIPMOE_CODEC_HUF   = 4, // order-0 Huffman (zstd's huff0, 4 streams) in 128 KiB blocks; level ignored
    GGML_ZIPMOE_CODEC_FHUF  = 5, // order-0 Huffman, 12-bit codes, multi-symbol table decoding (default); level ignored
    GGML_ZIPMOE_CODEC_COUNT,
};

// codec name ("raw", "zstd", "lz4", "lz4hc", "huf", "fhuf"), or NULL for an unknown codec
GGML_ZIPMOE_API const char * ggml_zipmoe_codec_name(int codec);

// worst-case compressed size of n input bytes (0 for an unknown codec)
GGML_ZIPMOE_API size_t       ggml_zipmoe_compress_bound(int codec, size_t n);

// compress n bytes of src into dst (capacity dst_capacity); returns the compressed size (> 0
// unless n == 0) or a negative status. Allocates per call: meant for conversion, not serving.
GGML_ZIPMOE_API int64_t      ggml_zipmoe_compress(int codec, int level, const void * src, size_t n,
                                                  void * dst, size_t dst_capacity);

// decoder context: holds the codecs' decompression state; make one per thread and reuse it
// (decompression then allocates nothing)
struct ggml_zipmoe_decoder;

GGML_ZIPMOE_API struct ggml_zipmoe_decoder * ggml_zipmoe_decoder_new(void);
GGML_ZIPMOE_API void                         ggml_zipmoe_decoder_free(struct ggml_zipmoe_decoder * dec);

// decompress src (n bytes) into exactly dst_size bytes of dst; anything else is GGML_ZIPMOE_ERR_CORRUPT
GGML_ZIPMOE_API int ggml_zipmoe_decompress(struct ggml_zipmoe_decoder * dec, int codec,
                                           const void * src, size_t n, void * dst, size_t dst_size);

// decode the K E-chunks of one expert (stored bytes chunks[k] of chunk_sizes[k] bytes, codec
// codecs[k]; shard k covers values [k*n/K, (k+1)*n/K)) and recover its n BF16 values with the
// SM bytes into dst, shard by shard while each decoded shard is in cache. scratch holds one
// decoded shard: at least n/K + 1 bytes. This is what ggml_zipmoe_read_expert does after reading.
GGML_ZIPMOE_API int ggml_zipmoe_decode_expert(struct ggml_zipmoe_decoder * dec, int n_shards, const int32_t * codecs,
                                              const void * const * chunks, const size_t * chunk_sizes,
                                              const uint8_t * sm, size_t n, uint8_t * scratch, uint16_t * dst);

// checksum of a stored chunk, as recorded in a ZipMoE GGUF: XXH64 with seed 0
GGML_ZIPMOE_API uint64_t ggml_zipmoe_checksum(const void * data, size_t n);

//
// ZipMoE GGUF files (docs/FORMAT.md): the chunk index and chunk reads
//

#define GGML_ZIPMOE_FORMAT_VERSION  1    // the zipmoe.format_version this library reads
#define GGML_ZIPMOE_CHUNK_ALIGNMENT 4096 // every chunk starts at a multiple of this file offset

enum ggml_zipmoe_open_flags {
    GGML_ZIPMOE_OPEN_DIRECT = 1, // read chunks with O_DIRECT (bypasses the page cache)
};

struct ggml_zipmoe_file; // an open ZipMoE GGUF: file descriptor + validated chunk index (immutable)

// open a ZipMoE GGUF and validate its whole chunk index (every chunk inside its tensor and the
// file, sizes consistent, codecs known). On failure returns NULL and, if err is not NULL, writes
// a message naming the file and what is wrong (the layer, tensor, expert and chunk when a
// chunk is at fault).
GGML_ZIPMOE_API struct ggml_zipmoe_file * ggml_zipmoe_file_open(const char * path, unsigned flags,
                                                                char * err, size_t err_size);
GGML_ZIPMOE_API void                      ggml_zipmoe_file_close(struct ggml_zipmoe_file * file);

GGML_ZIPMOE_API const char * ggml_zipmoe_file_path     (const struct ggml_zipmoe_file * file);
GGML_ZIPMOE_API int          ggml_zipmoe_file_n_shards (const struct ggml_zipmoe_file * file); // K
GGML_ZIPMOE_API int          ggml_zipmoe_file_n_tensors(const struct ggml_zipmoe_file * file); // repacked expert tensors
GGML_ZIPMOE_API size_t       ggml_zipmoe_file_max_chunk_size(const struct ggml_zipmoe_file * file); // largest stored chunk

// repacked tensor i (0 <= i < n_tensors): its GGUF name ("blk.3.ffn_up_exps.weight"), layer and
// ggml shape [ne0, ne1, n_expert]; an expert holds ne0*ne1 BF16 values
GGML_ZIPMOE_API const char * ggml_zipmoe_file_tensor_name (const struct ggml_zipmoe_file * file, int tensor);
GGML_ZIPMOE_API int          ggml_zipmoe_file_tensor_layer(const struct ggml_zipmoe_file * file, int tensor);
GGML_ZIPMOE_API void         ggml_zipmoe_file_tensor_shape(const struct ggml_zipmoe_file * file, int tensor, int64_t ne[3]);

// index of the repacked tensor with this GGUF name, or -1
GGML_ZIPMOE_API int          ggml_zipmoe_file_find_tensor (const struct ggml_zipmoe_file * file, const char * name);

// chunk c of an expert: c = 0 is the SM-chunk, c = 1 + k is E-chunk (shard) k
struct ggml_zipmoe_chunk_info {
    uint64_t offset;       // absolute file offset of the stored bytes (multiple of GGML_ZIPMOE_CHUNK_ALIGNMENT)
    uint64_t size;         // stored bytes
    uint64_t first;        // index within the expert of the first value it covers
    uint64_t count;        // values it covers (= decoded bytes)
    uint64_t checksum;     // XXH64 (seed 0) of the stored bytes
    int32_t  codec;        // enum ggml_zipmoe_codec; SM-chunks are always raw
    int32_t  shard;        // -1 for the SM-chunk, else k
};

GGML_ZIPMOE_API int ggml_zipmoe_file_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk,
                                          struct ggml_zipmoe_chunk_info * info);

// "layer 3, tensor blk.3.ffn_up_exps.weight, expert 5, E-chunk (shard 2)" into buf (always terminated)
GGML_ZIPMOE_API void ggml_zipmoe_file_describe_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert,
                                                     int chunk, char * buf, size_t size);

// bytes a buffer needs to receive any chunk of this file with ggml_zipmoe_file_read_chunk
// (the largest chunk rounded up to the alignment, as O_DIRECT reads whole blocks)
GGML_ZIPMOE_API size_t ggml_zipmoe_file_chunk_buffer_size(const struct ggml_zipmoe_file * file);

// read a chunk's stored bytes into buf (capacity >= ggml_zipmoe_file_chunk_buffer_size; with
// GGML_ZIPMOE_OPEN_DIRECT buf must be GGML_ZIPMOE_CHUNK_ALIGNMENT-aligned) and check its checksum.
// Returns OK, ERR_ARG, ERR_IO (failed or short read) or ERR_CHECKSUM. Thread-safe (pread).
GGML_ZIPMOE_API int ggml_zipmoe_file_read_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert,
                                                int chunk, void * buf, size_t capacity);

// reader: one per thread; owns a decoder and aligned buffers sized for its file, so reading
// an expert allocates nothing
struct ggml_zipmoe_reader;

GGML_ZIPMOE_API struct ggml_zipmoe_reader * ggml_zipmoe_reader_new (const struct ggml_zipmoe_file * file);
GGML_ZIPMOE_API void                        ggml_zipmoe_reader_free(struct ggml_zipmoe_reader * reader);

// read, check, decode and recover one expert's ne0*ne1 BF16 values into dst. On failure the
// status is returned and ggml_zipmoe_reader_error names the chunk and the reason.
GGML_ZIPMOE_API int ggml_zipmoe_read_expert(struct ggml_zipmoe_reader * reader, int tensor, int expert, uint16_t * dst);

// message of the reader's last failure ("" if none); valid until the reader's next call
GGML_ZIPMOE_API const char * ggml_zipmoe_reader_error(const struct ggml_zipmoe_reader * reader);

//
// expert cache: BF16 slots filled on demand from a ZipMoE GGUF, driven from inside a ggml graph
//
// The caller owns three slot tensors (gate, up, down), each [ne0, ne1, n_slots] BF16, shared by
// all layers. For a layer's top-k choice, ggml_zipmoe_cache_fetch makes the chosen experts
// resident (LRU over slots not needed by the current call) and returns slot ids to use in
// place of expert ids in ggml_mul_mat_id. When a ubatch selects more distinct experts than
// there are slots, the work is split in passes of at most n_slots experts each (experts in
// ascending id order); ggml_zipmoe_cache_merge_pass then picks every row from its own pass.
// The slots are filled bit-exactly, so the product is bit-identical to using the experts in place.
//

enum ggml_zipmoe_expert_kind {
    GGML_ZIPMOE_GATE = 0, // ffn_gate_exps
    GGML_ZIPMOE_UP   = 1, // ffn_up_exps
    GGML_ZIPMOE_DOWN = 2, // ffn_down_exps
};

struct ggml_zipmoe_cache_params {
    const struct ggml_zipmoe_file * file;           // must outlive the cache
    int32_t                         n_slots;        // experts resident at once (each: gate + up + down)
    void *                          slot_data[3];   // by kind: start of a [ne0, ne1, n_slots] BF16 tensor
    size_t                          slot_stride[3]; // by kind: bytes from one slot to the next (nb[2])
};

struct ggml_zipmoe_cache_stats {
    uint64_t fetch_calls;    // calls of ggml_zipmoe_cache_fetch (one per layer per pass)
    uint64_t expert_hits;    // (layer, expert) selections found resident
    uint64_t expert_misses;  // (layer, expert) selections read from the file
    uint64_t bytes_read;     // stored chunk bytes read
    uint64_t io_ns;          // time in reads (summed over threads)
    uint64_t decode_ns;      // time decoding E-chunks (summed over threads)
    uint64_t recover_ns;     // time recovering BF16 (summed over threads)
    uint64_t fetch_ns;       // wall time inside fetch calls
};

struct ggml_zipmoe_cache;

// checks that every repacked tensor of a kind has the slots' ne0 x ne1 shape and that each
// layer has all three kinds; on failure returns NULL with a message in err
GGML_ZIPMOE_API struct ggml_zipmoe_cache * ggml_zipmoe_cache_new(const struct ggml_zipmoe_cache_params * params,
                                                                 char * err, size_t err_size);
GGML_ZIPMOE_API void                       ggml_zipmoe_cache_free(struct ggml_zipmoe_cache * cache);

GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_n_slots(const struct ggml_zipmoe_cache * cache);

// 1 if the layer's routed experts are served by this cache
GGML_ZIPMOE_API int     ggml_zipmoe_cache_has_layer(const struct ggml_zipmoe_cache * cache, int layer);

// routed experts of the layer (n_expert)
GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_n_expert(const struct ggml_zipmoe_cache * cache, int layer);

// passes a graph needs for a ubatch of n_ids expert selections in this layer
GGML_ZIPMOE_API int     ggml_zipmoe_cache_n_passes(const struct ggml_zipmoe_cache * cache, int layer, int64_t n_ids);

// the body of a ggml custom op, called by every thread (ith in [0, nth)) of the graph with the same
// arguments: ids is [n_tokens][n_used] expert ids (row stride ids_stride elements); writes
// [n_tokens][n_used] slot ids (contiguous) for pass `pass`: selections outside this pass get a
// valid slot of the pass (their results are discarded by the merge). Blocks until the slots
// are filled. Returns OK or the first failure; ggml_zipmoe_cache_error names it.
GGML_ZIPMOE_API int ggml_zipmoe_cache_fetch(struct ggml_zipmoe_cache * cache, int layer, int pass,
                                            const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                                            int32_t * slot_ids, int ith, int nth);

// multi-pass merge (single-threaded): rows are row_bytes wide, laid out [n_tokens][n_used] with
// strides nb1 (between selections) and nb2 (between tokens) in acc, pass_out and out; out gets
// pass_out's row for selections handled by `pass`, acc's row for the others (acc may be NULL
// for pass 0, whose rows then come from pass_out too)
GGML_ZIPMOE_API void ggml_zipmoe_cache_merge_pass(const struct ggml_zipmoe_cache * cache, int layer, int pass,
                                                  const int32_t * ids, int64_t n_used, int64_t n_tokens,
                                                  int64_t ids_stride, const void * acc, const void * pass_out,
                                                  void * out, size_t row_bytes, size_t nb1, size_t nb2);

GGML_ZIPMOE_API void         ggml_zipmoe_cache_get_stats  (const struct ggml_zipmoe_cache * cache, struct ggml_zipmoe_cache_stats * stats);
GGML_ZIPMOE_API void         ggml_zipmoe_cache_reset_stats(struct ggml_zipmoe_cache * cache);

// message of the last failure ("" if none)
GGML_ZIPMOE_API const char * ggml_zipmoe_cache_error(const struct ggml_zipmoe_cache * cache);

#ifdef __cplusplus
}
#endif
