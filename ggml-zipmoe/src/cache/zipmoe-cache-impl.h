// The expert cache's state, shared by its source files (not part of the public API):
//
//   zipmoe-cache.c      lifecycle, the public queries, the multi-pass merge
//   zipmoe-stats.c      statistics: the counters, their reset, the account of a fetch's time
//   zipmoe-preload.c    the slots filled before serving
//   zipmoe-migrate.c    a change of pools that moves experts from C or S to F: decoded from their entries
//   zipmoe-residency.c  what is where: slots, eviction policies, and the plan of a pass (hits,
//                       victims, one task per expert tensor to fill)
//   zipmoe-stores.c     the C/S/E stores: rank dispatch, their entries, their sizes at a re-plan
//   zipmoe-fetch.c      how it gets there: the scheduler's order, the decoding threads (the one
//                       decode + recover routine of zipmoe-codec.c)
//   zipmoe-fetch-device.c  shards into slots outside host memory: CUDA's kernels, or a caller's
//                       device (any ggml backend) through slot_write
//   zipmoe-fetch-io.c   the I/O thread and the staging rings it reads into
//   zipmoe-prefetch.c   reads ahead for predicted experts, and what a fetch takes from them
//   zipmoe-substitution-hook.c  the public calls of the lossy policy (lossy/), forwarded to c->subst
//   zipmoe-pool-view.c  what the default pools (policy/zipmoe-default-pools.c) read of the cache
//
// The cache calls policy/ (Algorithm 1 for the fetch's order, the default rates, the default pools on
// the view it fills); policy/ never sees the cache's struct.
//
// A cache is one struct of sub-structs by concern; each file owns the sub-structs named above it.

#pragma once

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-policy.h"
#include "ggml-zipmoe-test.h"
#include "gpu/zipmoe-gpu.h"
#include "common/zipmoe-impl.h"
#include "lossy/zipmoe-substitution.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

// a spinning waiter's hint to the core
#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define ZIPMOE_PAUSE() _mm_pause()
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#    define ZIPMOE_PAUSE() __asm__ __volatile__("yield" ::: "memory")
#else
#    define ZIPMOE_PAUSE() ((void) 0)
#endif

#define ZIPMOE_MAX_THREADS   256
#define ZIPMOE_N_STAGING     8         // buffers per ring: SM-chunks, and each task's K E-chunks
#define ZIPMOE_DECODER_BYTES (1u << 20) // a decoder's codec state (zstd's context is the largest), rounded up

// staging buffer states
enum { STAGE_FREE = 0, STAGE_BUSY = 1 };

// where a rate of the cost model comes from

// the shard operations of the decompression list
enum { OP_TODO = 0, OP_CLAIMED = 1, OP_DECODED = 2, OP_DONE = 3 };

// stored chunks read by the I/O thread: one task's SM-chunk, or its K E-chunks
struct zipmoe_staging {
    uint8_t *  mem;   // aligned for O_DIRECT
    uint64_t   base;  // E ring: file offset at mem when the E-chunks were read in one span, else UINT64_MAX
    atomic_int state; // STAGE_FREE or STAGE_BUSY
};

// per graph thread: a decoder, made on first use
struct zipmoe_worker {
    struct ggml_zipmoe_decoder * decoder;
    uint16_t *                   staging; // slots in a caller's device memory: a shard recovered here, then written
};

// one expert tensor to make full in a slot
struct zipmoe_task {
    int32_t         slot;      // of the device's slots, or of the CPU's (on_cpu)
    int32_t         on_cpu;    // recovered into a CPU slot (zipmoe_cpu_slots) for the CPU to compute
    int32_t         kind;
    int32_t         tensor;
    int32_t         expert;
    int32_t         state;     // enum ggml_zipmoe_expert_state: M, C, S or E
    const uint8_t * sm_src;    // the SM-chunk kept in a store (states C, S), else NULL: read
    const uint8_t * e_src;     // the E-chunks kept in a store, back to back (C, E), else NULL: read
    uint8_t *       sm_dst;    // keep the SM-chunk here after use (dispatch to C or S), or NULL
    uint8_t *       e_dst;     // keep the E-chunks here, back to back (dispatch to C or E), or NULL
    int32_t         dst_pool;  // the store entry of sm_dst/e_dst (forgotten if the fill fails)
    int32_t         dst_entry;
    atomic_int      sm_buf;    // staging buffer holding the read SM-chunk (-1: not yet)
    atomic_int      e_buf;     // staging buffer holding the read E-chunks (-1: not yet)
    atomic_int      n_decoded; // shards decoded
    atomic_int      n_recovered;
    atomic_int      sm_check;  // enum zipmoe_check: the read SM-chunk's checksum, checked by a decoding thread
};

