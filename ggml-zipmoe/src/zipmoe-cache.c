// Expert cache: the hierarchical pools of ZipMoE (paper §3.2-3.4), filled on demand from a ZipMoE GGUF.
//
// Pools. F is the slots: full BF16 experts the graph multiplies with. C, S and E are stores of
// stored bytes: C keeps an expert's SM-chunks and E-chunks, S its SM-chunks, E its E-chunks.
// Slots that hold no F-pool expert are working slots: an expert found in C, S or E, or in none
// (a miss), is made full there for the pass that needs it. After each use an expert is
// dispatched by its runtime activation rank r in its layer: to the first pool p of the active
// set (hierarchy order F, C, S, E) with r < tau_p = sum_{j <= p} S_j + delta, LFU eviction inside
// a pool; beyond every threshold it is dropped after use (its working slot goes first).
//
// A fetch is split in two graph ops so that reading overlaps the graph's other work. Begin (one
// graph thread) plans under the cache's lock: hits, victims, slot ids, one task per expert tensor
// to make full, with the state of what is cached (M nothing, C, S, E), and orders the tasks with
// the cache-affinity scheduler (Algorithm 1: the I/O thread's reads, E-chunks before SM-chunks
// within a block, and the decompressions' priority list). It hands the reads to the cache's own
// I/O thread and returns; the graph goes on (the shared expert is computed between the two ops).
// End (every graph thread) is work-conserving: a thread takes the first decompression of the
// priority list whose E-chunks are in memory, decodes the shard's exponents into the upper half
// of the shard's own slot bytes, and recovers BF16 in place once the tensor's SM-chunk is in memory
// (a recovery pending on its SM-chunk is taken the same way). The I/O thread checks the
// checksums of what it reads. Thread 0 waits for the I/O thread and releases the lock.

#define _GNU_SOURCE // sched_yield on older libcs

#include "ggml-zipmoe.h"
#include "zipmoe-impl.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define ZIPMOE_PAUSE() _mm_pause()
#else
#    define ZIPMOE_PAUSE() ((void) 0)
#endif

#define ZIPMOE_MAX_THREADS 256
#define ZIPMOE_N_STAGING   8   // buffers per ring: SM-chunks, and each task's K E-chunks
#define ZIPMOE_DECODER_BYTES (1u << 20) // a decoder's codec state (zstd's context is the largest), rounded up

// default rates of the scheduler's cost model (the planner's default_costs uses the same)
#define ZIPMOE_READ_BYTES_PER_S    1.4e9  // O_DIRECT reads
#define ZIPMOE_DECODE_BYTES_PER_S  3.2e9  // decode + recover, BF16 output bytes per thread
#define ZIPMOE_COMPUTE_BYTES_PER_S 1.0e10 // expert products, BF16 weight bytes per token

enum { STAGE_FREE = 0, STAGE_BUSY = 1 };

// the shard operations of the decompression list
enum { OP_TODO = 0, OP_CLAIMED = 1, OP_DECODED = 2, OP_DONE = 3 };

// pools of the hierarchy, by index (enum ggml_zipmoe_pool); NO_POOL: not cached
#define NO_POOL (-1)

// stored chunks read by the I/O thread: one task's SM-chunk, or its K E-chunks
struct zipmoe_staging {
    uint8_t *  mem;   // aligned for O_DIRECT
    uint64_t   base;  // E ring: file offset at mem when the E-chunks were read in one span, else UINT64_MAX
    atomic_int state; // STAGE_FREE or STAGE_BUSY
};

// per graph thread: a decoder, made on first use
struct zipmoe_worker {
    struct ggml_zipmoe_decoder * decoder;
};

// one expert tensor to make full in a slot
struct zipmoe_task {
    int32_t         slot;
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
};

// a store of pool C, S or E: fixed-size entries, each one expert's kept chunks (gate, up, down)
struct zipmoe_store {
    size_t     entry_size;
    int32_t    n_entries;
    uint8_t *  mem;
    int64_t *  entry_key;      // [n_entries] (layer * max_expert + expert), or -1
    uint64_t * entry_pinned;   // [n_entries] serial of the last call reading or writing it
    uint64_t * entry_last_use; // [n_entries] tick (LFU ties)
};

struct ggml_zipmoe_cache {
    const struct ggml_zipmoe_file * file;
    int32_t   n_slots;          // slots in use: the first n_slots of slot_capacity (set_n_slots changes it)
    int32_t   slot_capacity;    // slots the caller's tensors hold; per-slot arrays are this long
    int32_t   rank_delta;
    uint8_t * slot_data[3];
    size_t    slot_stride[3];

    int       n_layer;          // layers indexable (max layer + 1)
    int32_t * layer_tensor;     // [n_layer][3] repacked tensor index by kind, -1 when not served
    int32_t * layer_n_expert;   // [n_layer]
    int32_t   max_expert;       // largest n_expert over layers
    int32_t   n_served;         // layers served
    uint64_t  kind_n[3];        // values of one expert tensor, by kind
    uint64_t  sm_bytes;         // an expert's SM-chunks: kind_n[0] + kind_n[1] + kind_n[2]

    // pools: the active set in hierarchy order, thresholds tau_p, F's capacity in slots
    int32_t   n_active;
    int32_t   active[4];
    int32_t   threshold[4];     // by pool: ranks below it go to that pool (or an earlier one)
    int32_t   f_capacity;       // slots that may hold F-pool experts (the rest are working slots)
    struct zipmoe_store store[4]; // by pool; F's is unused
    int8_t *  key_pool;         // [n_keys] store holding the expert (C, S, E), or NO_POOL
    int32_t * key_entry;        // [n_keys]

    // residency of the slots (guarded by lock)
    int32_t *  key_slot;        // [n_layer * max_expert] slot holding (layer, expert), or -1
    int64_t *  slot_key;        // [slot_capacity] (layer * max_expert + expert), or -1
    uint64_t * slot_last_use;   // [slot_capacity] tick of the last use (LRU)
    uint64_t * slot_inserted;   // [slot_capacity] tick of the fill (FIFO)
    uint8_t *  slot_marked;     // [slot_capacity] marking algorithm's marks
    uint8_t *  slot_transient;  // [slot_capacity] not in the F pool: evicted first (RANK dispatch)
    uint64_t * slot_pinned;     // [slot_capacity] call serial of the last call that needs it
    uint64_t   tick;
    uint64_t * freq;            // [n_layer * max_expert] ubatches that chose each expert (never reset)
    int32_t    eviction;        // enum ggml_zipmoe_eviction
    uint64_t   rng;             // MARKING: xorshift64 state
    uint64_t   call_serial;
    int32_t *  unique;          // [max_expert] distinct experts of the current call, ascending
    uint8_t *  seen;            // [max_expert]
    int32_t *  pass_slot;       // [max_expert] slot of each expert of the current pass, or -1
    int32_t *  tokens;          // [max_expert] tokens of the ubatch that chose each expert

    // the current fetch's tasks and their schedule
    struct zipmoe_task *           tasks;     // [3 * slot_capacity]
    int                            n_tasks;
    struct ggml_zipmoe_sched_task * sched_tasks; // [3 * slot_capacity]
    struct ggml_zipmoe_sched_op *  io;        // [3 * slot_capacity * (K + 1)] reads, in order
    struct ggml_zipmoe_sched_op *  dec;       // [3 * slot_capacity * K] decompressions, by priority
    int32_t *                      order;     // scheduler outputs the runtime does not use
    int32_t *                      block_start;
    int32_t *                      task_block;
    int32_t                        n_io;
    int32_t                        n_dec;
    atomic_int *                   op_state;  // [3 * slot_capacity * K] by position in dec
    atomic_int                     ops_done;  // shards recovered
    atomic_int                     first_open;// no decompression before it is left to take (a hint)
    void *                         sched_work;
    size_t                         sched_work_size;
    int32_t                        sched_threads; // L: decoding threads of the last fetch
    double                         rate_read, rate_decode, rate_compute; // bytes per second
    double                         rho;       // stored E bytes over exponent bytes, over the file

    atomic_int           status;
    int32_t              n_decoders; // graph threads that decode (0: all)
    int                  preloading; // fetches of ggml_zipmoe_cache_preload: no activation counted

    // the open fetch: begin took the lock, end releases it
    int       fetch_open;
    pthread_t fetch_owner;

    // the I/O thread, made on the first read; it performs job io_job's reads, then sets io_done
    pthread_t             io_thread;
    int                   io_started;
    int                   io_quit;
    uint64_t              io_job;    // guarded by io_lock
    atomic_uint_least64_t io_done;
    pthread_mutex_t       io_lock;
    pthread_cond_t        io_wake;

    // activations for profiling: distinct experts of each layer's ubatches, and ubatch counts
    atomic_uint_least64_t * activations;  // [n_layer * max_expert]
    atomic_uint_least64_t * layer_ubatches; // [n_layer]

    struct zipmoe_staging sm_ring[ZIPMOE_N_STAGING]; // memory made on the first read
    struct zipmoe_staging e_ring[ZIPMOE_N_STAGING];
    size_t                sm_region;                 // bytes of an SM buffer
    size_t                e_region;                  // bytes of one E-chunk's region of an E buffer

    // barrier for the threads of one fetch call
    atomic_int           barrier_count;
    atomic_int           barrier_generation;

    struct zipmoe_worker workers[ZIPMOE_MAX_THREADS]; // by thread index
    pthread_mutex_t      lock; // held from a fetch's begin to its end
    char                 error[1024];

