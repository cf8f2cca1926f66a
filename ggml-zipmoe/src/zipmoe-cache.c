// Expert cache: slots shared by all layers, filled on demand from a ZipMoE GGUF.
//
// A fetch is split in two graph ops so that reading overlaps the graph's other work. Begin (one
// graph thread) plans under the cache's lock: hits, LRU victims among slots the pass does not
// need, slot ids, one task per missing expert tensor. It hands the tasks to the cache's own I/O
// thread, which reads each task's chunks (SM, then the K E-chunks) into a ring of staging
// buffers in task order, and returns. The graph goes on (the shared expert is computed between
// the two ops) while the reads run. End (every graph thread) takes the filled buffers in task
// order, checks the checksums, decodes and recovers into the slots, then waits for the I/O
// thread and releases the lock. Graph threads decode because they would otherwise spin at
// ggml's barrier; the I/O thread only reads, so it costs no core while it waits for the disk.

#define _GNU_SOURCE // sched_yield on older libcs

#include "ggml-zipmoe.h"
#include "zipmoe-impl.h"

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
#define ZIPMOE_N_STAGING   8   // expert tensors read ahead of the decoders (about 4 MB each for real experts)

enum { STAGE_FREE = 0, STAGE_READY = 1 };

// one expert tensor's stored chunks, as read by the I/O thread
struct zipmoe_staging {
    uint8_t *  mem;     // the task's chunks: one read of their span, or an SM-chunk region then K
                        // E-chunk regions, each aligned for O_DIRECT
    uint64_t   base;    // file offset at mem when the span was read in one go, else UINT64_MAX
    atomic_int state;   // STAGE_FREE or STAGE_READY
    atomic_int task;    // task whose chunks it holds or is about to hold
    int        status;  // read status of that task
    int        chunk;   // chunk of a failed read
    int        sys_errno;
};

// per graph thread: decoding state, made on first use
struct zipmoe_worker {
    struct ggml_zipmoe_decoder * decoder;
    uint8_t *                    shard;  // one decoded shard
};

struct zipmoe_task {
    int32_t slot;
    int32_t kind;
    int32_t tensor;
    int32_t expert;
};

struct ggml_zipmoe_cache {
    const struct ggml_zipmoe_file * file;
    int32_t   n_slots;
    uint8_t * slot_data[3];
    size_t    slot_stride[3];

    int       n_layer;          // layers indexable (max layer + 1)
    int32_t * layer_tensor;     // [n_layer][3] repacked tensor index by kind, -1 when not served
    int32_t * layer_n_expert;   // [n_layer]
    int32_t   max_expert;       // largest n_expert over layers

    // residency (guarded by lock; workers only read the task list thread 0 built)
    int32_t *  key_slot;        // [n_layer * max_expert] slot holding (layer, expert), or -1
    int64_t *  slot_key;        // [n_slots] (layer * max_expert + expert), or -1
    uint64_t * slot_last_use;   // [n_slots] tick of the last use (LRU)
    uint64_t * slot_inserted;   // [n_slots] tick of the fill (FIFO)
    uint8_t *  slot_marked;     // [n_slots] marking algorithm's marks
    uint8_t *  slot_transient;  // [n_slots] RANK: its expert ranks beyond the layer's share
    uint64_t * slot_pinned;     // [n_slots] call serial of the last call that needs it
    uint64_t   tick;
    uint64_t * freq;            // [n_layer * max_expert] ubatches that chose each expert (never reset)
    int32_t    eviction;        // enum ggml_zipmoe_eviction
    int32_t    rank_threshold;  // RANK: ranks below it stay (slots per served layer + rank_delta)
    uint64_t   rng;             // MARKING: xorshift64 state
    uint64_t   call_serial;
    int32_t *  unique;          // [max_expert] distinct experts of the current call, ascending
    uint8_t *  seen;            // [max_expert]
    int32_t *  pass_slot;       // [max_expert] slot of each expert of the current pass, or -1

    struct zipmoe_task * tasks; // [3 * n_slots]
    int                  n_tasks;
    atomic_int           next_task;  // next task a decoder takes
    atomic_int           status;
    int32_t              n_decoders; // graph threads that decode (0: all)