// a read chunk's checksum is checked by the decoding thread that first uses it, not by the I/O thread:
// there it took 6.6 of 23 s of a quantized model's fetches (xxh64 at 5.9 GB/s from memory, after each
// read), time the disk stood idle. An E-chunk is one shard's alone; an SM-chunk, all K shards'.
enum zipmoe_check { CHECK_TODO = 0, CHECK_CLAIMED = 1, CHECK_DONE = 2 };

// a store of pool C, S or E: fixed-size entries, each one expert's kept chunks (gate, up, down)
struct zipmoe_store {
    size_t     entry_size;
    int32_t    n_entries;
    uint8_t *  mem;
    int64_t *  entry_key;      // [n_entries] (layer * max_expert + expert), or -1
    uint64_t * entry_pinned;   // [n_entries] serial of the last call reading or writing it
    uint64_t * entry_last_use; // [n_entries] tick (LFU ties)
    pthread_t  populator;      // faults new entries' pages in (zipmoe-stores.c: populate_async)
    int        populating;
    atomic_int populate_halt;  // set: the populator stops after its current piece
    size_t     populated_to;   // bytes [populated_to, populate_end) of mem are left to fault in
    size_t     populate_end;
    size_t     populate_want;  // bytes the populator goes up to for now: a window past the entries taken
    size_t     populate_window;
    int        taken;          // an entry was taken since the store was made: the populator keeps to the window
    pthread_mutex_t populate_mutex; // guards populate_want and populate_halt's wake-up
    pthread_cond_t  populate_wake;
    struct zipmoe_counters * counters; // where the populator adds its bytes and time
};

// the served experts' geometry, fixed when the cache is made. A key is layer * max_expert + expert.
struct zipmoe_layout {
    int       n_layer;        // layers indexable (max layer + 1)
    int32_t * layer_tensor;   // [n_layer][3] repacked tensor index by kind, -1 when not served
    int32_t * layer_n_expert; // [n_layer]
    int32_t   max_expert;     // largest n_expert over layers
    int32_t   n_served;       // layers served
    uint64_t  kind_n[3];      // bytes of one expert tensor's SM-chunk (its values; a raw tensor's bytes), by
                              // kind the largest over the layers
    uint64_t  kind_bytes[3];  // one expert tensor in its slot (2 x values; a raw tensor's bytes), by kind the largest
    uint64_t  sm_bytes;       // an expert's SM-chunks: kind_n[0] + kind_n[1] + kind_n[2]
    uint64_t  expert_bytes;   // an expert in its slot: kind_bytes[0] + kind_bytes[1] + kind_bytes[2]
    int       any_raw;        // some served tensor is raw (not BF16): nothing to decompress, no C/S/E pools
    double    rho;            // stored E bytes over exponent bytes, over the file
    uint64_t  max_e_bytes;    // the largest stored E bytes of one expert (gate + up + down): a store entry's E part
};