    // statistics
    atomic_uint_least64_t fetch_calls, hits, misses, store_hits[4], bytes_read, io_ns, decode_ns, recover_ns,
        fetch_ns;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

static void barrier(struct ggml_zipmoe_cache * c, int nth) {
    if (nth <= 1) {
        return;
    }
    // the generation cannot move before this thread arrives, so reading it first is safe
    const int gen = atomic_load(&c->barrier_generation);
    if (atomic_fetch_add(&c->barrier_count, 1) == nth - 1) {
        atomic_store(&c->barrier_count, 0);
        atomic_fetch_add(&c->barrier_generation, 1);
        return;
    }
    for (unsigned spins = 0; atomic_load(&c->barrier_generation) == gen; spins++) {
        if (spins < 2048) {
            ZIPMOE_PAUSE();
        } else {
            sched_yield(); // a waiting thread must not take the core a reading/decoding thread needs
        }
    }
}

// a waiter sleeps after a short spin: the thread it waits for may need its core (three threads
// share two cores here)
static void pause_waiting(unsigned spins) {
    if (spins < 1024) {
        ZIPMOE_PAUSE();
    } else {
        const struct timespec pause = { 0, 20000 };
        nanosleep(&pause, NULL);
    }
}

static void set_error(char * err, size_t err_size, const char * msg) {
    if (err != NULL && err_size > 0) {
        snprintf(err, err_size, "%s", msg);
    }
}

static void abandon_open_fetch(struct ggml_zipmoe_cache * c);

// one F pool of every slot in use: F holds them all, and RANK's share per layer follows the slot count
static void set_single_pool_share(struct ggml_zipmoe_cache * c) {
    const int32_t n_served = c->n_served > 0 ? c->n_served : 1;
    c->threshold[GGML_ZIPMOE_POOL_F] =
        c->eviction == GGML_ZIPMOE_EVICT_RANK ? c->n_slots / n_served + c->rank_delta : INT32_MAX;
    c->f_capacity = c->n_slots;
}

void ggml_zipmoe_cache_free(struct ggml_zipmoe_cache * c) {
    if (c == NULL) {
        return;
    }
    if (c->fetch_open) {
        abandon_open_fetch(c);
    }
    if (c->io_started) {
        pthread_mutex_lock(&c->io_lock);
        c->io_quit = 1;
        pthread_cond_signal(&c->io_wake);
        pthread_mutex_unlock(&c->io_lock);
        pthread_join(c->io_thread, NULL);
    }
    pthread_mutex_destroy(&c->io_lock);
    pthread_cond_destroy(&c->io_wake);
    free(c->activations);
    free(c->layer_ubatches);
    for (int i = 0; i < ZIPMOE_MAX_THREADS; i++) {
        ggml_zipmoe_decoder_free(c->workers[i].decoder);
    }
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        free(c->sm_ring[i].mem);
        free(c->e_ring[i].mem);
    }
    for (int p = 0; p < 4; p++) {
        free(c->store[p].mem);
        free(c->store[p].entry_key);
        free(c->store[p].entry_pinned);
        free(c->store[p].entry_last_use);
    }
    free(c->key_pool);
    free(c->key_entry);
    free(c->layer_tensor);
    free(c->layer_n_expert);
    free(c->key_slot);
    free(c->slot_key);
    free(c->slot_last_use);
    free(c->slot_inserted);
    free(c->slot_marked);
    free(c->slot_transient);
    free(c->freq);
    free(c->slot_pinned);
    free(c->unique);
    free(c->seen);
    free(c->pass_slot);
    free(c->tokens);
    free(c->tasks);
    free(c->sched_tasks);
    free(c->io);
    free(c->dec);
    free(c->order);
    free(c->block_start);
    free(c->task_block);
    free(c->op_state);
    free(c->sched_work);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

// stored E bytes of one expert tensor (its K E-chunks back to back)
static uint64_t e_bytes(const struct ggml_zipmoe_cache * c, int tensor, int expert) {
    uint64_t total = 0;
    for (int k = 1; k <= c->file->n_shards; k++) {
        total += zipmoe_file_chunk(c->file, tensor, expert, k)->size;
    }
    return total;
}

// the largest stored E bytes of one expert (gate + up + down), and rho over the file
static uint64_t measure_e_bytes(struct ggml_zipmoe_cache * c) {
    uint64_t max_e = 0, e_total = 0, n_total = 0;
    for (int l = 0; l < c->n_layer; l++) {
        if (!ggml_zipmoe_cache_has_layer(c, l)) {
            continue;
        }
        for (int32_t e = 0; e < c->layer_n_expert[l]; e++) {
            uint64_t bytes = 0;
            for (int k = 0; k < 3; k++) {
                bytes += e_bytes(c, c->layer_tensor[l * 3 + k], e);
                n_total += c->kind_n[k];
            }
            max_e = bytes > max_e ? bytes : max_e;
            e_total += bytes;
        }
    }
    c->rho = n_total > 0 ? (double) e_total / (double) n_total : 1.0;
    return max_e;
}

// the entries of the stores of pools C, S and E (experts per served layer times served layers)
static int make_stores(struct ggml_zipmoe_cache * c, const int32_t * capacity, char * msg, size_t msg_size) {
    const uint64_t max_e = measure_e_bytes(c);
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        struct zipmoe_store * s = &c->store[p];
        s->n_entries = capacity[p] * c->n_served;
        if (s->n_entries == 0) {
            continue;
        }
        const uint64_t size = (p != GGML_ZIPMOE_POOL_E ? c->sm_bytes : 0) + (p != GGML_ZIPMOE_POOL_S ? max_e : 0);
        s->entry_size = (size_t) zipmoe_align_up(size, 64);
        s->mem = (uint8_t *) malloc(s->entry_size * (size_t) s->n_entries);
        s->entry_key = (int64_t *) malloc(sizeof(int64_t) * (size_t) s->n_entries);
        s->entry_pinned = (uint64_t *) calloc((size_t) s->n_entries, sizeof(uint64_t));
        s->entry_last_use = (uint64_t *) calloc((size_t) s->n_entries, sizeof(uint64_t));
        if (!s->mem || !s->entry_key || !s->entry_pinned || !s->entry_last_use) {
            snprintf(msg, msg_size, "ggml_zipmoe_cache_new: out of memory for pool %c's %d entries of %zu bytes",
                     "FCSE"[p], s->n_entries, s->entry_size);
            return GGML_ZIPMOE_ERR_NOMEM;
        }
        for (int32_t i = 0; i < s->n_entries; i++) {
            s->entry_key[i] = -1;
        }
    }
    return GGML_ZIPMOE_OK;
}