    // the open fetch: begin took the lock, end releases it
    int       fetch_open;
    pthread_t fetch_owner;
    uint64_t  fetch_t0;

    // the I/O thread, made on the first miss; it reads job io_job's tasks, then sets io_done
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

    struct zipmoe_staging staging[ZIPMOE_N_STAGING]; // memory made on the first miss
    size_t                sm_region;                 // bytes of the SM region of a staging buffer
    size_t                e_region;                  // bytes of each E-chunk region

    // barrier for the threads of one fetch call
    atomic_int           barrier_count;
    atomic_int           barrier_generation;

    struct zipmoe_worker workers[ZIPMOE_MAX_THREADS]; // by thread index
    pthread_mutex_t      lock; // held from a fetch's begin to its end
    char                 error[1024];

    // statistics
    atomic_uint_least64_t fetch_calls, hits, misses, bytes_read, io_ns, decode_ns, recover_ns, fetch_ns;
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

static void set_error(char * err, size_t err_size, const char * msg) {
    if (err != NULL && err_size > 0) {
        snprintf(err, err_size, "%s", msg);
    }
}

static void abandon_open_fetch(struct ggml_zipmoe_cache * c);

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
        free(c->workers[i].shard);
    }
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        free(c->staging[i].mem);
    }
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
    free(c->tasks);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

struct ggml_zipmoe_cache * ggml_zipmoe_cache_new(const struct ggml_zipmoe_cache_params * p, char * err, size_t err_size) {
    char msg[1024];
    if (p == NULL || p->file == NULL || p->n_slots < 1) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: invalid argument (no file or fewer than 1 slot)");
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
    c->n_decoders = p->n_decoders > 0 ? p->n_decoders : 0;
    if (p->eviction < GGML_ZIPMOE_EVICT_LRU || p->eviction > GGML_ZIPMOE_EVICT_RANK) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: unknown eviction policy");
        pthread_mutex_destroy(&c->lock);
        pthread_mutex_destroy(&c->io_lock);
        pthread_cond_destroy(&c->io_wake);
        free(c);
        return NULL;
    }
    c->eviction = p->eviction;
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
    }
    const size_t n_keys = (size_t) (c->n_layer > 0 ? c->n_layer : 1) * (size_t) (c->max_expert > 0 ? c->max_expert : 1);
    const size_t n_exp  = (size_t) (c->max_expert > 0 ? c->max_expert : 1);
    c->key_slot      = (int32_t *) malloc(n_keys * sizeof(int32_t));
    c->slot_key      = (int64_t *) malloc((size_t) c->n_slots * sizeof(int64_t));
    c->slot_last_use = (uint64_t *) calloc((size_t) c->n_slots, sizeof(uint64_t));
    c->slot_pinned   = (uint64_t *) calloc((size_t) c->n_slots, sizeof(uint64_t));
    c->slot_inserted  = (uint64_t *) calloc((size_t) c->n_slots, sizeof(uint64_t));
    c->slot_marked    = (uint8_t *) calloc((size_t) c->n_slots, 1);
    c->slot_transient = (uint8_t *) calloc((size_t) c->n_slots, 1);
    c->freq           = (uint64_t *) calloc(n_keys, sizeof(uint64_t));
    c->unique        = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->seen          = (uint8_t *) calloc(n_exp, 1);
    c->pass_slot     = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->tasks         = (struct zipmoe_task *) malloc(3 * (size_t) c->n_slots * sizeof(struct zipmoe_task));
    c->activations    = (atomic_uint_least64_t *) calloc(n_keys, sizeof(atomic_uint_least64_t));
    c->layer_ubatches = (atomic_uint_least64_t *) calloc((size_t) (c->n_layer > 0 ? c->n_layer : 1),
                                                         sizeof(atomic_uint_least64_t));
    if (!c->key_slot || !c->slot_key || !c->slot_last_use || !c->slot_pinned || !c->unique || !c->seen ||
        !c->slot_inserted || !c->slot_marked || !c->slot_transient || !c->freq ||
        !c->pass_slot || !c->tasks || !c->activations || !c->layer_ubatches) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: out of memory");
        ggml_zipmoe_cache_free(c);
        return NULL;
    }
    for (size_t i = 0; i < n_keys; i++) {
        c->key_slot[i] = -1;
    }
    for (int32_t s = 0; s < c->n_slots; s++) {
        c->slot_key[s] = -1;
    }
    int n_served = 0;
    for (int l = 0; l < c->n_layer; l++) {
        n_served += ggml_zipmoe_cache_has_layer(c, l);
    }
    c->rank_threshold = c->n_slots / (n_served > 0 ? n_served : 1) + (p->rank_delta > 0 ? p->rank_delta : 0);
    c->rng = 0x9E3779B97F4A7C15ull;
    return c;
}