// residency of the slots (zipmoe-residency.c, under the cache's lock)
struct zipmoe_slots {
    int32_t    n_used;     // slots in use: the first n_used of capacity (set_n_slots changes it)
    int32_t    capacity;   // slots the caller's tensors hold; per-slot arrays are this long
    uint8_t *  data[3];    // by kind: the caller's slot tensors
    size_t     stride[3];
    // a raw expert's bytes into its slot through the caller (ggml_zipmoe_cache_params.slot_fill), or NULL: copied
    int (*fill)(void *, int, int, int32_t, const void *, size_t, char *, size_t);
    void *     fill_data;  // user_data of fill, write and sync
    // slots in a caller's device memory (GGML_ZIPMOE_SLOTS_DEVICE): every write goes through write, data
    // is never touched; NULL for host or CUDA slots
    int (*write)(void *, int, int, int32_t, size_t, const void *, size_t, char *, size_t);
    int (*sync)(void *, char *, size_t);
    uint64_t   max_shard;  // values of the largest shard of any served tensor (device staging)
    int32_t *  of_key;     // [n_keys] slot holding the key, or -1
    int64_t *  key;        // [capacity] key held, or -1
    uint64_t * last_use;   // [capacity] tick of the last use (LRU)
    uint64_t * inserted;   // [capacity] tick of the fill (FIFO)
    uint8_t *  marked;     // [capacity] marking algorithm's marks
    uint8_t *  transient;  // [capacity] not in the F pool: evicted first (RANK dispatch)
    uint64_t * pinned;     // [capacity] serial of the last call that needs it
    int        take_pages; // host slots in the caller's own mapping (ggml_zipmoe_cache_params.slot_pages_movable),
                           // and a kernel that moves pages: they may take a given-up store entry's
    int        own_pages;  // host slots in the caller's own mapping (slot_pages_movable): a change of pools gives
                           // the pages of the slots it gives up back itself, before its stores grow
};

// the eviction policy's state (zipmoe-residency.c)
struct zipmoe_policy {
    int32_t    eviction;    // enum ggml_zipmoe_eviction
    int32_t    rank_delta;
    uint64_t   tick;
    uint64_t * freq;        // [n_keys] ubatches that chose each expert (never reset)
    uint64_t * selected;    // [n_keys] tokens that chose each expert (never reset): the pools' ranks
    uint64_t   rng;         // MARKING: xorshift64 state
    uint64_t   call_serial;
    // SCORE: per key the last GGML_ZIPMOE_SCORE_WINDOW iterations' mean gate scores and their sum,
    // per layer the iterations seen (observe_scores writes them, choose_victim reads them; both
    // under score_lock)
    float *         score_ring;  // [n_keys][GGML_ZIPMOE_SCORE_WINDOW]
    double *        score_sum;   // [n_keys]
    uint64_t *      layer_iter;  // [n_layer]
    pthread_mutex_t score_lock;
};

// Pages move from the stores into slots in aligned blocks of a huge page (2 MiB on x86-64 and most
// arm64 kernels): a move of less splits the huge pages on both sides; 3 GB moved in 4 KiB pages read at
// 6.6-27 GB/s against 27 in whole blocks, and moved 10x slower (bench/page_moves.c, a sighting; a server
// run moving 4 KiB pages spent 86 s in its graphs against 69-71 in whole blocks). A store's
// range gives the blocks within it; the rest goes back.
#define ZIPMOE_MOVE_BLOCK ((size_t) 2 << 20)

// slots [first, end) that a change of pools fills, empty when it starts: the store entries it gives up
// move their pages there in blocks (zipmoe_sink_pages) instead of giving them back to the system, and
// the slots skip the faults and zeroing of a first write. at[k]: the next block to fill among the
// kind-k slots. Off (end 0) outside a change, and where the slots cannot take pages
struct zipmoe_page_sink {
    int32_t   first, end;
    uint8_t * at[3];
};

// experts computed where they are held (ggml_zipmoe_cache_set_cpu_slots, zipmoe-residency.c): host
// memory a fetch recovers the CPU's experts into, and the balancer's inputs of the current pass
struct zipmoe_cpu_slots {
    uint8_t * data[3];
    size_t    stride[3];
    int32_t   n_slots;  // 0: off
    double    t_cpu;    // seconds per token of one expert's products on the CPU
    int32_t * batch;    // [max_expert] the pass's missing experts' tokens, for the balancer
    int32_t * missing;  // [max_expert] those experts
    int32_t * work;     // [max_expert]
    uint8_t * on_cpu;   // [max_expert]
    int32_t * cpu_slot; // [max_expert] CPU slot of each expert of the current pass, or -1
};