struct ggml_zipmoe_cache * ggml_zipmoe_cache_new(const struct ggml_zipmoe_cache_params * p, char * err, size_t err_size) {
    char msg[1024];
    if (p == NULL || p->file == NULL || p->n_slots < 1) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: invalid argument (no file or fewer than 1 slot)");
        return NULL;
    }
    if (p->eviction < GGML_ZIPMOE_EVICT_LRU || p->eviction > GGML_ZIPMOE_EVICT_RANK) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: unknown eviction policy");
        return NULL;
    }
    int pools = 0;
    for (int i = 0; i < 4; i++) {
        if (p->pool_capacity[i] < 0) {
            set_error(err, err_size, "ggml_zipmoe_cache_new: a pool capacity is negative");
            return NULL;
        }
        pools += p->pool_capacity[i] > 0;
    }
    if (pools > 0 && p->eviction != GGML_ZIPMOE_EVICT_RANK) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: pools dispatch by rank: the eviction policy must be rank");
        return NULL;
    }
    if (p->rate_read < 0 || p->rate_decode < 0 || p->rate_compute < 0) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: a rate of the cost model is negative");
        return NULL;
    }
    const struct ggml_zipmoe_file * file = p->file;
    struct ggml_zipmoe_cache * c = (struct ggml_zipmoe_cache *) calloc(1, sizeof(*c));
    if (c == NULL) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: out of memory");
        return NULL;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->io_lock, NULL);
    pthread_cond_init(&c->io_wake, NULL);
    c->file       = file;
    c->n_slots    = p->n_slots;
    c->slot_capacity = p->n_slots;
    c->rank_delta = p->rank_delta > 0 ? p->rank_delta : 0;
    c->n_decoders = p->n_decoders > 0 ? p->n_decoders : 0;
    c->eviction   = p->eviction;
    c->rate_read    = p->rate_read > 0 ? p->rate_read : ZIPMOE_READ_BYTES_PER_S;
    c->rate_decode  = p->rate_decode > 0 ? p->rate_decode : ZIPMOE_DECODE_BYTES_PER_S;
    c->rate_compute = p->rate_compute > 0 ? p->rate_compute : ZIPMOE_COMPUTE_BYTES_PER_S;
    c->sched_threads = c->n_decoders > 0 ? c->n_decoders : 1;
    for (int k = 0; k < 3; k++) {
        c->slot_data[k]   = (uint8_t *) p->slot_data[k];
        c->slot_stride[k] = p->slot_stride[k];
    }

    int64_t slot_ne[3][2] = { { 0, 0 }, { 0, 0 }, { 0, 0 } };
    for (int t = 0; t < file->n_tensors; t++) {
        if (file->tensors[t].layer + 1 > c->n_layer) {
            c->n_layer = file->tensors[t].layer + 1;
        }
    }
    c->layer_tensor   = (int32_t *) malloc(sizeof(int32_t) * 3 * (size_t) (c->n_layer > 0 ? c->n_layer : 1));
    c->layer_n_expert = (int32_t *) calloc((size_t) (c->n_layer > 0 ? c->n_layer : 1), sizeof(int32_t));
    if (c->layer_tensor == NULL || c->layer_n_expert == NULL) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: out of memory");
        ggml_zipmoe_cache_free(c);
        return NULL;
    }
    static const char * kinds[3] = { "gate", "up", "down" };
    for (int l = 0; l < c->n_layer; l++) {
        int found = 0;
        for (int k = 0; k < 3; k++) {
            char name[96];
            snprintf(name, sizeof(name), "blk.%d.ffn_%s_exps.weight", l, kinds[k]);
            const int t = ggml_zipmoe_file_find_tensor(file, name);
            c->layer_tensor[l * 3 + k] = t;
            if (t < 0) {
                continue;
            }
            found++;
            const int64_t * ne = file->tensors[t].ne;
            if (slot_ne[k][0] == 0) {
                slot_ne[k][0] = ne[0];
                slot_ne[k][1] = ne[1];
                c->kind_n[k]  = file->tensors[t].n;
            }
            if (ne[0] != slot_ne[k][0] || ne[1] != slot_ne[k][1]) {
                snprintf(msg, sizeof(msg), "%s: %s is %lld x %lld, other layers' %s experts are %lld x %lld: "
                         "one slot shape cannot hold both", file->path, name, (long long) ne[0], (long long) ne[1],
                         kinds[k], (long long) slot_ne[k][0], (long long) slot_ne[k][1]);
                set_error(err, err_size, msg);
                ggml_zipmoe_cache_free(c);
                return NULL;
            }
            if (c->layer_n_expert[l] == 0) {
                c->layer_n_expert[l] = (int32_t) ne[2];
            }
            if (ne[2] != c->layer_n_expert[l]) {
                snprintf(msg, sizeof(msg), "%s: layer %d's gate, up and down experts differ in count", file->path, l);
                set_error(err, err_size, msg);
                ggml_zipmoe_cache_free(c);
                return NULL;
            }
        }
        if (found != 0 && found != 3) {
            snprintf(msg, sizeof(msg), "%s: layer %d has %d of the 3 routed-expert tensors repacked (gate, up, down "
                     "must all be)", file->path, l, found);
            set_error(err, err_size, msg);
            ggml_zipmoe_cache_free(c);
            return NULL;
        }
        if (c->layer_n_expert[l] > c->max_expert) {
            c->max_expert = c->layer_n_expert[l];
        }
        c->n_served += found == 3;
    }
    c->sm_bytes = c->kind_n[0] + c->kind_n[1] + c->kind_n[2];
    const size_t n_keys = (size_t) (c->n_layer > 0 ? c->n_layer : 1) * (size_t) (c->max_expert > 0 ? c->max_expert : 1);
    const size_t n_exp  = (size_t) (c->max_expert > 0 ? c->max_expert : 1);
    const size_t max_tasks = 3 * (size_t) c->slot_capacity;
    const size_t K = (size_t) file->n_shards;
    c->key_slot      = (int32_t *) malloc(n_keys * sizeof(int32_t));
    c->key_pool      = (int8_t *) malloc(n_keys);
    c->key_entry     = (int32_t *) malloc(n_keys * sizeof(int32_t));
    const size_t cap = (size_t) c->slot_capacity;
    c->slot_key      = (int64_t *) malloc(cap * sizeof(int64_t));
    c->slot_last_use = (uint64_t *) calloc(cap, sizeof(uint64_t));
    c->slot_pinned   = (uint64_t *) calloc(cap, sizeof(uint64_t));
    c->slot_inserted  = (uint64_t *) calloc(cap, sizeof(uint64_t));
    c->slot_marked    = (uint8_t *) calloc(cap, 1);
    c->slot_transient = (uint8_t *) calloc(cap, 1);
    c->freq           = (uint64_t *) calloc(n_keys, sizeof(uint64_t));
    c->unique        = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->seen          = (uint8_t *) calloc(n_exp, 1);
    c->pass_slot     = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->tokens        = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->tasks         = (struct zipmoe_task *) calloc(max_tasks, sizeof(struct zipmoe_task));
    c->sched_tasks   = (struct ggml_zipmoe_sched_task *) malloc(max_tasks * sizeof(struct ggml_zipmoe_sched_task));
    c->io            = (struct ggml_zipmoe_sched_op *) malloc(max_tasks * (K + 1) * sizeof(struct ggml_zipmoe_sched_op));
    c->dec           = (struct ggml_zipmoe_sched_op *) malloc(max_tasks * K * sizeof(struct ggml_zipmoe_sched_op));
    c->order         = (int32_t *) malloc(max_tasks * sizeof(int32_t));
    c->block_start   = (int32_t *) malloc((max_tasks + 1) * sizeof(int32_t));
    c->task_block    = (int32_t *) malloc(max_tasks * sizeof(int32_t));
    c->op_state      = (atomic_int *) calloc(max_tasks * K, sizeof(atomic_int));
    c->activations    = (atomic_uint_least64_t *) calloc(n_keys, sizeof(atomic_uint_least64_t));
    c->layer_ubatches = (atomic_uint_least64_t *) calloc((size_t) (c->n_layer > 0 ? c->n_layer : 1),
                                                         sizeof(atomic_uint_least64_t));
    if (!c->key_slot || !c->key_pool || !c->key_entry || !c->slot_key || !c->slot_last_use || !c->slot_pinned ||
        !c->unique || !c->seen || !c->slot_inserted || !c->slot_marked || !c->slot_transient || !c->freq ||
        !c->pass_slot || !c->tokens || !c->tasks || !c->sched_tasks || !c->io || !c->dec || !c->order ||
        !c->block_start || !c->task_block || !c->op_state || !c->activations || !c->layer_ubatches) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: out of memory");
        ggml_zipmoe_cache_free(c);
        return NULL;
    }
    for (size_t i = 0; i < n_keys; i++) {
        c->key_slot[i]  = -1;
        c->key_pool[i]  = NO_POOL;
        c->key_entry[i] = -1;
    }
    for (int32_t s = 0; s < c->slot_capacity; s++) {
        c->slot_key[s] = -1;
    }
    const int32_t delta = c->rank_delta;
    if (pools == 0) {
        // one F pool of every slot (the planner's Lambda = {F}); only the RANK policy dispatches
        c->n_active  = 1;
        c->active[0] = GGML_ZIPMOE_POOL_F;
        set_single_pool_share(c);
    } else {
        int32_t sum = 0;
        for (int i = 0; i < 4; i++) {
            if (p->pool_capacity[i] > 0) {
                sum += p->pool_capacity[i];
                c->active[c->n_active++] = i;
                c->threshold[i] = sum + delta;
            }
        }
        c->f_capacity = p->pool_capacity[GGML_ZIPMOE_POOL_F] * c->n_served;
        if (c->f_capacity >= c->n_slots) {
            snprintf(msg, sizeof(msg), "ggml_zipmoe_cache_new: pool F holds %d experts in %d served layers = %d slots, "
                     "but there are only %d slots: at least one must be a working slot", p->pool_capacity[0],
                     c->n_served, c->f_capacity, c->n_slots);
            set_error(err, err_size, msg);
            ggml_zipmoe_cache_free(c);
            return NULL;
        }
        if (make_stores(c, p->pool_capacity, msg, sizeof(msg)) != GGML_ZIPMOE_OK) {
            set_error(err, err_size, msg);
            ggml_zipmoe_cache_free(c);
            return NULL;
        }
    }
    measure_e_bytes(c);
    c->rng = 0x9E3779B97F4A7C15ull;
    return c;
}

int ggml_zipmoe_cache_pool_entries(const struct ggml_zipmoe_cache * c, int pool, size_t * entry_bytes) {
    if (c == NULL || pool < GGML_ZIPMOE_POOL_F || pool > GGML_ZIPMOE_POOL_E) {
        return -1;
    }
    if (pool == GGML_ZIPMOE_POOL_F) {
        if (entry_bytes != NULL) {
            *entry_bytes = (size_t) (2 * c->sm_bytes);
        }
        return c->f_capacity;
    }
    if (entry_bytes != NULL) {
        *entry_bytes = c->store[pool].entry_size;
    }
    return c->store[pool].n_entries;
}

int32_t ggml_zipmoe_cache_n_slots(const struct ggml_zipmoe_cache * c) {
    return __atomic_load_n(&c->n_slots, __ATOMIC_RELAXED);
}

int32_t ggml_zipmoe_cache_slot_capacity(const struct ggml_zipmoe_cache * c) {
    return c->slot_capacity;
}

