// ggml-zipmoe: lossless on-demand expert serving for BF16 Mixture-of-Experts models.
//
// The core public header: files, codecs and decoding, the expert cache and memory. Beside it:
//   ggml-zipmoe-policy.h   the scheduler, the pool planner and the opt-in lossy substitution
//   ggml-zipmoe-serving.h  the slots a process reserves and uses, and the default pools
//   ggml-zipmoe-options.h  the option table every surface derives from
//   ggml-zipmoe-test.h     entry points for the test suite and the benchmarks only
// llama.cpp (through our patch series) and the Python bindings (zipmoe_py/_lib.py, one ctypes
// declaration per function) use nothing but these. All functions are thread-safe on distinct objects,
// and an object's own rules are stated where they differ (a cache: one fetch at a time). The one
// process-wide setting is the BF16 recovery path, chosen once at first use; only the test-only
// ggml_zipmoe_set_recover_impl changes it.

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

// short, human-readable build description: version, compiler, the BF16 recovery paths compiled in
// ("recovery: avx512bw avx2 scalar" on x86-64, "recovery: scalar" elsewhere)
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

// the recovery path in use: "avx512bw", "avx2", "sve", "neon" or "scalar"
GGML_ZIPMOE_API const char * ggml_zipmoe_recover_impl(void);

// the recovery paths compiled in, best first, space-separated ("avx512bw avx2 scalar" on x86-64,
// "sve neon scalar" on AArch64); the first one this CPU has is used
GGML_ZIPMOE_API const char * ggml_zipmoe_recover_paths(void);


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
    GGML_ZIPMOE_CODEC_GHUF  = 6, // order-0 Huffman in independent 1024-value segments with offsets: decoded on
                                 // the GPU when slots are in CUDA memory (format version 2); level ignored
    GGML_ZIPMOE_CODEC_COUNT,
};

// codec name ("raw", "zstd", "lz4", "lz4hc", "huf", "fhuf", "ghuf"), or NULL for an unknown codec
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
// SM bytes into dst, shard by shard. Each shard decodes into the upper half of its own bytes of
// dst and is recovered in place while it is in cache: the library's one decode + recover routine,
// which the expert cache's workers and ggml_zipmoe_read_expert run too: the codec bench and
// zipmoe-profile's cost probe time the runtime's routine through this entry point.
GGML_ZIPMOE_API int ggml_zipmoe_decode_expert(struct ggml_zipmoe_decoder * dec, int n_shards, const int32_t * codecs,
                                              const void * const * chunks, const size_t * chunk_sizes,
                                              const uint8_t * sm, size_t n, uint16_t * dst);

// checksum of a stored chunk, as recorded in a ZipMoE GGUF: XXH64 with seed 0
GGML_ZIPMOE_API uint64_t ggml_zipmoe_checksum(const void * data, size_t n);

//
// ZipMoE GGUF files (docs/FORMAT.md): the chunk index and chunk reads
//

#define GGML_ZIPMOE_FORMAT_VERSION  3    // the newest zipmoe.format_version this library reads (1 to 3;
                                         // 2 adds codec ghuf, 3 raw experts of any ggml type)
#define GGML_ZIPMOE_CHUNK_ALIGNMENT 4096 // every chunk starts at a multiple of this file offset