// the pools: the active set in hierarchy order, thresholds tau_p, F's capacity in slots, the stores
struct zipmoe_pools {
    int32_t             n_active;
    int32_t             active[4];
    int32_t             threshold[4]; // by pool: ranks below it go to that pool (or an earlier one)
    int32_t             f_capacity;   // slots that may hold F-pool experts (the rest are working slots)
    int                 inclusive;    // C holds every expert: an F expert keeps its C entry (demoted, it is not read again)
    int                 migrating;    // a change of pools keeps C's entries of experts bound for F, in no slot, until
                                      // they are decoded into slots (zipmoe-migrate.c)
    struct zipmoe_store store[4];     // by pool; F's is unused
    struct zipmoe_page_sink sink;
    int8_t *            key_pool;     // [n_keys] store holding the expert (C, S, E), or NO_POOL
    int32_t *           key_entry;    // [n_keys]
};

// the current fetch's plan: its experts, tasks and their schedule (made by thread 0 in begin)
struct zipmoe_plan {
    int32_t *                       unique;      // [max_expert] distinct experts of the current call, ascending
    int32_t                         n_unique;    // how many
    uint8_t *                       seen;        // [max_expert]
    int32_t *                       pass_slot;   // [max_expert] slot of each expert of the current pass, or -1
    int32_t *                       tokens;      // [max_expert] tokens of the ubatch that chose each expert
    struct zipmoe_task *            tasks;       // [3 * capacity]
    int                             n_tasks;
    struct ggml_zipmoe_sched_task * sched_tasks; // [3 * capacity]
    struct ggml_zipmoe_sched_op *   io;          // [3 * capacity * (K + 1)] reads, in order
    struct ggml_zipmoe_sched_op *   dec;         // [3 * capacity * K] decompressions, by priority
    int32_t                         n_io;
    int32_t                         n_dec;
    void *                          sched_work;
    size_t                          sched_work_size;
    int32_t                         sched_threads; // L: decoding threads of the last fetch
    double                          rate_read, rate_decode, rate_compute; // the cost model, bytes per second
    // rates not given in the params follow this machine (zipmoe-fetch.c: calibrate): running
    // averages of the fetches' own reads and decodes (decodes without page faults); the counters as
    // of the last update
    int                             measure_read, measure_decode; // enum ggml_zipmoe_rate_origin
    int                             compute_given;                // rate_compute is the params' (never measured)
    uint64_t                        seen_bytes_read, seen_io_ns, seen_decode_ns, seen_decode_faults;
};

// the fetch pipeline: the I/O thread and the staging rings (zipmoe-fetch-io.c), the decoding threads
// (zipmoe-fetch.c)
struct zipmoe_pipeline {
    atomic_int *          op_state;   // [3 * capacity * K] by position in plan.dec
    uint8_t **            parked;     // [3 * capacity * K] by position in plan.dec, slots in a caller's device
                                      // memory: a shard's exponents decoded before its SM-chunk was read
    atomic_int            ops_done;   // shards recovered
    atomic_int            first_open; // no decompression before it is left to take (a hint)

    // the I/O thread, made on the first read; it performs job io_job's reads, then sets io_done
    pthread_t             io_thread;
    int                   io_started;
    int                   io_quit;
    atomic_uint_least64_t io_job;     // written under io_lock; read without it by a prefetch yielding to it
    atomic_uint_least64_t io_done;
    pthread_mutex_t       io_lock;
    pthread_cond_t        io_wake;
    // what the I/O thread does when no fetch has reads left (prefetch registers its reads, so that
    // the I/O thread does not call up into it): has_idle_work is asked under io_lock, idle_work is
    // called with io_lock held and returns with it held
    int                   (*has_idle_work)(const struct ggml_zipmoe_cache * c);
    void                  (*idle_work)(struct ggml_zipmoe_cache * c);

    struct zipmoe_staging sm_ring[ZIPMOE_N_STAGING]; // memory made on the first read
    struct zipmoe_staging e_ring[ZIPMOE_N_STAGING];
    size_t                sm_region;  // bytes of an SM buffer
    size_t                e_region;   // bytes of one E-chunk's region of an E buffer

    // barrier for the threads of one fetch_end call
    atomic_int            barrier_count;
    atomic_int            barrier_generation;

    struct zipmoe_worker  workers[ZIPMOE_MAX_THREADS]; // by thread index
};