int ggml_zipmoe_cache_set_n_slots(struct ggml_zipmoe_cache * c, int32_t n_slots) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    ggml_zipmoe_cache_cancel(c); // a fetch this thread left open would hold the lock
    pthread_mutex_lock(&c->lock);
    int status = GGML_ZIPMOE_OK;
    if (n_slots < 1 || n_slots > c->slot_capacity) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_n_slots: %d slots asked, the slot tensors hold "
                 "1 to %d", n_slots, c->slot_capacity);
        status = GGML_ZIPMOE_ERR_ARG;
    }
    if (status == GGML_ZIPMOE_OK && !(c->n_active == 1 && c->active[0] == GGML_ZIPMOE_POOL_F) &&
        n_slots <= c->f_capacity) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_n_slots: pool F holds %d slots, so at least %d "
                 "slots are needed (one working slot), not %d", c->f_capacity, c->f_capacity + 1, n_slots);
        status = GGML_ZIPMOE_ERR_ARG;
    }
    if (status == GGML_ZIPMOE_OK) {
        // experts in the slots given up are forgotten; slots taken on start empty
        for (int32_t s = n_slots; s < c->n_slots; s++) {
            if (c->slot_key[s] >= 0) {
                c->key_slot[c->slot_key[s]] = -1;
            }
            c->slot_key[s]       = -1;
            c->slot_pinned[s]    = 0;
            c->slot_marked[s]    = 0;
            c->slot_transient[s] = 0;
        }
        __atomic_store_n(&c->n_slots, n_slots, __ATOMIC_RELAXED);
        if (c->n_active == 1 && c->active[0] == GGML_ZIPMOE_POOL_F) {
            set_single_pool_share(c);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return status;
}

int ggml_zipmoe_cache_has_layer(const struct ggml_zipmoe_cache * c, int layer) {
    return c != NULL && layer >= 0 && layer < c->n_layer && c->layer_tensor[layer * 3] >= 0;
}

int32_t ggml_zipmoe_cache_n_expert(const struct ggml_zipmoe_cache * c, int layer) {
    return ggml_zipmoe_cache_has_layer(c, layer) ? c->layer_n_expert[layer] : 0;
}

int ggml_zipmoe_cache_n_passes(const struct ggml_zipmoe_cache * c, int layer, int64_t n_ids) {
    const int64_t n_expert = ggml_zipmoe_cache_n_expert(c, layer);
    const int64_t distinct = n_ids < n_expert ? n_ids : n_expert;
    const int64_t n_slots  = ggml_zipmoe_cache_n_slots(c);
    return distinct <= 0 ? 1 : (int) ((distinct + n_slots - 1) / n_slots);
}

// marks the distinct valid experts of ids in c->seen and lists them ascending in c->unique;
// returns their count, or -1 if an id is out of range
static int collect_unique(const struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int64_t n_used,
                          int64_t n_tokens, int64_t ids_stride, uint8_t * seen, int32_t * unique) {
    const int32_t n_expert = c->layer_n_expert[layer];
    memset(seen, 0, (size_t) n_expert);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e = ids[t * ids_stride + k];
            if (e < 0 || e >= n_expert) {
                return -1;
            }
            seen[e] = 1;
        }
    }
    int n = 0;
    for (int32_t e = 0; e < n_expert; e++) {
        if (seen[e]) {
            unique[n++] = e;
        }
    }
    return n;
}

// rank of expert e in its layer by runtime activation counts (0: the most chosen; ties by id)
static int32_t expert_rank(const struct ggml_zipmoe_cache * c, int layer, int32_t e) {
    const uint64_t * f = c->freq + (int64_t) layer * c->max_expert;
    int32_t rank = 0;
    for (int32_t o = 0; o < c->layer_n_expert[layer]; o++) {
        rank += f[o] > f[e] || (f[o] == f[e] && o < e);
    }
    return rank;
}

// the pool an expert goes to after its use: the first active pool whose threshold exceeds its
// rank (paper §3.4, "Pool Dispatching"), NO_POOL beyond every threshold
static int dispatch_pool(const struct ggml_zipmoe_cache * c, int layer, int32_t e) {
    const int32_t rank = expert_rank(c, layer, e);
    for (int i = 0; i < c->n_active; i++) {
        if (rank < c->threshold[c->active[i]]) {
            return c->active[i];
        }
    }
    return NO_POOL;
}

static uint64_t slot_freq(const struct ggml_zipmoe_cache * c, int32_t s) {
    return c->freq[c->slot_key[s]];
}

// a slot the current call (serial) does not need, by the eviction policy; one exists, since a pass
// never holds more experts than slots
static int32_t choose_victim(struct ggml_zipmoe_cache * c, uint64_t serial) {
    int32_t victim = -1;
    for (int32_t s = 0; s < c->n_slots; s++) {
        if (c->slot_key[s] < 0 && c->slot_pinned[s] != serial) {
            return s; // an empty slot first, whatever the policy
        }
    }
    if (c->eviction == GGML_ZIPMOE_EVICT_MARKING) {
        // randomized marking: a random unmarked slot; when every candidate is marked a new phase starts
        for (int phase = 0; phase < 2 && victim < 0; phase++) {
            int32_t n = 0;
            for (int32_t s = 0; s < c->n_slots; s++) {
                n += c->slot_pinned[s] != serial && !c->slot_marked[s];
            }
            if (n == 0) {
                for (int32_t s = 0; s < c->n_slots; s++) {
                    c->slot_marked[s] = c->slot_pinned[s] == serial;
                }
                continue;
            }
            c->rng ^= c->rng << 13;
            c->rng ^= c->rng >> 7;
            c->rng ^= c->rng << 17;
            int32_t pick = (int32_t) (c->rng % (uint64_t) n);
            for (int32_t s = 0; s < c->n_slots; s++) {
                if (c->slot_pinned[s] != serial && !c->slot_marked[s] && pick-- == 0) {
                    victim = s;
                    break;
                }
            }
        }
        return victim;
    }
    for (int32_t s = 0; s < c->n_slots; s++) {
        if (c->slot_pinned[s] == serial) {
            continue;
        }
        if (victim < 0) {
            victim = s;
            continue;
        }
        int better = 0;
        switch (c->eviction) {
            case GGML_ZIPMOE_EVICT_FIFO:
                better = c->slot_inserted[s] < c->slot_inserted[victim];
                break;
            case GGML_ZIPMOE_EVICT_RANK:
                // working slots (experts outside the F pool) go first
                if (c->slot_transient[s] != c->slot_transient[victim]) {
                    better = c->slot_transient[s] > c->slot_transient[victim];
                    break;
                }
                // fall through - LFU among the rest
            case GGML_ZIPMOE_EVICT_LFU: {
                const uint64_t fs = slot_freq(c, s), fv = slot_freq(c, victim);
                better = fs < fv || (fs == fv && c->slot_last_use[s] < c->slot_last_use[victim]);
                break;
            }
            default: // LRU
                better = c->slot_last_use[s] < c->slot_last_use[victim];
                break;
        }
        if (better) {
            victim = s;
        }
    }
    return victim;
}

// F holds at most f_capacity experts: the least frequent F experts beyond it become working slots
static void enforce_f_capacity(struct ggml_zipmoe_cache * c) {
    if (c->f_capacity >= c->n_slots) {
        return; // one F pool of every slot
    }
    int32_t n_f = 0;
    for (int32_t s = 0; s < c->n_slots; s++) {
        n_f += c->slot_key[s] >= 0 && !c->slot_transient[s];
    }
    for (; n_f > c->f_capacity; n_f--) {
        int32_t victim = -1;
        for (int32_t s = 0; s < c->n_slots; s++) {
            if (c->slot_key[s] < 0 || c->slot_transient[s]) {
                continue;
            }
            if (victim < 0 || slot_freq(c, s) < slot_freq(c, victim) ||
                (slot_freq(c, s) == slot_freq(c, victim) && c->slot_last_use[s] < c->slot_last_use[victim])) {
                victim = s;
            }
        }
        c->slot_transient[victim] = 1;
    }
}

// an entry of the store of pool p for a new expert: an empty one, else LFU (ties LRU); never one
// the current call reads or writes
static int32_t store_victim(struct ggml_zipmoe_cache * c, int p, uint64_t serial) {
    struct zipmoe_store * s = &c->store[p];
    int32_t victim = -1;
    for (int32_t i = 0; i < s->n_entries; i++) {
        if (s->entry_pinned[i] == serial) {
            continue;
        }
        if (s->entry_key[i] < 0) {
            return i;
        }
        if (victim < 0) {
            victim = i;
            continue;
        }
        const uint64_t fi = c->freq[s->entry_key[i]], fv = c->freq[s->entry_key[victim]];
        if (fi < fv || (fi == fv && s->entry_last_use[i] < s->entry_last_use[victim])) {
            victim = i;
        }
    }
    return victim;
}

// where an entry keeps a tensor's SM-chunk and E-chunks: [SM gate][SM up][SM down][E gate][E up][E down]
// (C), [SM gate][SM up][SM down] (S), [E gate][E up][E down] (E)
static uint8_t * entry_sm(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int kind) {
    if (p == GGML_ZIPMOE_POOL_E) {
        return NULL;
    }
    uint64_t off = 0;
    for (int k = 0; k < kind; k++) {
        off += c->kind_n[k];
    }
    return c->store[p].mem + (size_t) entry * c->store[p].entry_size + off;
}

static uint8_t * entry_e(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int layer, int32_t expert, int kind) {
    if (p == GGML_ZIPMOE_POOL_S) {
        return NULL;
    }
    uint64_t off = p == GGML_ZIPMOE_POOL_C ? c->sm_bytes : 0;
    for (int k = 0; k < kind; k++) {
        off += e_bytes(c, c->layer_tensor[layer * 3 + k], expert);
    }
    return c->store[p].mem + (size_t) entry * c->store[p].entry_size + off;
}

static void store_forget(struct ggml_zipmoe_cache * c, int p, int32_t entry) {
    const int64_t key = c->store[p].entry_key[entry];
    if (key >= 0) {
        c->key_pool[key]  = NO_POOL;
        c->key_entry[key] = -1;
    }
    c->store[p].entry_key[entry] = -1;
}

static const int32_t pool_state[4] = { GGML_ZIPMOE_STATE_F, GGML_ZIPMOE_STATE_C, GGML_ZIPMOE_STATE_S,
                                       GGML_ZIPMOE_STATE_E };