enum ggml_zipmoe_open_flags {
    GGML_ZIPMOE_OPEN_DIRECT              = 1, // read chunks with O_DIRECT (bypasses the page cache); an
                                              // error where the filesystem does not support it
    GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED = 2, // O_DIRECT where the filesystem supports it, else plain reads
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
GGML_ZIPMOE_API int          ggml_zipmoe_file_is_direct(const struct ggml_zipmoe_file * file); // 1: reads use O_DIRECT
GGML_ZIPMOE_API int          ggml_zipmoe_file_n_shards (const struct ggml_zipmoe_file * file); // K
GGML_ZIPMOE_API int          ggml_zipmoe_file_n_tensors(const struct ggml_zipmoe_file * file); // repacked expert tensors
GGML_ZIPMOE_API size_t       ggml_zipmoe_file_max_chunk_size(const struct ggml_zipmoe_file * file); // largest stored chunk

// repacked tensor i (0 <= i < n_tensors): its GGUF name ("blk.3.ffn_up_exps.weight"), layer, ggml
// shape [ne0, ne1, n_expert] and the ggml type it is served as: BF16 (an expert's ne0*ne1 values
// split into its planes), or, from format version 3, any other type (F16, Q8_0, Q4_K, ...), whose
// experts are stored raw: their bytes as the source had them (nothing to decode). expert_bytes: one
// expert in that type (the bytes of its slot)
GGML_ZIPMOE_API const char * ggml_zipmoe_file_tensor_name (const struct ggml_zipmoe_file * file, int tensor);
GGML_ZIPMOE_API int          ggml_zipmoe_file_tensor_layer(const struct ggml_zipmoe_file * file, int tensor);
GGML_ZIPMOE_API void         ggml_zipmoe_file_tensor_shape(const struct ggml_zipmoe_file * file, int tensor, int64_t ne[3]);
GGML_ZIPMOE_API int          ggml_zipmoe_file_tensor_type (const struct ggml_zipmoe_file * file, int tensor);
GGML_ZIPMOE_API size_t       ggml_zipmoe_file_tensor_expert_bytes(const struct ggml_zipmoe_file * file, int tensor);

// index of the repacked tensor with this GGUF name, or -1
GGML_ZIPMOE_API int          ggml_zipmoe_file_find_tensor (const struct ggml_zipmoe_file * file, const char * name);

// chunk c of an expert: c = 0 is the SM-chunk, c = 1 + k is E-chunk (shard) k. A raw tensor's chunk 0
// holds the expert's bytes, and its E-chunks are empty.
struct ggml_zipmoe_chunk_info {
    uint64_t offset;       // absolute file offset of the stored bytes (multiple of GGML_ZIPMOE_CHUNK_ALIGNMENT)
    uint64_t size;         // stored bytes
    uint64_t first;        // index within the expert of the first value it covers
    uint64_t count;        // values it covers (= decoded bytes; a raw tensor's chunk 0: the expert's bytes)
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

// read, check, decode and recover one expert's ne0*ne1 BF16 values into dst (a raw tensor: its
// expert_bytes as stored). On failure the status is returned and ggml_zipmoe_reader_error names the
// chunk and the reason.
GGML_ZIPMOE_API int ggml_zipmoe_read_expert(struct ggml_zipmoe_reader * reader, int tensor, int expert, void * dst);

// message of the reader's last failure ("" if none); valid until the reader's next call
GGML_ZIPMOE_API const char * ggml_zipmoe_reader_error(const struct ggml_zipmoe_reader * reader);

//
// expert cache: BF16 slots filled on demand from a ZipMoE GGUF, driven from inside a ggml graph
//
// The caller owns three slot tensors (gate, up, down), each [ne0, ne1, n_slots] BF16, shared by
// all layers. For a layer's top-k choice, a fetch makes the chosen experts full in slots and
// returns slot ids to use in place of expert ids in ggml_mul_mat_id. When a ubatch selects more
// distinct experts than a pass holds, the work is split in passes (experts in ascending id order);
// ggml_zipmoe_cache_merge_pass then picks every row from its own pass. A pass holds as many
// experts as there are slots with one F pool, and as many as there are working slots with pools,
// so that a wide ubatch (a prompt, parallel sequences) never evicts F's experts. The slots are filled bit-exactly, so the product is bit-identical to using the
// experts in place.
//
// Pools (ZipMoE paper §3.2-3.4). Without pool capacities every slot belongs to one F pool and the
// eviction policy picks victims. With them (pool_capacity, experts per served layer), the cache
// keeps experts in four compression states: F (full BF16, in slots), C (SM-chunks + E-chunks),
// S (SM-chunks) and E (E-chunks), the last three in stores of fixed-size entries the cache
// allocates. Slots beyond F's capacity are working slots, where experts from C, S, E or the file
// are made full. After each use an expert goes to the first active pool p (order F, C, S, E) whose
// threshold tau_p = sum_{j <= p} pool_capacity[j] + rank_delta exceeds its runtime activation rank
// in its layer, LFU eviction inside a pool; beyond every threshold it is not kept. The reads and
// decompressions of a fetch follow the cache-affinity scheduler (ggml_zipmoe_schedule, ggml-zipmoe-policy.h) on a
// cost model of the rates in the params.
//
// Memory beyond the slots and stores: two rings of 8 staging buffers (SM-chunks: the largest
// tensor's n bytes; E-chunks: K times the largest E-chunk), one decoder per decoding thread,
// the scheduler's workspace, the I/O thread, the chunk index, and with prefetch_experts or
// lookahead_experts two prefetch banks of the larger's count of experts' stored chunks.
//

enum ggml_zipmoe_expert_kind {
    GGML_ZIPMOE_GATE = 0, // ffn_gate_exps
    GGML_ZIPMOE_UP   = 1, // ffn_up_exps
    GGML_ZIPMOE_DOWN = 2, // ffn_down_exps
};

// which resident expert a miss replaces (among slots the pass does not need)
#define GGML_ZIPMOE_EVICT_COUNT 6
enum ggml_zipmoe_eviction {
    GGML_ZIPMOE_EVICT_LRU     = 0, // least recently used
    GGML_ZIPMOE_EVICT_FIFO    = 1, // first filled
    GGML_ZIPMOE_EVICT_MARKING = 2, // randomized marking: a random unmarked slot; uses mark; all
                                   // marks clear when every candidate is marked
    GGML_ZIPMOE_EVICT_LFU     = 3, // least often chosen (runtime activation counts), ties LRU
    GGML_ZIPMOE_EVICT_RANK    = 4, // ZipMoE's dispatch (paper 3.4) for a single full pool: an expert
                                   // whose activation rank in its layer is not below the layer's
                                   // share of slots (n_slots / served layers) + rank_delta is evicted
                                   // first, after its use; LFU among the others. Pools need it.
    GGML_ZIPMOE_EVICT_SCORE   = 5, // SMoE's score-based eviction (its 5.3): the expert with the lowest mean
                                   // gate score over its layer's last GGML_ZIPMOE_SCORE_WINDOW iterations
                                   // (every expert's score, chosen or not: ggml_zipmoe_cache_observe_scores),
                                   // ties LRU; the experts a pass uses are shielded (never its victims)
};

#define GGML_ZIPMOE_SCORE_WINDOW 16 // iterations (a layer's ubatches) EVICT_SCORE averages over

// the cache hierarchy, in order (index of ggml_zipmoe_cache_params.pool_capacity)
#define GGML_ZIPMOE_POOL_COUNT 4
enum ggml_zipmoe_pool {
    GGML_ZIPMOE_POOL_F = 0, // full BF16 experts, in slots
    GGML_ZIPMOE_POOL_C = 1, // SM-chunks and E-chunks
    GGML_ZIPMOE_POOL_S = 2, // SM-chunks
    GGML_ZIPMOE_POOL_E = 3, // E-chunks
};

// the rates of the scheduler's cost model (ggml_zipmoe_cache_params.rate_*)
enum ggml_zipmoe_rate {
    GGML_ZIPMOE_RATE_READ    = 0, // chunk reads (O_DIRECT), stored bytes per second
    GGML_ZIPMOE_RATE_DECODE  = 1, // decode + recovery, BF16 output bytes per second per thread
    GGML_ZIPMOE_RATE_COMPUTE = 2, // an expert's products, BF16 weight bytes per second per token
    GGML_ZIPMOE_RATE_TOUCH   = 3, // first writes of new memory (page faults, zeroing), bytes per second per
                                  // thread: the default, not measured (no params field)
};

// names and defaults the library owns; the llama.cpp glue and the Python layer read them from here
GGML_ZIPMOE_API const char * ggml_zipmoe_eviction_name(int eviction); // "lru", "fifo", "marking", "lfu", "rank", "score"; NULL
GGML_ZIPMOE_API const char * ggml_zipmoe_pool_name(int pool);         // "F", "C", "S", "E"; NULL if unknown
GGML_ZIPMOE_API double       ggml_zipmoe_default_rate(int rate);      // enum ggml_zipmoe_rate: bytes per second; 0 if unknown

// where a cache's slots live. CUDA: slot_data are device pointers (a build with ZIPMOE_CUDA=ON);
// reads stay on the CPU; a decoding thread decodes a shard's exponents (codec ghuf: copies its
// stored E-chunk, and a kernel decodes it on the GPU), copies its planes to the GPU, where a kernel
// interleaves them into BF16 in the slot (docs/CUDA.md)
// DEVICE: slot_data are addresses in any other memory (a ggml backend's buffer: Vulkan, Metal, an
// rpc-server's), never touched by the library: a decoding thread decodes and recovers a shard in host
// staging and hands it to slot_write; each thread calls slot_sync once its writes of a fetch are done
enum ggml_zipmoe_slot_memory {
    GGML_ZIPMOE_SLOTS_HOST   = 0,
    GGML_ZIPMOE_SLOTS_CUDA   = 1,
    GGML_ZIPMOE_SLOTS_DEVICE = 2,
};

// CUDA devices this build can put slots on (0: built without CUDA, or none present)
GGML_ZIPMOE_API int ggml_zipmoe_cuda_devices(void);

struct ggml_zipmoe_cache_params {
    const struct ggml_zipmoe_file * file;           // must outlive the cache
    int32_t                         n_slots;        // slots the slot tensors hold (each: gate + up + down);
                                                    // all in use until ggml_zipmoe_cache_set_n_slots
    void *                          slot_data[3];   // by kind: start of a [ne0, ne1, n_slots] BF16 tensor
    size_t                          slot_stride[3]; // by kind: bytes from one slot to the next (nb[2])
    int32_t                         n_decoders;     // graph threads that decode in fetch_end (0: all of them)
    int32_t                         eviction;       // enum ggml_zipmoe_eviction (llama.cpp's default: RANK)
    int32_t                         rank_delta;     // GGML_ZIPMOE_EVICT_RANK's tolerance margin delta (>= 0)
    int32_t                         pool_capacity[4]; // experts per served layer in F, C, S, E (all 0: one
                                                      // F pool of every slot); F's must leave a working slot
    double                          rate_read;      // scheduler cost model, bytes per second (0: measured, see
                                                    //   ggml_zipmoe_cache_rate):
    double                          rate_decode;    //   reads, decode + recovery of BF16 output per thread,
    double                          rate_compute;   //   an expert's products per token (its BF16 weight bytes)
    int32_t                         n_layer;        // layers of layer_tensors
    const int32_t *                 layer_tensors;  // [n_layer][3]: the repacked tensor index (ggml_zipmoe_file_find_tensor)
                                                    // of each layer's gate, up and down experts; -1 x 3 for a layer
                                                    // the cache does not serve (the caller knows the model's names)
    int32_t                         prefetch_experts; // experts a prefetch may read ahead (0: no prefetch; see
                                                      // ggml_zipmoe_cache_prefetch)
    int32_t                         slot_memory;    // enum ggml_zipmoe_slot_memory: where slot_data points
    // a raw (non-BF16) expert's bytes into its slot: NULL copies them into slot memory; else this is
    // called with them, from graph threads, concurrently (a backend's set_tensor: ggml-cpu's repacking
    // buffer types lay weights out their own way). Returns 0, or nonzero with a message in err.
    int (*slot_fill)(void * user_data, int kind, int tensor, int32_t slot, const void * data, size_t size, char * err,
                     size_t err_size);
    void * slot_fill_data;                          // user_data of slot_fill, slot_write and slot_sync
    // GGML_ZIPMOE_SLOTS_DEVICE: size bytes of tensor's expert into slot, offset bytes into it. Called from
    // graph threads, concurrently; data may be reused once it returns (copy it, or finish with it).
    // Returns 0, or nonzero with a message in err. slot_sync: the calling thread's writes are in the
    // slots (NULL: nothing to wait for).
    int (*slot_write)(void * user_data, int kind, int tensor, int32_t slot, size_t offset, const void * data,
                      size_t size, char * err, size_t err_size);
    int (*slot_sync)(void * user_data, char * err, size_t err_size);
    // experts of a layer's next pass read ahead, into the prefetch's banks, while this pass decodes and
    // computes (0: none). A pass holds as many experts as there are working slots; a ubatch whose
    // experts take more (a prompt, several sequences) runs in passes, whose ids are all known at the
    // first: what the next pass lacks is read while the disk would otherwise wait
    int32_t lookahead_experts;
    // nonzero: host slot_data lie in a private anonymous mapping (mmap) of the caller's, which it unmaps
    // whole. A change of pools may then move the pages of the store entries it gives up into the slots it
    // fills (Linux 5.7+), instead of giving them back while those slots fault new pages in, and gives the
    // pages of the slots it gives up back itself, before its stores grow. 0 for memory from malloc, or a
    // buffer someone else maps
    int32_t slot_pages_movable;
};

struct ggml_zipmoe_cache_stats {
    uint64_t fetch_calls;    // fetches begun (ggml_zipmoe_cache_fetch_begin: one per layer per pass)
    uint64_t expert_hits;    // (layer, expert) selections found full in a slot
    uint64_t expert_misses;  // (layer, expert) selections found nowhere (read from the file)
    uint64_t bytes_read;     // stored chunk bytes read
    uint64_t io_ns;          // time in reads (summed over threads)
    uint64_t decode_ns;      // time decoding E-chunks (summed over threads)
    uint64_t recover_ns;     // time recovering BF16 (summed over threads)
    uint64_t fetch_ns;       // wall time of thread 0 inside fetch begin and end (what the graph waits)
    uint64_t c_hits;         // selections found in pool C (no read)
    uint64_t s_hits;         // selections found in pool S (E-chunks read)
    uint64_t e_hits;         // selections found in pool E (SM-chunks read)
    uint64_t prefetch_hits;       // selections not in a slot whose missing chunks a prefetch had read (all or some)
    uint64_t prefetch_bytes_read; // stored bytes prefetches and next-pass read-aheads read (also in bytes_read)
    uint64_t prefetch_bytes_used; // of those, bytes a fetch used (the rest were mispredicted: wasted)
    uint64_t h2d_bytes;           // bytes copied host to device (slots in CUDA memory: SM + exponent planes;
                                  // GGML_ZIPMOE_SLOTS_DEVICE: what slot_write was given)
    uint64_t substitutions;       // LOSSY: selections a substitution policy replaced with another expert
    uint64_t substitution_tokens; // tokens (per MoE layer) the substitution policy routed
    // where fetch_ns went, on thread 0 (the graph's critical path); the five add up to fetch_ns:
    uint64_t lock_wait_ns;        //   waiting for the cache (another context's fetch, a preload)
    uint64_t plan_ns;             //   planning the pass, the schedule (Algorithm 1), posting the reads
    uint64_t fetch_work_ns;       //   thread 0's own decoding, recovery and slot writes
    uint64_t read_wait_ns;        //   thread 0 with nothing to decode: waiting for chunks to be read (or
                                  //   for another thread's last shards)
    uint64_t finish_wait_ns;      //   waiting for the other threads' shards, the I/O thread, device syncs
    uint64_t decode_faults;       // minor page faults in the decoding threads while fetching (slot pages
                                  // touched for the first time, or again after being given back)
    uint64_t graph_ns;            // wall time of the graphs that fetched (ggml_zipmoe_cache_count_graph):
    uint64_t graphs;              //   graph_ns - fetch_ns is the rest of their compute
    uint64_t preload_experts;     // experts ggml_zipmoe_cache_preload filled (counted in no fetch counter above;
    uint64_t preload_bytes_read;  //   their bytes sent to a device are in h2d_bytes) and the stored bytes it read
    uint64_t populate_bytes;      // store pages a helper thread faulted in ahead of their first write (bytes),
    uint64_t populate_ns;         //   and its wall time in those calls (preempted time included: on a small
                                  //   machine it shares the cores with the graph threads)
    uint64_t migrate_experts;     // experts a change of pools decoded from C into F (set_pools_migrating;
    uint64_t migrate_ns;          //   in no fetch counter above), and the wall time of those changes
    uint64_t moved_page_bytes;    // store pages such changes moved into the slots they filled (slot_pages_movable):
                                  //   first writes those slots did not make
    uint64_t cpu_experts;         // experts the CPU-load balancer gave to the CPU (ggml_zipmoe_cache_set_cpu_slots):
                                  //   recovered in host memory and computed there, not copied to the device
    uint64_t device_experts;      // experts copied into slots outside host memory, and the time that took
    uint64_t device_ns;           //   beyond a host slot's (slot writes, CUDA copies and kernels, syncs; summed
                                  //   over threads): the balancer's measured cost of loading one, kept since
                                  //   the cache was made (a reset leaves them)
};

struct ggml_zipmoe_cache;

// checks that every tensor of a kind in layer_tensors has one ne0 x ne1 shape (the slots') and
// that each layer has all three kinds or none; on failure returns NULL with a message in err
GGML_ZIPMOE_API struct ggml_zipmoe_cache * ggml_zipmoe_cache_new(const struct ggml_zipmoe_cache_params * params,
                                                                 char * err, size_t err_size);
GGML_ZIPMOE_API void                       ggml_zipmoe_cache_free(struct ggml_zipmoe_cache * cache);

// the caller's graph that ran this cache's fetches took ns of wall time (build, fetches and compute):
// graph_ns and graphs of the statistics, so that they account for a token's whole time
GGML_ZIPMOE_API void ggml_zipmoe_cache_count_graph(struct ggml_zipmoe_cache * cache, uint64_t ns);

// slots in use (the first n of the slot tensors' params.n_slots), and how many the tensors hold
GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_n_slots(const struct ggml_zipmoe_cache * cache);
GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_slot_capacity(const struct ggml_zipmoe_cache * cache);

// use the first n_slots slots only (1 <= n_slots <= capacity; with pools, more than F's slots):
// experts held in the slots given up are forgotten, so the caller may release their memory (the
// cache never touches a slot beyond n_slots); slots taken on start empty. With one F pool, RANK's
// per-layer share follows. No fetch of another thread may be open, and ggml_zipmoe_cache_n_passes
// changes: graphs built for the old count must be rebuilt. Returns OK or ERR_ARG (message in
// ggml_zipmoe_cache_error).
GGML_ZIPMOE_API int     ggml_zipmoe_cache_set_n_slots(struct ggml_zipmoe_cache * cache, int32_t n_slots);

// reconfigure the pools (what ggml_zipmoe_cache_params.pool_capacity sets at creation) and the slots
// in use: capacity[4] experts per served layer in F, C, S, E (all 0: one F pool of every slot in
// use), n_slots as in ggml_zipmoe_cache_set_n_slots (with pools, more than F's). The stores keep
// the entries that still fit them, experts in the slots given up are forgotten (with
// slot_pages_movable, their pages given back before the stores grow), a pending prefetch is dropped.
// inclusive (with C holding every expert of a layer): an F expert keeps its C entry as well, so
// that one leaving F is never read again. No fetch of another thread may be open; graphs built
// for the old slot count must be rebuilt. OK, ERR_ARG or ERR_NOMEM (then one F pool of n_slots
// slots; the message in ggml_zipmoe_cache_error).
GGML_ZIPMOE_API int     ggml_zipmoe_cache_set_pools(struct ggml_zipmoe_cache * cache, const int32_t * capacity,
                                                    int32_t n_slots, int inclusive);

// ggml_zipmoe_cache_set_pools, and then the experts the new pools send to F that C or S holds (and no
// slot) and that were used more than once are decoded from their entries into slots on n_threads
// threads of its own (the calling thread one of them), instead of being dropped and read again on their
// next use: a change from C to F costs decoding from memory, not reads; from S to F, reading the
// E-chunks only (counted in bytes_read). One used once (a prompt selects most experts once) is dropped:
// its next use, if any, reads it. Memory stays within the pools': C and S first shrink to what the new
// pools keep plus those experts, give each entry's pages back once its expert is in a slot, then shrink
// to their new sizes. Only for slots in host memory written by the cache (else, and with
// n_threads 0, it is set_pools). The fills count in no fetch counter and no activation; statistics
// migrate_experts and migrate_ns count them. *n_migrated (may be NULL) gets the experts moved. Returns
// as set_pools; a fill that fails stops the migration (its message in ggml_zipmoe_cache_error, the
// status OK: the rest are read on their next use).
GGML_ZIPMOE_API int     ggml_zipmoe_cache_set_pools_migrating(struct ggml_zipmoe_cache * cache, const int32_t * capacity,
                                                              int32_t n_slots, int inclusive, int n_threads,
                                                              int32_t * n_migrated);


// host memory the cache allocates besides the slots, once it has fetched with n_threads graph
// threads: the C, S, E stores, the staging rings, the decoders and the bookkeeping
GGML_ZIPMOE_API size_t  ggml_zipmoe_cache_extra_bytes(const struct ggml_zipmoe_cache * cache, int n_threads);

// experts pool p (enum ggml_zipmoe_pool) holds over all layers, and the bytes of one (a slot for
// F, a store entry for C, S, E); -1 for an unknown pool
GGML_ZIPMOE_API int     ggml_zipmoe_cache_pool_entries(const struct ggml_zipmoe_cache * cache, int pool,
                                                       size_t * entry_bytes);

// 1 if the layer's routed experts are served by this cache
GGML_ZIPMOE_API int     ggml_zipmoe_cache_has_layer(const struct ggml_zipmoe_cache * cache, int layer);

// the slot s such that every expert e of the layer is full in slot s + e (the order a preload of a
// budget that holds them all leaves), or -1 (another order, one missing, or a fetch open). With no
// eviction possible (every expert resident), a graph may then use slots s .. s + n_expert - 1 in
// place of the layer's experts, with no fetch (llama.cpp's zipmoe.resident_views).
GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_resident_base(struct ggml_zipmoe_cache * cache, int layer);

// routed experts of the layer (n_expert)
GGML_ZIPMOE_API int32_t ggml_zipmoe_cache_n_expert(const struct ggml_zipmoe_cache * cache, int layer);

// passes a graph needs for a ubatch of n_ids expert selections in this layer (see above: with
// pools, passes of as many experts as there are working slots)
GGML_ZIPMOE_API int     ggml_zipmoe_cache_n_passes(const struct ggml_zipmoe_cache * cache, int layer, int64_t n_ids);

// the slot id of a selection that a pass does not compute (see ggml_zipmoe_cache_fetch_begin)
#define GGML_ZIPMOE_NO_SLOT (-1)

// A fetch makes the experts a layer's router chose resident, in two steps so that the disk
// reads overlap the graph's other work (the shared expert):
// ggml_zipmoe_cache_fetch_begin (one thread): ids is [n_tokens][n_used] expert ids (row stride
// ids_stride elements); writes [n_tokens][n_used] slot ids (contiguous) for pass `pass`:
// selections outside this pass get GGML_ZIPMOE_NO_SLOT, which the patched ggml-cpu mul_mat_id
// skips (their rows are left alone and dropped by the merge), so that a pass computes its rows only. Starts the cache's I/O thread on the missing chunks and returns. It takes the cache's
// lock, which the matching ggml_zipmoe_cache_fetch_end releases: call both from the same thread,
// in pairs (a begin not followed by its end, e.g. after a graph abort, is drained by that
// thread's next begin).
// ggml_zipmoe_cache_fetch_end: the body of a ggml custom op, called by every thread (ith in
// [0, nth)) of the graph; the first n_decoders threads decode and recover the chunks (read and
// checked by the I/O thread, or kept in a store) into the slots. Returns when the slots are
// filled: OK or the first failure of the fetch, which ggml_zipmoe_cache_error names.
GGML_ZIPMOE_API int ggml_zipmoe_cache_fetch_begin(struct ggml_zipmoe_cache * cache, int layer, int pass,
                                                  const int32_t * ids, int64_t n_used, int64_t n_tokens,
                                                  int64_t ids_stride, int32_t * slot_ids);
GGML_ZIPMOE_API int ggml_zipmoe_cache_fetch_end(struct ggml_zipmoe_cache * cache, int ith, int nth);

// Experts computed where they are held (SMoE Algorithm 2; opt-in, llama.cpp's zipmoe.cpu_compute), for
// slots outside host memory (CUDA, or slot_write): host memory for n_slots experts, by kind a [ne0, ne1,
// n_slots] tensor at data[k], slot stride stride[k], where a fetch begun with cpu_ids recovers the missing
// experts that the CPU-load balancer (ggml_zipmoe_balance_cpu_load) gives to the CPU instead of copying
// them to the device. t_cpu: seconds the CPU takes for one expert's products of one token (the caller
// measures it). The device's cost is measured by the fetches (device_ns / device_experts of the
// statistics); until one expert has been copied, every missing expert is. An expert given to the CPU
// takes no device slot; what it was read from is kept in the stores as a miss's is. n_slots 0 turns it
// off. No fetch may be open. OK or ERR_ARG (message in ggml_zipmoe_cache_error).
GGML_ZIPMOE_API int ggml_zipmoe_cache_set_cpu_slots(struct ggml_zipmoe_cache * cache, void * const data[3],
                                                    const size_t stride[3], int32_t n_slots, double t_cpu);

// ggml_zipmoe_cache_fetch_begin, which with cpu_ids (NULL: none) may give missing experts to the CPU
// (ggml_zipmoe_cache_set_cpu_slots): cpu_ids gets [n_tokens][n_used] the CPU slot of each selection the
// CPU computes (its slot_ids entry is then GGML_ZIPMOE_NO_SLOT), GGML_ZIPMOE_NO_SLOT for the rest
GGML_ZIPMOE_API int ggml_zipmoe_cache_fetch_begin_cpu(struct ggml_zipmoe_cache * cache, int layer, int pass,
                                                      const int32_t * ids, int64_t n_used, int64_t n_tokens,
                                                      int64_t ids_stride, int32_t * slot_ids, int32_t * cpu_ids);

// abandon a fetch that this thread began and did not end (a graph stopped between the two ops):
// its reads stop and the slots and entries it planned are forgotten. Returns 1 if there was one.
GGML_ZIPMOE_API int ggml_zipmoe_cache_cancel(struct ggml_zipmoe_cache * cache);

// fill the empty slots in use with experts, each served layer up to its share of them (F's
// capacity / served layers), experts in id order, read on the I/O thread and decoded on n_threads
// threads of its own (the calling thread one of them): what a memory-mapped model's populate does for
// its weights, done once before serving so that the first tokens do not wait on the disk for them.
// Only where that leaves every expert of every served layer in a slot (or, where C keeps every
// expert, in a slot or C); otherwise it loads nothing (*n_loaded 0): a prompt reads nearly every
// expert anyway, and guesses made before any activation was counted are evicted unused.
// Statistics and activation counts are left as they were. Returns OK or the first failure (then
// ggml_zipmoe_cache_error names the chunk; the experts before it stay loaded); *n_loaded (may be
// NULL) gets the experts loaded.
GGML_ZIPMOE_API int ggml_zipmoe_cache_preload(struct ggml_zipmoe_cache * cache, int n_threads, int32_t * n_loaded);

// EVICT_SCORE's input: the router's scores of one iteration of the layer, [n_tokens][n_expert] (row
// stride in elements; every expert's, after the gating function), averaged over the tokens; call
// before the iteration's fetch. A no-op for the other policies. OK or ERR_ARG.
GGML_ZIPMOE_API int ggml_zipmoe_cache_observe_scores(struct ggml_zipmoe_cache * cache, int layer, const float * scores,
                                                     int64_t n_expert, int64_t n_tokens, int64_t stride);


// multi-pass merge (single-threaded): rows are row_bytes wide, laid out [n_tokens][n_used] with
// strides nb1 (between selections) and nb2 (between tokens) in acc, pass_out and out; out gets
// pass_out's row for selections handled by `pass`, acc's row for the others (acc may be NULL
// for pass 0, whose rows then come from pass_out too). Returns OK, ERR_ARG or ERR_NOMEM.
GGML_ZIPMOE_API int  ggml_zipmoe_cache_merge_pass(const struct ggml_zipmoe_cache * cache, int layer, int pass,
                                                  const int32_t * ids, int64_t n_used, int64_t n_tokens,
                                                  int64_t ids_stride, const void * acc, const void * pass_out,
                                                  void * out, size_t row_bytes, size_t nb1, size_t nb2);

GGML_ZIPMOE_API void         ggml_zipmoe_cache_get_stats  (const struct ggml_zipmoe_cache * cache, struct ggml_zipmoe_cache_stats * stats);
GGML_ZIPMOE_API void         ggml_zipmoe_cache_reset_stats(struct ggml_zipmoe_cache * cache);

// the statistics above, and the slots in use and reserved, as Prometheus text (metrics named
// zipmoe:NAME) written to buf like snprintf: at most size bytes with the terminating NUL; returns the
// length the whole text needs (0 for a NULL cache). Safe while other threads fetch.
GGML_ZIPMOE_API size_t       ggml_zipmoe_cache_format_metrics(const struct ggml_zipmoe_cache * cache, char * buf, size_t size);

// the rate (enum ggml_zipmoe_rate, bytes per second) the scheduler's cost model uses now: the params'
// rate when one was given; else, for reads and decodes, the running average of this cache's own
// fetches (stored bytes over read time; BF16 bytes over decode + recovery time per thread, from
// fetches whose decoding threads took no page faults), the default until a fetch has measured it.
// Compute stays the params' or the default (the products run in the graph, where the cache does not
// time them); touch is the default. 0 if cache is NULL or rate unknown.
GGML_ZIPMOE_API double       ggml_zipmoe_cache_rate(const struct ggml_zipmoe_cache * cache, int rate);

// where that rate comes from now: -1 if cache is NULL or rate unknown
enum ggml_zipmoe_rate_origin {
    GGML_ZIPMOE_RATE_GIVEN    = 0, // the params'
    GGML_ZIPMOE_RATE_DEFAULT  = 1, // the built-in default (ggml_zipmoe_default_rate): not measured (yet)
    GGML_ZIPMOE_RATE_MEASURED = 2, // this cache's own fetches
};
GGML_ZIPMOE_API int          ggml_zipmoe_cache_rate_origin(const struct ggml_zipmoe_cache * cache, int rate);

// Prefetch (SMoE §5.2's top-score prediction, lossless): the caller predicts the experts of a layer
// before its router runs (its gate applied to an earlier hidden state) and hands them here; the I/O
// thread reads the chunks the cache lacks for them into a prefetch buffer when it has no fetch's
// reads to do, stopping after the read in progress whenever a fetch begins, so that a layer's true
// misses always go first. That layer's fetch takes what was read like a store hit (no read) and
// reads the rest; what was read for experts the router did not choose is dropped (wasted). Only
// reads are done ahead: decoding stays in the fetch, on the graph's threads, which are busy with
// the products meanwhile. Routing and arithmetic are unchanged, so results are bit-identical with
// or without it. Two buffers of params.prefetch_experts experts alternate, so that one prefetch can
// be read while the previous one is used.
// ids is [n_tokens][n_used] predicted expert ids (row stride ids_stride); the distinct ones are
// taken in order, up to prefetch_experts of those the cache lacks. Call it from the thread that
// runs the fetches, between them or while one it began is open (the graph's thread 0). Returns OK,
// or ERR_ARG (a layer not served, an id out of range, prefetch off): nothing is prefetched then.
GGML_ZIPMOE_API int ggml_zipmoe_cache_prefetch(struct ggml_zipmoe_cache * cache, int layer, const int32_t * ids,
                                               int64_t n_used, int64_t n_tokens, int64_t ids_stride);

// how well prefetches predicted a layer's experts (layer -1: all layers), counted at the layer's
// first pass of each ubatch that had a prediction: predicted = distinct experts predicted, actual =
// distinct experts the router chose, correct = both (recall = correct / actual). Returns OK or ERR_ARG.
GGML_ZIPMOE_API int ggml_zipmoe_cache_get_prefetch_recall(const struct ggml_zipmoe_cache * cache, int layer,
                                                          uint64_t * predicted, uint64_t * actual, uint64_t * correct);

// profiling (zipmoe-profile): counts[e] = ubatches whose router chose expert e in this layer
// (counts has ggml_zipmoe_cache_n_expert entries), n_ubatches = ubatches the layer ran; since
// the cache was made or its statistics reset. Returns OK, or ERR_ARG for a layer not served.
GGML_ZIPMOE_API int          ggml_zipmoe_cache_get_activations(const struct ggml_zipmoe_cache * cache, int layer,
                                                               uint64_t * counts, uint64_t * n_ubatches);

// the same token by token: even[e] / odd[e] = the layer's even / odd tokens (counted in the order its
// ubatches ran) whose router chose expert e, n_tokens = the tokens the layer ran (even ones:
// (n_tokens + 1) / 2); since the cache was made or its statistics reset. A re-plan ranks the experts
// by one half and reads the probabilities from the other. Returns OK, or ERR_ARG for a layer not served.
GGML_ZIPMOE_API int          ggml_zipmoe_cache_get_selections(const struct ggml_zipmoe_cache * cache, int layer,
                                                              uint64_t * even, uint64_t * odd, uint64_t * n_tokens);

// message of the last failure ("" if none)
GGML_ZIPMOE_API const char * ggml_zipmoe_cache_error(const struct ggml_zipmoe_cache * cache);

//
// memory available to this process, for sizing the expert cache
//
// The limit that applies to a process is the lowest of MemAvailable (/proc/meminfo) and, for its
// own memory cgroup and each ancestor that has a limit (cgroup v2: memory.max and memory.high;
// v1: memory.limit_in_bytes, and hierarchical_memory_limit for ancestors outside the mounted
// tree), what that limit leaves free: limit - (usage - reclaimable page cache). The cgroups are
// found through /proc/self/cgroup and /proc/self/mountinfo, so nested cgroups and containers
// (whose mount shows a subtree) are handled.
//

struct ggml_zipmoe_memory {
    uint64_t available;        // bytes this process may still take: min(mem_available, cgroup headroom)
    uint64_t mem_available;    // MemAvailable (UINT64_MAX when /proc/meminfo cannot be read)
    uint64_t cgroup_limit;     // limit of the cgroup leaving the least headroom (UINT64_MAX: none)
    uint64_t cgroup_used;      // that cgroup's usage beyond reclaimable page cache
    int32_t  cgroup_version;   // 1 or 2 for that cgroup; 0 when no cgroup limit applies
    char     cgroup_path[512]; // that cgroup's folder ("" when none)
};

// fills *mem; root prefixes every path read ("" or NULL: the real /proc and /sys; test-only: a
// folder holding proc/self/cgroup, proc/self/mountinfo, proc/meminfo and the mounted cgroup files).
// Returns OK, or ERR_IO when not even MemAvailable could be read (available is then UINT64_MAX).
GGML_ZIPMOE_API int ggml_zipmoe_memory_available(const char * root, struct ggml_zipmoe_memory * mem);

#ifdef __cplusplus
}
#endif