int32_t ggml_zipmoe_cache_n_slots(const struct ggml_zipmoe_cache * c) {
    return c->n_slots;
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
    return distinct <= 0 ? 1 : (int) ((distinct + c->n_slots - 1) / c->n_slots);
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
                // experts ranked beyond the layer's share were to be evicted after use: they go first
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

// thread 0, under the lock: residency for the experts of this pass, the task list, the slot ids
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
    if (pass == 0) {
        for (int i = 0; i < n_unique; i++) {
            atomic_fetch_add(&c->activations[base + c->unique[i]], 1);
            c->freq[base + c->unique[i]]++;
        }
        atomic_fetch_add(&c->layer_ubatches[layer], 1);
    }

    for (int32_t e = 0; e < c->layer_n_expert[layer]; e++) {
        c->pass_slot[e] = -1;
    }
    // hits first, so that no miss evicts an expert this pass still needs
    for (int i = first; i < last; i++) {
        const int32_t s = c->key_slot[base + c->unique[i]];
        if (s >= 0) {
            c->slot_pinned[s]    = serial;
            c->slot_last_use[s]  = ++c->tick;
            c->slot_marked[s]    = 1;
            c->slot_transient[s] = c->eviction == GGML_ZIPMOE_EVICT_RANK &&
                                   expert_rank(c, layer, c->unique[i]) >= c->rank_threshold;
            c->pass_slot[c->unique[i]] = s;
            atomic_fetch_add(&c->hits, 1);
        }
    }
    for (int i = first; i < last; i++) {
        const int32_t e = c->unique[i];
        if (c->pass_slot[e] >= 0) {
            continue;
        }
        const int32_t victim = choose_victim(c, serial);
        if (c->slot_key[victim] >= 0) {
            c->key_slot[c->slot_key[victim]] = -1;
        }
        c->slot_key[victim]       = base + e;
        c->key_slot[base + e]     = victim;
        c->slot_pinned[victim]    = serial;
        c->slot_last_use[victim]  = ++c->tick;
        c->slot_inserted[victim]  = c->tick;
        c->slot_marked[victim]    = 1;
        c->slot_transient[victim] = c->eviction == GGML_ZIPMOE_EVICT_RANK &&
                                    expert_rank(c, layer, e) >= c->rank_threshold;
        c->pass_slot[e]           = victim;
        for (int k = 0; k < 3; k++) {
            c->tasks[c->n_tasks++] = (struct zipmoe_task) { victim, k, c->layer_tensor[layer * 3 + k], e };
        }
        atomic_fetch_add(&c->misses, 1);
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

// the staging memory, made once (thread 0, before any worker looks at it)
static int ensure_staging(struct ggml_zipmoe_cache * c) {
    if (c->staging[0].mem != NULL) {
        return GGML_ZIPMOE_OK;
    }
    c->sm_region = (size_t) zipmoe_align_up(c->file->max_values, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    c->e_region  = ggml_zipmoe_file_chunk_buffer_size(c->file);
    const size_t size = c->sm_region + (size_t) c->file->n_shards * c->e_region;
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        void * p = NULL;
        if (posix_memalign(&p, GGML_ZIPMOE_CHUNK_ALIGNMENT, size) != 0) {
            snprintf(c->error, sizeof(c->error), "%s: out of memory for staging buffers", c->file->path);
            return GGML_ZIPMOE_ERR_NOMEM;
        }
        c->staging[i].mem = (uint8_t *) p;
        atomic_store(&c->staging[i].state, STAGE_FREE);
    }
    return GGML_ZIPMOE_OK;
}

static uint8_t * staged_chunk(const struct ggml_zipmoe_cache * c, const struct zipmoe_staging * s,
                               const struct zipmoe_task * t, int chunk) {
    if (s->base != UINT64_MAX) {
        return s->mem + (zipmoe_file_chunk(c->file, t->tensor, t->expert, chunk)->offset - s->base);
    }
    return chunk == 0 ? s->mem : s->mem + c->sm_region + (size_t) (chunk - 1) * c->e_region;
}

// a task's chunks are stored next to each other (SM, E0, ..., each 4096-aligned: docs/FORMAT.md),
// so one read of their span replaces K + 1 small ones: the disk sees one large request instead
// of K + 1 at queue depth one. Chunks placed otherwise are read one by one.
// Returns 0 when the chunks are not packed (nothing read), else 1 with the read's status in *status.
static int read_span(struct ggml_zipmoe_cache * c, struct zipmoe_staging * s, const struct zipmoe_task * t,
                     uint64_t * bytes, int * status) {
    uint64_t lo = UINT64_MAX, hi = 0, stored = 0;
    for (int k = 0; k <= c->file->n_shards; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
        lo = ch->offset < lo ? ch->offset : lo;
        hi = ch->offset + ch->size > hi ? ch->offset + ch->size : hi;
        stored += ch->size;
    }
    const size_t capacity = c->sm_region + (size_t) c->file->n_shards * c->e_region;
    if (lo % GGML_ZIPMOE_CHUNK_ALIGNMENT != 0 ||
        zipmoe_align_up(hi - lo, GGML_ZIPMOE_CHUNK_ALIGNMENT) > capacity) {
        return 0;
    }
    const struct zipmoe_chunk span = { lo, hi - lo, 0, 0 };
    s->base = lo;
    *status = zipmoe_read_chunk_unchecked(c->file, &span, s->mem, capacity, &s->sys_errno);
    *bytes  = *status == GGML_ZIPMOE_OK ? stored : 0;
    return 1;
}

// Waiting sleeps after a short spin: the I/O thread waits for decoders that may not run for a
// while (the graph computes between a fetch's begin and end), and decoders wait for reads; a
// spinning or yielding waiter would take a core from the thread it waits for (three threads
// share two cores here)
static void wait_until(atomic_int * value, int want) {
    for (unsigned spins = 0; atomic_load(value) != want; spins++) {
        if (spins < 1024) {
            ZIPMOE_PAUSE();
        } else {
            const struct timespec pause = { 0, 20000 };
            nanosleep(&pause, NULL);
        }
    }
}

// I/O thread: read task i's chunks into its staging buffer (after its previous user freed it)
static void read_task(struct ggml_zipmoe_cache * c, int i) {
    struct zipmoe_staging *    s = &c->staging[i % ZIPMOE_N_STAGING];
    const struct zipmoe_task * t = &c->tasks[i];
    wait_until(&s->state, STAGE_FREE);
    atomic_store(&s->task, i);
    s->status = GGML_ZIPMOE_OK;
    s->chunk = 0;
    s->sys_errno = 0;
    const uint64_t t0 = now_ns();
    uint64_t bytes = 0;
    s->base = UINT64_MAX;
    int span_status = GGML_ZIPMOE_OK;
    if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
        // a failed fetch: the task is drained without reading
    } else if (read_span(c, s, t, &bytes, &span_status)) {
        s->status = span_status; // a failed read of the span is named by its first chunk
    } else {
        for (int k = 0; k <= c->file->n_shards; k++) {
            const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
            const int status = zipmoe_read_chunk_unchecked(c->file, ch, staged_chunk(c, s, t, k),
                                                           k == 0 ? c->sm_region : c->e_region, &s->sys_errno);
            if (status != GGML_ZIPMOE_OK) {
                s->status = status;
                s->chunk = k;
                break;
            }
            bytes += ch->size;
        }
    }
    atomic_fetch_add(&c->io_ns, now_ns() - t0);
    atomic_fetch_add(&c->bytes_read, bytes);
    atomic_store(&s->state, STAGE_READY); // publishes the buffer's bytes and fields
}

static struct zipmoe_worker * worker_of(struct ggml_zipmoe_cache * c, int ith) {
    struct zipmoe_worker * w = &c->workers[ith];
    if (w->decoder == NULL) {
        // once per thread index: a decoder and room for one decoded shard
        w->decoder = ggml_zipmoe_decoder_new();
        w->shard   = (uint8_t *) malloc((size_t) (c->file->max_values / (uint64_t) c->file->n_shards + 1));
        if (w->decoder == NULL || w->shard == NULL) {
            ggml_zipmoe_decoder_free(w->decoder);
            free(w->shard);
            w->decoder = NULL;
            w->shard = NULL;
        }
    }
    return w->decoder != NULL ? w : NULL;
}

// decoder: check, decode and recover task i from its staging buffer into its slot, then free the buffer
static void decode_task(struct ggml_zipmoe_cache * c, int i, int ith) {
    struct zipmoe_staging *    s = &c->staging[i % ZIPMOE_N_STAGING];
    const struct zipmoe_task * t = &c->tasks[i];
    wait_until(&s->task, i); // set before the READY of the same fill
    wait_until(&s->state, STAGE_READY);
    struct zipmoe_worker * w = worker_of(c, ith);
    if (s->status != GGML_ZIPMOE_OK) {
        fail_once(c, s->status, t, s->chunk, s->sys_errno);
    } else if (w == NULL) {
        int ok = GGML_ZIPMOE_OK;
        if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_NOMEM)) {
            snprintf(c->error, sizeof(c->error), "%s: out of memory for a decoder", c->file->path);
        }
    } else if (atomic_load(&c->status) == GGML_ZIPMOE_OK) {
        const uint64_t n = c->file->tensors[t->tensor].n;
        uint16_t * dst = (uint16_t *) (c->slot_data[t->kind] + (size_t) t->slot * c->slot_stride[t->kind]);
        uint64_t decode_ns = 0, recover_ns = 0;
        for (int k = 0; k <= c->file->n_shards; k++) {
            const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
            if (ggml_zipmoe_checksum(staged_chunk(c, s, t, k), ch->size) != ch->checksum) {
                fail_once(c, GGML_ZIPMOE_ERR_CHECKSUM, t, k, 0);
                break;
            }
            if (k == 0) {
                continue;
            }
            uint64_t first, count;
            zipmoe_shard_range(n, c->file->n_shards, k - 1, &first, &count);
            const uint64_t t0 = now_ns();
            const int status = ggml_zipmoe_decompress(w->decoder, ch->codec, staged_chunk(c, s, t, k), ch->size, w->shard,
                                                      count);
            const uint64_t t1 = now_ns();
            decode_ns += t1 - t0;
            if (status != GGML_ZIPMOE_OK) {
                fail_once(c, status, t, k, 0);
                break;
            }
            ggml_zipmoe_recover_bf16(w->shard, staged_chunk(c, s, t, 0) + first, count, dst + first);
            recover_ns += now_ns() - t1;
        }
        atomic_fetch_add(&c->decode_ns, decode_ns);
        atomic_fetch_add(&c->recover_ns, recover_ns);
    }
    atomic_store(&s->state, STAGE_FREE);
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
        for (int i = 0; i < c->n_tasks; i++) {
            read_task(c, i);
        }
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