// plans one expert that is not in a slot: its working slot, the tasks that make it full from what
// is cached, and where it is kept after use
static void plan_fill(struct ggml_zipmoe_cache * c, int layer, int32_t e, int target, uint64_t serial) {
    const int64_t key = (int64_t) layer * c->max_expert + e;
    const int     cur = c->key_pool[key];
    const int32_t cur_entry = c->key_entry[key];
    const int32_t victim = choose_victim(c, serial);
    if (c->slot_key[victim] >= 0) {
        c->key_slot[c->slot_key[victim]] = -1;
    }
    c->slot_key[victim]       = key;
    c->key_slot[key]          = victim;
    c->slot_pinned[victim]    = serial;
    c->slot_last_use[victim]  = ++c->tick;
    c->slot_inserted[victim]  = c->tick;
    c->slot_marked[victim]    = 1;
    c->slot_transient[victim] = target != GGML_ZIPMOE_POOL_F;
    c->pass_slot[e]           = victim;

    int     dst_pool  = NO_POOL;
    int32_t dst_entry = -1;
    if (cur != NO_POOL) {
        c->store[cur].entry_pinned[cur_entry]   = serial; // read by this call's tasks
        c->store[cur].entry_last_use[cur_entry] = c->tick;
        atomic_fetch_add(&c->store_hits[cur], 1);
    } else {
        atomic_fetch_add(&c->misses, 1);
    }
    if (target != cur && target > GGML_ZIPMOE_POOL_F) {
        dst_pool  = target;
        dst_entry = store_victim(c, target, serial);
        if (dst_entry >= 0) {
            store_forget(c, target, dst_entry);
        } else {
            dst_pool = NO_POOL; // every entry is read or written by this call
        }
    }
    if (cur != NO_POOL && target != cur) {
        store_forget(c, cur, cur_entry); // moves (or is dropped); its bytes stay until this call ends
    }
    if (dst_pool != NO_POOL) {
        c->store[dst_pool].entry_key[dst_entry]      = key;
        c->store[dst_pool].entry_pinned[dst_entry]   = serial;
        c->store[dst_pool].entry_last_use[dst_entry] = c->tick;
        c->key_pool[key]  = (int8_t) dst_pool;
        c->key_entry[key] = dst_entry;
    }
    for (int k = 0; k < 3; k++) {
        struct zipmoe_task * t = &c->tasks[c->n_tasks++];
        t->slot      = victim;
        t->kind      = k;
        t->tensor    = c->layer_tensor[layer * 3 + k];
        t->expert    = e;
        t->state     = cur == NO_POOL ? GGML_ZIPMOE_STATE_M : pool_state[cur];
        t->sm_src    = cur != NO_POOL ? entry_sm(c, cur, cur_entry, k) : NULL;
        t->e_src     = cur != NO_POOL ? entry_e(c, cur, cur_entry, layer, e, k) : NULL;
        t->dst_pool  = dst_pool;
        t->dst_entry = dst_entry;
        t->sm_dst    = dst_pool != NO_POOL ? entry_sm(c, dst_pool, dst_entry, k) : NULL;
        t->e_dst     = dst_pool != NO_POOL ? entry_e(c, dst_pool, dst_entry, layer, e, k) : NULL;
        atomic_store(&t->sm_buf, -1);
        atomic_store(&t->e_buf, -1);
        atomic_store(&t->n_decoded, 0);
        atomic_store(&t->n_recovered, 0);
    }
}

static int reads_sm(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_E;
}

static int reads_e(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_S;
}

// the order of the reads and decompressions: Algorithm 1 (ggml_zipmoe_schedule) on the cost model
// of this machine; the tasks in plan order if the scheduler cannot run
static void schedule_tasks(struct ggml_zipmoe_cache * c) {
    const int32_t K = c->file->n_shards;
    const int32_t L = c->sched_threads;
    for (int i = 0; i < c->n_tasks; i++) {
        const struct zipmoe_task * t = &c->tasks[i];
        c->sched_tasks[i].expert = t->expert;
        c->sched_tasks[i].state  = t->state;
        // an expert's products read its three tensors once per token that chose it
        c->sched_tasks[i].p = (double) c->tokens[t->expert] * 2.0 * (double) c->sm_bytes / c->rate_compute;
    }
    const double n0 = (double) c->kind_n[0];
    const struct ggml_zipmoe_sched_params sp = {
        .u = n0 / c->rate_read, .rho = c->rho, .c = 2.0 * n0 / (double) K / c->rate_decode,
        .n_shards = K, .n_threads = L,
    };
    const size_t need = GGML_ZIPMOE_SCHED_WORK_SIZE(c->n_tasks, K, L);
    if (need > c->sched_work_size) {
        free(c->sched_work);
        c->sched_work = malloc(need);
        c->sched_work_size = c->sched_work != NULL ? need : 0;
    }
    struct ggml_zipmoe_sched_result r = { c->io, c->dec, c->order, c->block_start, c->task_block, 0, 0, 0, 0 };
    if (c->sched_work != NULL &&
        ggml_zipmoe_schedule(c->sched_tasks, c->n_tasks, &sp, c->sched_work, c->sched_work_size, &r) == GGML_ZIPMOE_OK) {
        c->n_io  = r.n_io;
        c->n_dec = r.n_dec;
        return;
    }
    c->n_io = c->n_dec = 0;
    for (int i = 0; i < c->n_tasks; i++) {
        for (int k = 1; k <= K && reads_e(c->tasks[i].state); k++) {
            c->io[c->n_io++] = (struct ggml_zipmoe_sched_op) { i, k };
        }
        if (reads_sm(c->tasks[i].state)) {
            c->io[c->n_io++] = (struct ggml_zipmoe_sched_op) { i, 0 };
        }
        for (int k = 1; k <= K; k++) {
            c->dec[c->n_dec++] = (struct ggml_zipmoe_sched_op) { i, k };
        }
    }
}

// thread 0, under the lock: residency for the experts of this pass, the tasks, their schedule, the slot ids
static int plan_pass(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                     int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids) {
    const int n_unique = collect_unique(c, layer, ids, n_used, n_tokens, ids_stride, c->seen, c->unique);
    if (n_unique < 0) {
        snprintf(c->error, sizeof(c->error), "layer %d: the router selected an expert id outside 0..%d", layer,
                 c->layer_n_expert[layer] - 1);
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int first = pass * c->n_slots;
    const int last  = first + c->n_slots < n_unique ? first + c->n_slots : n_unique;
    const uint64_t serial = ++c->call_serial;
    const int64_t base = (int64_t) layer * c->max_expert;
    if (pass == 0 && !c->preloading) {
        for (int i = 0; i < n_unique; i++) {
            atomic_fetch_add(&c->activations[base + c->unique[i]], 1);
            c->freq[base + c->unique[i]]++;
        }
        atomic_fetch_add(&c->layer_ubatches[layer], 1);
    }
    for (int32_t e = 0; e < c->layer_n_expert[layer]; e++) {
        c->pass_slot[e] = -1;
        c->tokens[e] = 0;
    }
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            c->tokens[ids[t * ids_stride + k]]++;
        }
    }
    // hits first, so that no fill evicts an expert this pass still needs
    for (int i = first; i < last; i++) {
        const int32_t s = c->key_slot[base + c->unique[i]];
        if (s >= 0) {
            c->slot_pinned[s]    = serial;
            c->slot_last_use[s]  = ++c->tick;
            c->slot_marked[s]    = 1;
            // no compressed form of it is in memory: it stays in its slot, first to go if not in F
            c->slot_transient[s] = dispatch_pool(c, layer, c->unique[i]) != GGML_ZIPMOE_POOL_F;
            c->pass_slot[c->unique[i]] = s;
            atomic_fetch_add(&c->hits, 1);
        }
    }
    for (int i = first; i < last; i++) {
        if (c->pass_slot[c->unique[i]] < 0) {
            plan_fill(c, layer, c->unique[i], dispatch_pool(c, layer, c->unique[i]), serial);
        }
    }
    enforce_f_capacity(c);
    if (c->n_tasks > 0) {
        schedule_tasks(c);
    }
    // selections of other passes compute on any slot of this pass; the merge drops their rows
    const int32_t filler = last > first ? c->pass_slot[c->unique[first]] : 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t s = c->pass_slot[ids[t * ids_stride + k]];
            slot_ids[t * n_used + k] = s >= 0 ? s : filler;
        }
    }
    return GGML_ZIPMOE_OK;
}

static void fail_once(struct ggml_zipmoe_cache * c, int status, const struct zipmoe_task * t, int chunk, int sys_errno) {
    int ok = GGML_ZIPMOE_OK;
    if (atomic_compare_exchange_strong(&c->status, &ok, status)) {
        char what[768];
        zipmoe_describe_failure(c->file, status, t->tensor, t->expert, chunk, sys_errno, what, sizeof(what));
        snprintf(c->error, sizeof(c->error), "%s: %s", c->file->path, what);
    }
}

// bytes of one E-chunk's region of an E staging buffer: the largest E-chunk, whole blocks (what an
// O_DIRECT read of it transfers); the SM-chunks, far larger, have a ring of their own
static size_t e_region_bytes(const struct ggml_zipmoe_cache * c) {
    uint64_t largest = 1;
    for (int l = 0; l < c->n_layer; l++) {
        for (int kind = 0; kind < 3 && ggml_zipmoe_cache_has_layer(c, l); kind++) {
            for (int32_t e = 0; e < c->layer_n_expert[l]; e++) {
                for (int k = 1; k <= c->file->n_shards; k++) {
                    const uint64_t size = zipmoe_file_chunk(c->file, c->layer_tensor[l * 3 + kind], e, k)->size;
                    largest = size > largest ? size : largest;
                }
            }
        }
    }
    return (size_t) zipmoe_align_up(largest, GGML_ZIPMOE_CHUNK_ALIGNMENT);
}