// one predicted expert a prefetch reads: per kind (gate, up, down) its SM-chunk and its E-chunks
// (packed back to back once read, as a store keeps them)
struct zipmoe_prefetch_entry {
    int32_t    expert;
    uint8_t    need_sm, need_e; // what the cache lacked when predicted
    atomic_int ready[3];        // by kind: bit 1 the SM-chunk, bit 2 the E-chunks, read and checked
    uint8_t    used[3];         // by kind: the same bits, taken by a fetch
    uint64_t   sm_read[3];      // by kind: bytes of the SM-chunk read so far (it is read in pieces)
};

// a prefetch's buffer: the predictions for one layer
struct zipmoe_prefetch_bank {
    int32_t                        layer;       // -1: none
    int32_t                        n_entries;   // experts to read (the predicted ones the cache lacked)
    int32_t                        n_predicted; // distinct experts predicted (for recall)
    int32_t *                      predicted;   // [max_expert]
    int                            scored;      // recall counted
    struct zipmoe_prefetch_entry * entries;     // [capacity]
    uint8_t *                      mem;         // [capacity][3][entry_region] (made on first use)
};

// prefetch (zipmoe-prefetch.c). The bank fields are written by the fetching thread while the I/O
// thread is not reading them (active == 0, under pipe.io_lock).
struct zipmoe_prefetch {
    int32_t                     capacity;    // experts per bank (0: no banks)
    int32_t                     predict_limit; // experts a prediction (ggml_zipmoe_cache_prefetch) may fill
    int32_t                     lookahead;   // experts of a layer's next pass read ahead (0: none)
    size_t                      sm_region;   // bytes of a kind's SM part of an entry (largest SM-chunk, aligned)
    size_t                      e_region;    // bytes of a kind's E part (K regions of the E ring's size)
    struct zipmoe_prefetch_bank bank[2];
    int                         latest;      // bank of the last prefetch (-1: none)
    int                         consuming;   // bank the open fetch takes from (-1: none)
    int                         pending;     // the latest bank has reads left (under pipe.io_lock)
    int                         active;      // the I/O thread reads for it (under pipe.io_lock)
    atomic_int                  interrupt;   // a fetch wants the I/O thread: stop after the read in progress
    pthread_cond_t              idle;        // active went to 0
    atomic_uint_least64_t       hits, bytes_read, bytes_used;
    uint64_t *                  recall;      // [n_layer][3]: predicted, actual, correct
};

struct zipmoe_counters {
    atomic_uint_least64_t fetch_calls, hits, misses, store_hits[4], bytes_read, io_ns, decode_ns, recover_ns,
        fetch_ns, slot_write_bytes, cpu_experts, device_experts, device_ns, lock_wait_ns, plan_ns, fetch_work_ns, read_wait_ns, finish_wait_ns,
        decode_faults, graph_ns, graphs, preload_experts, preload_bytes_read, populate_bytes, populate_ns,
        migrate_experts, migrate_ns, moved_page_bytes;
    // activations for profiling: distinct experts of each layer's ubatches, and ubatch counts
    atomic_uint_least64_t * activations;    // [n_keys]
    atomic_uint_least64_t * layer_ubatches; // [n_layer]
    // and token by token, a layer's even and odd tokens apart (the re-plan's cross-fitted profile)
    atomic_uint_least64_t * selections;     // [2][n_keys]
    atomic_uint_least64_t * layer_tokens;   // [n_layer]
};

struct ggml_zipmoe_cache {
    const struct ggml_zipmoe_file * file;
    struct zipmoe_layout            layout;
    struct zipmoe_slots             slots;
    struct zipmoe_policy            policy;
    struct zipmoe_pools             pools;
    struct zipmoe_plan              plan;
    struct zipmoe_pipeline          pipe;
    struct zipmoe_prefetch          prefetch;
    struct zipmoe_counters          stats;
    struct zipmoe_substitution *    subst; // the opt-in lossy policy (lossy/zipmoe-substitution.h)
    struct zipmoe_gpu *             gpu;  // slots in CUDA memory (zipmoe-gpu.h), else NULL
    struct zipmoe_cpu_slots         cpu;  // experts the CPU computes beside device slots (opt-in)