// slots whose fill failed hold garbage: forget what they were meant to hold
static void forget_tasks(struct ggml_zipmoe_cache * c) {
    for (int i = 0; i < c->n_tasks; i++) {
        const int32_t s = c->tasks[i].slot;
        if (c->slot_key[s] >= 0) {
            c->key_slot[c->slot_key[s]] = -1;
            c->slot_key[s] = -1;
        }
    }
}

static void decode_tasks(struct ggml_zipmoe_cache * c, int ith) {
    // tasks are taken in order, so a decoder only ever waits for the read the I/O thread does next
    for (;;) {
        const int i = atomic_fetch_add(&c->next_task, 1);
        if (i >= c->n_tasks) {
            break;
        }
        decode_task(c, i, ith);
    }
}

// thread 0 of end, once every task is decoded: wait for the I/O thread, clean up, unlock
static void finish_fetch(struct ggml_zipmoe_cache * c, uint64_t t_end) {
    if (c->n_tasks > 0) {
        const struct timespec pause = { 0, 20000 };
        while (atomic_load(&c->io_done) != c->io_job) {
            nanosleep(&pause, NULL);
        }
    }
    if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
        forget_tasks(c);
    }
    atomic_fetch_add(&c->fetch_calls, 1);
    atomic_fetch_add(&c->fetch_ns, now_ns() - t_end);
    c->fetch_open = 0;
    pthread_mutex_unlock(&c->lock);
}