// the staging memory, made once (thread 0, before the I/O thread or a worker looks at it)
static int ensure_staging(struct ggml_zipmoe_cache * c) {
    if (c->sm_ring[0].mem != NULL) {
        return GGML_ZIPMOE_OK;
    }
    c->sm_region = (size_t) zipmoe_align_up(c->file->max_values, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    c->e_region  = e_region_bytes(c);
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        void * sm = NULL, * e = NULL;
        if (posix_memalign(&sm, GGML_ZIPMOE_CHUNK_ALIGNMENT, c->sm_region) != 0 ||
            posix_memalign(&e, GGML_ZIPMOE_CHUNK_ALIGNMENT, (size_t) c->file->n_shards * c->e_region) != 0) {
            free(sm);
            snprintf(c->error, sizeof(c->error), "%s: out of memory for staging buffers", c->file->path);
            return GGML_ZIPMOE_ERR_NOMEM;
        }
        c->sm_ring[i].mem = (uint8_t *) sm;
        c->e_ring[i].mem  = (uint8_t *) e;
        atomic_store(&c->sm_ring[i].state, STAGE_FREE);
        atomic_store(&c->e_ring[i].state, STAGE_FREE);
    }
    return GGML_ZIPMOE_OK;
}

// E-chunk k (1..K) of a task, read or kept
static const uint8_t * task_e_chunk(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k) {
    if (t->e_src != NULL) {
        const uint8_t * p = t->e_src;
        for (int j = 1; j < k; j++) {
            p += zipmoe_file_chunk(c->file, t->tensor, t->expert, j)->size;
        }
        return p;
    }
    const struct zipmoe_staging * s = &c->e_ring[atomic_load(&t->e_buf)];
    if (s->base != UINT64_MAX) {
        return s->mem + (zipmoe_file_chunk(c->file, t->tensor, t->expert, k)->offset - s->base);
    }
    return s->mem + (size_t) (k - 1) * c->e_region;
}

static const uint8_t * task_sm(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t) {
    return t->sm_src != NULL ? t->sm_src : c->sm_ring[atomic_load(&t->sm_buf)].mem;
}

// I/O thread: a free buffer of a ring, or -1 when the fetch failed meanwhile
static int acquire_buffer(struct ggml_zipmoe_cache * c, struct zipmoe_staging * ring) {
    for (unsigned spins = 0;; spins++) {
        for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
            int expected = STAGE_FREE;
            if (atomic_compare_exchange_strong(&ring[i].state, &expected, STAGE_BUSY)) {
                return i;
            }
        }
        if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
            return -1;
        }
        pause_waiting(spins);
    }
}

// I/O thread: read and check chunks first..last of a task into a staging buffer. A task's E-chunks
// are stored next to each other (each 4096-aligned: docs/FORMAT.md), so one read of their span
// replaces K small ones; chunks placed otherwise are read one by one.
static int read_chunks(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int first, int last,
                       struct zipmoe_staging * s, size_t region) {
    const struct ggml_zipmoe_file * f = c->file;
    uint64_t lo = UINT64_MAX, hi = 0, stored = 0;
    int packed = 1;
    for (int k = first; k <= last; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(f, t->tensor, t->expert, k);
        packed = packed && (k == first || ch->offset == zipmoe_align_up(hi, GGML_ZIPMOE_CHUNK_ALIGNMENT));
        lo = ch->offset < lo ? ch->offset : lo;
        hi = ch->offset + ch->size > hi ? ch->offset + ch->size : hi;
        stored += ch->size;
    }
    const size_t capacity = region * (size_t) (last - first + 1);
    const uint64_t t0 = now_ns();
    int sys_errno = 0, status = GGML_ZIPMOE_OK, bad = first;
    s->base = UINT64_MAX;
    if (packed && lo % GGML_ZIPMOE_CHUNK_ALIGNMENT == 0 && zipmoe_align_up(hi - lo, GGML_ZIPMOE_CHUNK_ALIGNMENT) <= capacity) {
        const struct zipmoe_chunk span = { lo, hi - lo, 0, 0 };
        status = zipmoe_read_chunk_unchecked(f, &span, s->mem, capacity, &sys_errno);
        s->base = lo;
    } else {
        for (int k = first; k <= last && status == GGML_ZIPMOE_OK; k++) {
            bad = k;
            status = zipmoe_read_chunk_unchecked(f, zipmoe_file_chunk(f, t->tensor, t->expert, k),
                                                 s->mem + (size_t) (k - first) * region, region, &sys_errno);
        }
    }
    atomic_fetch_add(&c->io_ns, now_ns() - t0);
    if (status != GGML_ZIPMOE_OK) {
        fail_once(c, status, t, bad, sys_errno);
        return status;
    }
    atomic_fetch_add(&c->bytes_read, stored);
    for (int k = first; k <= last; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(f, t->tensor, t->expert, k);
        const uint8_t * p = s->base != UINT64_MAX ? s->mem + (ch->offset - s->base) : s->mem + (size_t) (k - first) * region;
        if (ggml_zipmoe_checksum(p, ch->size) != ch->checksum) {
            fail_once(c, GGML_ZIPMOE_ERR_CHECKSUM, t, k, 0);
            return GGML_ZIPMOE_ERR_CHECKSUM;
        }
    }
    return GGML_ZIPMOE_OK;
}

// I/O thread: the schedule's reads in order. A task's E-chunks are read together at the first of
// them (the scheduler lists them back to back), so its shards become ready together.
static void read_all(struct ggml_zipmoe_cache * c) {
    const int K = c->file->n_shards;
    for (int j = 0; j < c->n_io && atomic_load(&c->status) == GGML_ZIPMOE_OK; j++) {
        struct zipmoe_task * t = &c->tasks[c->io[j].task];
        const int sm = c->io[j].chunk == 0;
        if (!sm && atomic_load(&t->e_buf) >= 0) {
            continue;
        }
        struct zipmoe_staging * ring = sm ? c->sm_ring : c->e_ring;
        const int b = acquire_buffer(c, ring);
        if (b < 0) {
            break;
        }
        if (read_chunks(c, t, sm ? 0 : 1, sm ? 0 : K, &ring[b], sm ? c->sm_region : c->e_region) != GGML_ZIPMOE_OK) {
            atomic_store(&ring[b].state, STAGE_FREE);
            break;
        }
        atomic_store(sm ? &t->sm_buf : &t->e_buf, b); // publishes the buffer's bytes
    }
}

static struct zipmoe_worker * worker_of(struct ggml_zipmoe_cache * c, int ith) {
    struct zipmoe_worker * w = &c->workers[ith];
    if (w->decoder == NULL) {
        w->decoder = ggml_zipmoe_decoder_new();
    }
    return w->decoder != NULL ? w : NULL;
}

static int e_ready(const struct zipmoe_task * t) {
    return t->e_src != NULL || atomic_load(&t->e_buf) >= 0;
}

static int sm_ready(const struct zipmoe_task * t) {
    return t->sm_src != NULL || atomic_load(&t->sm_buf) >= 0;
}

// a shard's BF16 values [first, first + count) live in the slot's bytes [2 first, 2 (first + count));
// its exponents wait for the SM-chunk in the upper half of those bytes. Recovery in place is safe:
// value i overwrites bytes 2i and 2i + 1 of the shard, which hold exponents already consumed.
static uint16_t * shard_dst(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, uint64_t first) {
    return (uint16_t *) (c->slot_data[t->kind] + (size_t) t->slot * c->slot_stride[t->kind]) + first;
}

static void recover_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, uint64_t * recover_ns) {
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, &first, &count);
    uint16_t * dst = shard_dst(c, t, first);
    const uint64_t t0 = now_ns();
    ggml_zipmoe_recover_bf16((const uint8_t *) dst + count, task_sm(c, t) + first, count, dst);
    *recover_ns += now_ns() - t0;
    if (atomic_fetch_add(&t->n_recovered, 1) == c->file->n_shards - 1) {
        // the tensor is full: keep its SM-chunk if dispatched to C or S, free its buffer
        if (t->sm_dst != NULL) {
            memcpy(t->sm_dst, task_sm(c, t), c->file->tensors[t->tensor].n);
        }
        if (t->sm_src == NULL) {
            atomic_store(&c->sm_ring[atomic_load(&t->sm_buf)].state, STAGE_FREE);
        }
    }
    atomic_fetch_add(&c->ops_done, 1);
}

// shard k of a task: decode its E-chunk into the slot; 1 if it decoded (0: a failure)
static int decode_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, struct zipmoe_worker * w,
                        uint64_t * decode_ns) {
    const int K = c->file->n_shards;
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, K, k - 1, &first, &count);
    uint8_t * exps = (uint8_t *) shard_dst(c, t, first) + count;
    const uint64_t t0 = now_ns();
    const int status = ggml_zipmoe_decompress(w->decoder, ch->codec, task_e_chunk(c, t, k), ch->size, exps, count);
    *decode_ns += now_ns() - t0;
    if (status != GGML_ZIPMOE_OK) {
        fail_once(c, status, t, k, 0);
        return 0;
    }
    if (atomic_fetch_add(&t->n_decoded, 1) == K - 1) {
        // every E-chunk is decoded: keep them if dispatched to C or E, free their buffer
        if (t->e_dst != NULL) {
            uint8_t * dst = t->e_dst;
            for (int j = 1; j <= K; j++) {
                const uint64_t size = zipmoe_file_chunk(c->file, t->tensor, t->expert, j)->size;
                memcpy(dst, task_e_chunk(c, t, j), size);
                dst += size;
            }
        }
        if (t->e_src == NULL) {
            atomic_store(&c->e_ring[atomic_load(&t->e_buf)].state, STAGE_FREE);
        }
    }
    return 1;
}