    pthread_mutex_t lock;        // held from a fetch's begin to its end
    int             fetch_open;  // the open fetch: begin took the lock, end releases it
    pthread_t       fetch_owner;
    atomic_int      status;      // the open fetch's first failure
    int32_t         n_decoders;  // graph threads that decode (0: all)
    int             preloading;  // fetches of a preload or a migration: no activation counted
    int             slots_lost;  // a refused page move left slot memory unmapped (zipmoe_sink_pages): no fetch
    char            slots_lost_why[256];
    char            error[1024];
};

static inline uint64_t zipmoe_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

static inline size_t zipmoe_cache_n_keys(const struct ggml_zipmoe_cache * c) {
    return (size_t) (c->layout.n_layer > 0 ? c->layout.n_layer : 1) *
           (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1);
}

// the layer's experts are served (ggml_zipmoe_cache_has_layer, for the files below the cache's own)
static inline int zipmoe_layer_served(const struct ggml_zipmoe_cache * c, int layer) {
    return layer >= 0 && layer < c->layout.n_layer && c->layout.layer_tensor[layer * 3] >= 0;
}

// the task's SM-chunk is in memory (kept in a store, or read)
static inline int zipmoe_sm_ready(const struct zipmoe_task * t) {
    return t->sm_src != NULL || atomic_load(&t->sm_buf) >= 0;
}

// the task's tensor in its slot: the BF16 values the decode + recover routine writes (host slots;
// an address in the device's memory for CUDA)
static inline uint16_t * zipmoe_slot_tensor(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t) {
    if (t->on_cpu) {
        return (uint16_t *) (c->cpu.data[t->kind] + (size_t) t->slot * c->cpu.stride[t->kind]);
    }
    return (uint16_t *) (c->slots.data[t->kind] + (size_t) t->slot * c->slots.stride[t->kind]);
}

// the slots are in host memory and the decoding threads write them (no CUDA slots, no caller's
// slot_write or slot_fill): where a change of pools can decode C into F itself (zipmoe-migrate.c)
static inline int zipmoe_cache_slots_in_host(const struct ggml_zipmoe_cache * c) {
    return c->gpu == NULL && c->slots.write == NULL && c->slots.fill == NULL;
}

// experts one pass may hold: with pools, the working slots, so that a pass never evicts an expert
// of F (nor of another layer's F) to make room; with one F pool, every slot in use
static inline int32_t zipmoe_cache_pass_width(const struct ggml_zipmoe_cache * c) {
    const int32_t n_used = __atomic_load_n(&c->slots.n_used, __ATOMIC_RELAXED);
    return c->pools.f_capacity < n_used ? n_used - c->pools.f_capacity : n_used;
}

// The files call each other one way, from the top down; a lower file never calls a higher one
// (the I/O thread reaches the prefetch's reads through pipe.idle_work, which prefetch registers):
//   zipmoe-migrate.c                                 a change of pools, then fetches on the public API
//   zipmoe-preload.c, zipmoe-substitution-hook.c,    on the public cache API (and lossy/; the pool view
//   zipmoe-pool-view.c                               on policy/'s default pools)
//   zipmoe-cache.c, zipmoe-stats.c                   lifecycle, queries, merge; statistics
//   zipmoe-fetch.c                                   begin / end, the schedule, the decoding threads
//   zipmoe-fetch-device.c                            shards into slots in CUDA or a caller's device
//   zipmoe-residency.c                               the plan of a pass, eviction, the stores
//   zipmoe-prefetch.c                                read-ahead banks
//   zipmoe-fetch-io.c                                the I/O thread, staging, chunk reads, a task's chunks

// zipmoe-preload.c: one fetch of n experts of a layer, in as many passes as it takes, each decoded on
// n_threads threads of its own (the caller one of them)
int      zipmoe_cache_fetch_on_threads(struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int32_t n,
                                       int n_threads);

// zipmoe-cache.c: ggml_zipmoe_cache_set_pools, with C keeping the entries of experts bound for F where
// migrating (c->pools.migrating for the change)
int      zipmoe_cache_change_pools(struct ggml_zipmoe_cache * c, const int32_t * capacity, int32_t n_slots,
                                   int inclusive, int migrating);