// a graph stopped between a fetch's begin and end (an abort callback): drain the I/O thread's
// buffers without decoding and forget the slots they were for
static void abandon_open_fetch(struct ggml_zipmoe_cache * c) {
    int ok = GGML_ZIPMOE_OK;
    atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_ARG);
    decode_tasks(c, 0);
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
    int status = GGML_ZIPMOE_ERR_ARG;
    if (!ggml_zipmoe_cache_has_layer(c, layer) || pass < 0 || ids == NULL || slot_ids == NULL) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_fetch: layer %d is not served or bad arguments", layer);
    } else {
        c->error[0] = '\0';
        status = plan_pass(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids);
        if (status == GGML_ZIPMOE_OK && c->n_tasks > 0) {
            status = ensure_staging(c);
        }
        if (status == GGML_ZIPMOE_OK && c->n_tasks > 0) {
            status = ensure_io_thread(c);
        }
    }
    if (status != GGML_ZIPMOE_OK) {
        forget_tasks(c);
        c->n_tasks = 0;
    }
    atomic_store(&c->status, status);
    atomic_store(&c->next_task, 0);
    if (c->n_tasks > 0) {
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
        decode_tasks(c, ith);
    }
    barrier(c, nth);
    const int status = atomic_load(&c->status);
    if (ith == 0) {
        finish_fetch(c, t0);
    }
    // the next fetch must not re-plan while another thread still reads this one's state
    barrier(c, nth);
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