// a decoding thread: the first operation of the priority list that can run (a decompression whose
// E-chunks are in memory, or a recovery whose SM-chunk is), until every shard is recovered
static void work_tasks(struct ggml_zipmoe_cache * c, int ith) {
    const int total = c->n_tasks * c->file->n_shards;
    struct zipmoe_worker * w = NULL;
    uint64_t decode_ns = 0, recover_ns = 0;
    unsigned idle = 0;
    while (atomic_load(&c->ops_done) < total && atomic_load(&c->status) == GGML_ZIPMOE_OK) {
        int worked = 0;
        for (int j = atomic_load(&c->first_open); j < c->n_dec && !worked; j++) {
            const int st = atomic_load(&c->op_state[j]);
            if (st == OP_DONE || st == OP_CLAIMED) {
                if (st == OP_DONE && j == atomic_load(&c->first_open)) {
                    atomic_compare_exchange_strong(&c->first_open, &(int) { j }, j + 1);
                }
                continue;
            }
            struct zipmoe_task * t = &c->tasks[c->dec[j].task];
            const int k = c->dec[j].chunk;
            if (st == OP_TODO && e_ready(t)) {
                int expected = OP_TODO;
                if (!atomic_compare_exchange_strong(&c->op_state[j], &expected, OP_CLAIMED)) {
                    continue;
                }
                if (w == NULL && (w = worker_of(c, ith)) == NULL) {
                    int ok = GGML_ZIPMOE_OK;
                    if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_NOMEM)) {
                        snprintf(c->error, sizeof(c->error), "%s: out of memory for a decoder", c->file->path);
                    }
                    break;
                }
                if (!decode_shard(c, t, k, w, &decode_ns)) {
                    break;
                }
                if (sm_ready(t)) {
                    recover_shard(c, t, k, &recover_ns);
                    atomic_store(&c->op_state[j], OP_DONE);
                } else {
                    atomic_store(&c->op_state[j], OP_DECODED);
                }
                worked = 1;
            } else if (st == OP_DECODED && sm_ready(t)) {
                int expected = OP_DECODED;
                if (!atomic_compare_exchange_strong(&c->op_state[j], &expected, OP_CLAIMED)) {
                    continue;
                }
                recover_shard(c, t, k, &recover_ns);
                atomic_store(&c->op_state[j], OP_DONE);
                worked = 1;
            }
        }
        idle = worked ? 0 : idle + 1;
        if (!worked) {
            pause_waiting(idle);
        }
    }
    atomic_fetch_add(&c->decode_ns, decode_ns);
    atomic_fetch_add(&c->recover_ns, recover_ns);
}

static void * io_thread_main(void * arg) {
    struct ggml_zipmoe_cache * c = (struct ggml_zipmoe_cache *) arg;
    uint64_t done = 0;
    for (;;) {
        pthread_mutex_lock(&c->io_lock);
        while (!c->io_quit && c->io_job == done) {
            pthread_cond_wait(&c->io_wake, &c->io_lock);
        }
        const int      quit = c->io_quit;
        const uint64_t job  = c->io_job;
        pthread_mutex_unlock(&c->io_lock);
        if (quit) {
            return NULL;
        }
        // the task list is fixed until end has seen io_done reach this job
        read_all(c);
        done = job;
        atomic_store(&c->io_done, done);
    }
}

static int ensure_io_thread(struct ggml_zipmoe_cache * c) {
    if (c->io_started) {
        return GGML_ZIPMOE_OK;
    }
    if (pthread_create(&c->io_thread, NULL, io_thread_main, c) != 0) {
        snprintf(c->error, sizeof(c->error), "%s: cannot start the cache's I/O thread", c->file->path);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    c->io_started = 1;
    return GGML_ZIPMOE_OK;
}

// slots and store entries whose fill failed hold garbage: forget what they were meant to hold
static void forget_tasks(struct ggml_zipmoe_cache * c) {
    for (int i = 0; i < c->n_tasks; i++) {
        const struct zipmoe_task * t = &c->tasks[i];
        if (c->slot_key[t->slot] >= 0) {
            c->key_slot[c->slot_key[t->slot]] = -1;
            c->slot_key[t->slot] = -1;
        }
        if (t->dst_pool != NO_POOL) {
            store_forget(c, t->dst_pool, t->dst_entry);
        }
    }
}

// thread 0 of end, once every task is done (or the fetch failed): wait for the I/O thread, clean up, unlock
static void finish_fetch(struct ggml_zipmoe_cache * c, uint64_t t_end) {
    if (c->n_io > 0) {
        const struct timespec pause = { 0, 20000 };
        while (atomic_load(&c->io_done) != c->io_job) {
            nanosleep(&pause, NULL);
        }
    }
    if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
        forget_tasks(c);
        for (int i = 0; i < ZIPMOE_N_STAGING && c->sm_ring[0].mem != NULL; i++) {
            atomic_store(&c->sm_ring[i].state, STAGE_FREE);
            atomic_store(&c->e_ring[i].state, STAGE_FREE);
        }
    }
    atomic_fetch_add(&c->fetch_calls, 1);
    atomic_fetch_add(&c->fetch_ns, now_ns() - t_end);
    c->fetch_open = 0;
    pthread_mutex_unlock(&c->lock);
}

// a graph stopped between a fetch's begin and end (an abort callback): stop the I/O thread's
// reads and forget the slots and entries they were for
static void abandon_open_fetch(struct ggml_zipmoe_cache * c) {
    int ok = GGML_ZIPMOE_OK;
    atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_ARG);
    finish_fetch(c, now_ns());
}

int ggml_zipmoe_cache_fetch_begin(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                  int64_t n_used, int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (c->fetch_open && pthread_equal(c->fetch_owner, pthread_self())) {
        abandon_open_fetch(c);
    }
    const uint64_t t0 = now_ns();
    pthread_mutex_lock(&c->lock);
    c->fetch_open  = 1;
    c->fetch_owner = pthread_self();
    c->n_tasks     = 0;
    c->n_io        = 0;
    c->n_dec       = 0;
    int status = GGML_ZIPMOE_ERR_ARG;
    if (!ggml_zipmoe_cache_has_layer(c, layer) || pass < 0 || ids == NULL || slot_ids == NULL) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_fetch: layer %d is not served or bad arguments", layer);
    } else {
        c->error[0] = '\0';
        status = plan_pass(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids);
        if (status == GGML_ZIPMOE_OK && c->n_io > 0) {
            status = ensure_staging(c);
        }
        if (status == GGML_ZIPMOE_OK && c->n_io > 0) {
            status = ensure_io_thread(c);
        }
    }
    if (status != GGML_ZIPMOE_OK) {
        forget_tasks(c);
        c->n_tasks = c->n_io = c->n_dec = 0;
    }
    for (int j = 0; j < c->n_dec; j++) {
        atomic_store(&c->op_state[j], OP_TODO);
    }
    atomic_store(&c->ops_done, 0);
    atomic_store(&c->first_open, 0);
    atomic_store(&c->status, status);
    if (c->n_io > 0) {
        pthread_mutex_lock(&c->io_lock);
        c->io_job++;
        pthread_cond_signal(&c->io_wake);
        pthread_mutex_unlock(&c->io_lock);
    }
    atomic_fetch_add(&c->fetch_ns, now_ns() - t0);
    return status;
}

int ggml_zipmoe_cache_fetch_end(struct ggml_zipmoe_cache * c, int ith, int nth) {
    if (c == NULL || nth < 1 || ith < 0 || ith >= nth) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    // begin ran before this op; nothing changes fetch_open until every thread is past the barrier
    if (!c->fetch_open) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const uint64_t t0 = ith == 0 ? now_ns() : 0;
    int n_decoders = c->n_decoders > 0 && c->n_decoders < nth ? c->n_decoders : nth;
    n_decoders = n_decoders < ZIPMOE_MAX_THREADS ? n_decoders : ZIPMOE_MAX_THREADS;
    if (ith < n_decoders) {
        work_tasks(c, ith);
    }
    barrier(c, nth);
    const int status = atomic_load(&c->status);
    if (ith == 0) {
        c->sched_threads = n_decoders; // the scheduler's L for the next fetch
        finish_fetch(c, t0);
    }
    // the next fetch must not re-plan while another thread still reads this one's state
    barrier(c, nth);
    return status;
}

int ggml_zipmoe_cache_cancel(struct ggml_zipmoe_cache * c) {
    if (c == NULL || !c->fetch_open || !pthread_equal(c->fetch_owner, pthread_self())) {
        return 0;
    }
    abandon_open_fetch(c);
    return 1;
}