// zipmoe-stats.c: the counters a fetch adds to, kept as they were around fetches that are no serving's
// (a preload's, a migration's: their own counters say what they did)
#define ZIPMOE_FETCH_COUNTERS 18
struct zipmoe_fetch_counts {
    uint64_t v[ZIPMOE_FETCH_COUNTERS];
};
void     zipmoe_stats_save_fetch(struct ggml_zipmoe_cache * c, struct zipmoe_fetch_counts * saved);
void     zipmoe_stats_restore_fetch(struct ggml_zipmoe_cache * c, const struct zipmoe_fetch_counts * saved);

// zipmoe-fetch.c
void     zipmoe_cache_schedule_tasks(struct ggml_zipmoe_cache * c);
void     zipmoe_cache_abandon_fetch(struct ggml_zipmoe_cache * c);

// zipmoe-fetch-device.c: shards into slots outside host memory (CUDA, or a caller's device through
// slot_write); 1: recovered, 2: decoded and parked until its SM-chunk is read, 0: failed (c->status)
// slot_memory's path (params checked): the staging size, slot_write / slot_sync, or CUDA's state (msg)
int      zipmoe_device_init(struct ggml_zipmoe_cache * c, const struct ggml_zipmoe_cache_params * p, char * msg,
                            size_t msg_size);
int      zipmoe_device_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int op,
                             struct zipmoe_worker * w, int ith, uint64_t * decode_ns, uint64_t * recover_ns);
int      zipmoe_device_recover_parked(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int op,
                                      struct zipmoe_worker * w, int ith, uint64_t * recover_ns);
void     zipmoe_device_sync(struct ggml_zipmoe_cache * c, int ith);   // ith's recoveries are in the slots
void     zipmoe_device_forget_parked(struct ggml_zipmoe_cache * c); // a failed fetch's parked shards
int      zipmoe_device_write(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, size_t offset,
                             const void * data, size_t size); // through slot_write; 0: failed (c->status)

// zipmoe-residency.c
void     zipmoe_cache_share_single_pool(struct ggml_zipmoe_cache * c);
// cpu_ids: NULL, or the CPU slot ids of the experts the balancer gives to the CPU (see fetch_begin_cpu)
int      zipmoe_cache_plan_pass(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                                int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids, int32_t * cpu_ids);
void     zipmoe_cache_forget_tasks(struct ggml_zipmoe_cache * c);
void     zipmoe_cpu_slots_free(struct ggml_zipmoe_cache * c); // the balancer's arrays; CPU slots off

// zipmoe-stores.c
uint64_t zipmoe_cache_measure_e_bytes(struct ggml_zipmoe_cache * c);
// the C, S and E stores to capacity[p] entries per served layer (the new pools' thresholds set): a
// store that shrinks keeps the entries the new pools send to it, then the most chosen; one that
// grows keeps them all. Shrinking stores go first, so memory is given back before more is taken.
int      zipmoe_cache_resize_stores(struct ggml_zipmoe_cache * c, const int32_t * capacity, uint64_t max_e, char * msg,
                                    size_t msg_size);
// the pool an expert goes to after its use (rank dispatch), NO_POOL beyond every threshold
int      zipmoe_dispatch_pool(const struct ggml_zipmoe_cache * c, int layer, int32_t e);
int32_t  zipmoe_store_victim(struct ggml_zipmoe_cache * c, int p, uint64_t serial); // -1: every entry in use
uint8_t * zipmoe_store_sm(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int kind); // NULL in E
uint8_t * zipmoe_store_e(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int layer, int32_t expert,
                         int kind);                                                            // NULL in S