void ggml_zipmoe_cache_merge_pass(const struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                  int64_t n_used, int64_t n_tokens, int64_t ids_stride, const void * acc,
                                  const void * pass_out, void * out, size_t row_bytes, size_t nb1, size_t nb2) {
    // the pass of a selection is its expert's rank among the distinct experts, / n_slots; it is
    // recomputed here from the ids alone (no state shared with the fetch)
    const int32_t n_expert = ggml_zipmoe_cache_n_expert(c, layer);
    int32_t rank_small[256];
    int32_t * rank = n_expert <= 256 ? rank_small : (int32_t *) malloc((size_t) n_expert * sizeof(int32_t));
    if (rank == NULL) {
        abort(); // merge only runs with n_expert > 256 on models far bigger than these few KiB
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
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e     = ids[t * ids_stride + k];
            const int     mine  = e >= 0 && e < n_expert && rank[e] >= 0 && rank[e] / c->n_slots == pass;
            const size_t  off   = (size_t) t * nb2 + (size_t) k * nb1;
            const void *  src   = mine || acc == NULL ? (const uint8_t *) pass_out + off : (const uint8_t *) acc + off;
            memcpy((uint8_t *) out + off, src, row_bytes);
        }
    }
    if (rank != rank_small) {
        free(rank);
    }
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
    atomic_store(&c->bytes_read, 0);
    atomic_store(&c->io_ns, 0);
    atomic_store(&c->decode_ns, 0);
    atomic_store(&c->recover_ns, 0);
    atomic_store(&c->fetch_ns, 0);
}

const char * ggml_zipmoe_cache_error(const struct ggml_zipmoe_cache * c) {
    return c != NULL ? c->error : "no cache";
}