size_t ggml_zipmoe_cache_extra_bytes(const struct ggml_zipmoe_cache * c, int n_threads) {
    if (c == NULL) {
        return 0;
    }
    size_t total = 0;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        total += c->store[p].entry_size * (size_t) c->store[p].n_entries;
    }
    // the staging rings as ensure_staging makes them, and a decoder per decoding thread
    const size_t sm_region = (size_t) zipmoe_align_up(c->file->max_values, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    const size_t e_region  = c->e_region != 0 ? c->e_region : e_region_bytes(c);
    total += ZIPMOE_N_STAGING * (sm_region + (size_t) c->file->n_shards * e_region);
    const int n_decoders = c->n_decoders > 0 && c->n_decoders < n_threads ? c->n_decoders : n_threads;
    total += (size_t) (n_decoders > 0 ? n_decoders : 1) * ZIPMOE_DECODER_BYTES;
    // per-slot and per-expert bookkeeping, the scheduler's arrays
    const size_t K = (size_t) c->file->n_shards;
    total += (size_t) c->slot_capacity * (48 + 3 * (sizeof(struct zipmoe_task) + sizeof(struct ggml_zipmoe_sched_task) +
                                                      (2 * K + 1) * sizeof(struct ggml_zipmoe_sched_op) + K * sizeof(atomic_int) + 12));
    return total;
}

struct preload_worker {
    struct ggml_zipmoe_cache * cache;
    int                        ith;
    atomic_int *               nth; // 0 until every worker that could be started is
};

static void * preload_worker_main(void * arg) {
    const struct preload_worker * w = (const struct preload_worker *) arg;
    int nth;
    for (unsigned spins = 0; (nth = atomic_load(w->nth)) == 0; spins++) {
        pause_waiting(spins);
    }
    ggml_zipmoe_cache_fetch_end(w->cache, w->ith, nth);
    return NULL;
}

int ggml_zipmoe_cache_preload(struct ggml_zipmoe_cache * c, int n_threads, int32_t * n_loaded) {
    if (n_loaded != NULL) {
        *n_loaded = 0;
    }
    if (c == NULL || n_threads < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    n_threads = n_threads < ZIPMOE_MAX_THREADS ? n_threads : ZIPMOE_MAX_THREADS;
    // what a fetch counts, kept as it was: preloading is not serving
    atomic_uint_least64_t * counters[] = { &c->fetch_calls, &c->hits, &c->misses, &c->store_hits[0], &c->store_hits[1],
                                           &c->store_hits[2], &c->store_hits[3], &c->bytes_read, &c->io_ns,
                                           &c->decode_ns, &c->recover_ns, &c->fetch_ns };
    uint64_t saved[sizeof(counters) / sizeof(counters[0])];
    for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
        saved[i] = atomic_load(counters[i]);
    }
    // each served layer's share of the slots in use (F's capacity with pools), experts in id order
    const int32_t n_served = c->n_served > 0 ? c->n_served : 1;
    const int32_t share = c->f_capacity / n_served;
    int32_t * ids = (int32_t *) malloc(sizeof(int32_t) * (size_t) (c->max_expert > 0 ? c->max_expert : 1));
    int status = ids != NULL ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_NOMEM;
    int32_t loaded = 0;
    c->preloading = 1;
    for (int l = 0; l < c->n_layer && status == GGML_ZIPMOE_OK; l++) {
        if (!ggml_zipmoe_cache_has_layer(c, l)) {
            continue;
        }
        int32_t n = 0;
        for (int32_t e = 0; e < c->layer_n_expert[l] && n < share; e++) {
            if (c->key_slot[(int64_t) l * c->max_expert + e] < 0) {
                ids[n++] = e;
            }
        }
        if (n == 0) {
            continue;
        }
        int32_t slot_ids_small[256];
        int32_t * slot_ids = n <= 256 ? slot_ids_small : (int32_t *) malloc(sizeof(int32_t) * (size_t) n);
        if (slot_ids == NULL) {
            status = GGML_ZIPMOE_ERR_NOMEM;
            break;
        }
        status = ggml_zipmoe_cache_fetch_begin(c, l, 0, ids, n, 1, n, slot_ids);
        pthread_t threads[ZIPMOE_MAX_THREADS];
        struct preload_worker workers[ZIPMOE_MAX_THREADS];
        atomic_int nth;
        atomic_init(&nth, 0);
        int started = 0;
        for (int t = 1; t < n_threads; t++) {
            workers[t] = (struct preload_worker) { c, t, &nth };
            if (pthread_create(&threads[t], NULL, preload_worker_main, &workers[t]) != 0) {
                break; // fewer decoding threads
            }
            started++;
        }
        atomic_store(&nth, started + 1);
        const int end_status = ggml_zipmoe_cache_fetch_end(c, 0, started + 1);
        for (int t = 1; t <= started; t++) {
            pthread_join(threads[t], NULL);
        }
        if (slot_ids != slot_ids_small) {
            free(slot_ids);
        }
        status = status != GGML_ZIPMOE_OK ? status : end_status;
        loaded += status == GGML_ZIPMOE_OK ? n : 0;
    }
    c->preloading = 0;
    free(ids);
    for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
        atomic_store(counters[i], saved[i]);
    }
    if (n_loaded != NULL) {
        *n_loaded = loaded;
    }
    return status;
}

int ggml_zipmoe_cache_fetch(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                            int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids, int ith, int nth) {
    if (c == NULL || nth < 1 || ith < 0 || ith >= nth) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (ith == 0) {
        ggml_zipmoe_cache_fetch_begin(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids);
    }
    barrier(c, nth);
    return ggml_zipmoe_cache_fetch_end(c, ith, nth);
}

int ggml_zipmoe_cache_merge_pass(const struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                 int64_t n_used, int64_t n_tokens, int64_t ids_stride, const void * acc,
                                 const void * pass_out, void * out, size_t row_bytes, size_t nb1, size_t nb2) {
    // the pass of a selection is its expert's rank among the distinct experts, / n_slots; it is
    // recomputed here from the ids alone (no state shared with the fetch)
    const int32_t n_expert = ggml_zipmoe_cache_n_expert(c, layer);
    if (n_expert <= 0 || ids == NULL || pass_out == NULL || out == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    int32_t rank_small[256];
    int32_t * rank = n_expert <= 256 ? rank_small : (int32_t *) malloc((size_t) n_expert * sizeof(int32_t));
    if (rank == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    for (int32_t e = 0; e < n_expert; e++) {
        rank[e] = -1;
    }
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e = ids[t * ids_stride + k];
            if (e >= 0 && e < n_expert) {
                rank[e] = 0;
            }
        }
    }
    int32_t next = 0;
    for (int32_t e = 0; e < n_expert; e++) {
        if (rank[e] == 0) {
            rank[e] = next++;
        } else {
            rank[e] = -1;
        }
    }
    const int32_t n_slots = ggml_zipmoe_cache_n_slots(c);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e     = ids[t * ids_stride + k];
            const int     mine  = e >= 0 && e < n_expert && rank[e] >= 0 && rank[e] / n_slots == pass;
            const size_t  off   = (size_t) t * nb2 + (size_t) k * nb1;
            const void *  src   = mine || acc == NULL ? (const uint8_t *) pass_out + off : (const uint8_t *) acc + off;
            memcpy((uint8_t *) out + off, src, row_bytes);
        }
    }
    if (rank != rank_small) {
        free(rank);
    }
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_cache_get_stats(const struct ggml_zipmoe_cache * c, struct ggml_zipmoe_cache_stats * s) {
    s->fetch_calls   = atomic_load(&c->fetch_calls);
    s->expert_hits   = atomic_load(&c->hits);
    s->expert_misses = atomic_load(&c->misses);
    s->bytes_read    = atomic_load(&c->bytes_read);
    s->io_ns         = atomic_load(&c->io_ns);
    s->decode_ns     = atomic_load(&c->decode_ns);
    s->recover_ns    = atomic_load(&c->recover_ns);
    s->fetch_ns      = atomic_load(&c->fetch_ns);
    s->c_hits        = atomic_load(&c->store_hits[GGML_ZIPMOE_POOL_C]);
    s->s_hits        = atomic_load(&c->store_hits[GGML_ZIPMOE_POOL_S]);
    s->e_hits        = atomic_load(&c->store_hits[GGML_ZIPMOE_POOL_E]);
}

int ggml_zipmoe_cache_get_activations(const struct ggml_zipmoe_cache * c, int layer, uint64_t * counts,
                                      uint64_t * n_ubatches) {
    if (!ggml_zipmoe_cache_has_layer(c, layer) || counts == NULL || n_ubatches == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int64_t base = (int64_t) layer * c->max_expert;
    for (int32_t e = 0; e < c->layer_n_expert[layer]; e++) {
        counts[e] = atomic_load(&c->activations[base + e]);
    }
    *n_ubatches = atomic_load(&c->layer_ubatches[layer]);
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_cache_reset_stats(struct ggml_zipmoe_cache * c) {
    const size_t n_keys = (size_t) (c->n_layer > 0 ? c->n_layer : 1) * (size_t) (c->max_expert > 0 ? c->max_expert : 1);
    for (size_t i = 0; i < n_keys; i++) {
        atomic_store(&c->activations[i], 0);
    }
    for (int l = 0; l < (c->n_layer > 0 ? c->n_layer : 1); l++) {
        atomic_store(&c->layer_ubatches[l], 0);
    }
    atomic_store(&c->fetch_calls, 0);
    atomic_store(&c->hits, 0);
    atomic_store(&c->misses, 0);
    for (int p = 0; p < 4; p++) {
        atomic_store(&c->store_hits[p], 0);
    }
    atomic_store(&c->bytes_read, 0);
    atomic_store(&c->io_ns, 0);
    atomic_store(&c->decode_ns, 0);
    atomic_store(&c->recover_ns, 0);
    atomic_store(&c->fetch_ns, 0);
}

const char * ggml_zipmoe_cache_error(const struct ggml_zipmoe_cache * c) {
    return c != NULL ? c->error : "no cache";
}