void     zipmoe_store_forget(struct ggml_zipmoe_cache * c, int p, int32_t entry);
// whether a migration decodes store p's experts bound for F from their entries (C and S)
int      zipmoe_store_migrates_from(int p);
// an expert the pools (while migrating) send to F that C or S holds, no slot does, and was used again
int      zipmoe_store_migrant(const struct ggml_zipmoe_cache * c, int64_t key);
// the experts a change would decode from C or S into an F that holds their rank (as zipmoe_store_migrant),
// counted by rank over the served layers into n[max_expert]; from_s[max_expert] gets those from S, which
// read their E-chunks
void     zipmoe_migrants_by_rank(const struct ggml_zipmoe_cache * c, int32_t * n, int32_t * from_s);
// the whole pages within entries [first, first + n) of store p, forgotten (nothing reads them): into the
// slots a change of pools fills, else given back to the system (zipmoe_sink_pages)
void     zipmoe_store_release(struct ggml_zipmoe_cache * c, int p, int32_t first, int32_t n);
// the slots [first, end), empty, take the pages that the stores give up until zipmoe_sink_close (end <=
// first: none do)
void     zipmoe_sink_open(struct ggml_zipmoe_cache * c, int32_t first, int32_t end);
void     zipmoe_sink_close(struct ggml_zipmoe_cache * c);
// the whole pages of [addr, addr + size), memory nothing reads any more: its blocks moved into the slots
// the change in progress fills (c->pools.sink), where any are left, and the rest given back to the system
void     zipmoe_sink_pages(struct ggml_zipmoe_cache * c, uint8_t * addr, size_t size);
// expert key, kept in E's e_entry, takes C's c_entry: C's victim keeps its E-chunks in e_entry
void     zipmoe_store_trade_e_parts(struct ggml_zipmoe_cache * c, int64_t key, int32_t c_entry, int32_t e_entry,
                                    int64_t victim);

// zipmoe-prefetch.c
int      zipmoe_prefetch_init(struct ggml_zipmoe_cache * c, int32_t predict, int32_t lookahead);
void     zipmoe_prefetch_free(struct ggml_zipmoe_cache * c);
size_t   zipmoe_prefetch_bytes(const struct ggml_zipmoe_cache * c);
void     zipmoe_prefetch_pause(struct ggml_zipmoe_cache * c, int wait);
void     zipmoe_prefetch_resume_locked(struct ggml_zipmoe_cache * c);
void     zipmoe_prefetch_claim(struct ggml_zipmoe_cache * c, int layer);
void     zipmoe_prefetch_release(struct ggml_zipmoe_cache * c);
void     zipmoe_prefetch_score(struct ggml_zipmoe_cache * c, int layer, const int32_t * unique, int n_unique);
int      zipmoe_prefetch_supply(struct ggml_zipmoe_cache * c, struct zipmoe_task * t);
void     zipmoe_prefetch_next_pass(struct ggml_zipmoe_cache * c, int layer, int pass);
void     zipmoe_prefetch_reset_stats(struct ggml_zipmoe_cache * c);

// zipmoe-fetch-io.c
void     zipmoe_pause_waiting(unsigned spins); // a waiter's spin, then short sleeps
// the fetch's first failure, with the chunk at fault, into c->status and c->error
void     zipmoe_fetch_fail(struct ggml_zipmoe_cache * c, int status, const struct zipmoe_task * t, int chunk,
                           int sys_errno);
void     zipmoe_fetch_fail_why(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, const char * what,
                               const char * why); // the first failure: "<file>: tensor T, expert E, shard k: what: why"
const uint8_t * zipmoe_task_e_chunk(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k); // 1..K
const uint8_t * zipmoe_task_sm(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t);
void     zipmoe_shard_decoded(struct ggml_zipmoe_cache * c, struct zipmoe_task * t);   // its E-chunk consumed
void     zipmoe_shard_recovered(struct ggml_zipmoe_cache * c, struct zipmoe_task * t); // in its slot
uint64_t zipmoe_cache_e_bytes(const struct ggml_zipmoe_cache * c, int tensor, int expert); // its K E-chunks, stored
size_t   zipmoe_cache_e_region_bytes(const struct ggml_zipmoe_cache * c);
int      zipmoe_cache_ensure_staging(struct ggml_zipmoe_cache * c);
int      zipmoe_read_chunks(struct ggml_zipmoe_cache * c, int32_t tensor, int32_t expert, int first, int last,
                            uint8_t * mem, size_t region, int check, uint64_t * base, int * bad, int * sys_errno);
// decoding threads: 1 when the task's SM-chunk may be used (kept in a store, or read and its checksum checked,
// by this thread if no other has claimed it; *ns gets the time); 0 when not yet, or on a mismatch (c->status)
int      zipmoe_sm_checked(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, uint64_t * ns);
// decoding threads: 1 when E-chunk k (1..K) of the task may be used (kept, or read and checked now); 0 on a
// mismatch (c->status)
int      zipmoe_e_chunk_checked(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, uint64_t * ns);
int      zipmoe_cache_start_io(struct ggml_zipmoe_cache * c);
