// Expert cache: slots shared by all layers, filled on demand from a ZipMoE GGUF by the threads
// of the ggml graph that asks for them (they would otherwise spin at ggml's barrier).
//
// One fetch call runs at a time per cache (the graph orders them: a layer's fetch depends on
// the previous layer's output). Thread 0 plans under the cache's lock (hits, LRU victims among
// slots this call does not need, slot ids); then every thread takes whole expert tensors from
// a shared task counter and reads, checks, decodes and recovers them straight into the slot.

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
    uint64_t * slot_last_use;   // [n_slots] LRU tick
    uint64_t * slot_pinned;     // [n_slots] call serial of the last call that needs it
    uint64_t   tick;
    uint64_t   call_serial;
    int32_t *  unique;          // [max_expert] distinct experts of the current call, ascending
    uint8_t *  seen;            // [max_expert]
    int32_t *  pass_slot;       // [max_expert] slot of each expert of the current pass, or -1

    struct zipmoe_task * tasks; // [3 * n_slots]
    int                  n_tasks;
    atomic_int           next_task;
    atomic_int           status;

    // barrier for the threads of one fetch call
    atomic_int           barrier_count;
    atomic_int           barrier_generation;

    struct ggml_zipmoe_reader * readers[ZIPMOE_MAX_THREADS]; // by thread index, made on first use
    pthread_mutex_t      lock;
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

void ggml_zipmoe_cache_free(struct ggml_zipmoe_cache * c) {
    if (c == NULL) {
        return;
    }
    for (int i = 0; i < ZIPMOE_MAX_THREADS; i++) {
        ggml_zipmoe_reader_free(c->readers[i]);
    }
    free(c->layer_tensor);
    free(c->layer_n_expert);
    free(c->key_slot);
    free(c->slot_key);
    free(c->slot_last_use);
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
    c->file    = file;
    c->n_slots = p->n_slots;
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
    c->unique        = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->seen          = (uint8_t *) calloc(n_exp, 1);
    c->pass_slot     = (int32_t *) malloc(n_exp * sizeof(int32_t));
    c->tasks         = (struct zipmoe_task *) malloc(3 * (size_t) c->n_slots * sizeof(struct zipmoe_task));
    if (!c->key_slot || !c->slot_key || !c->slot_last_use || !c->slot_pinned || !c->unique || !c->seen ||
        !c->pass_slot || !c->tasks) {
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

    c->n_tasks = 0;
    for (int32_t e = 0; e < c->layer_n_expert[layer]; e++) {
        c->pass_slot[e] = -1;
    }
    // hits first, so that no miss evicts an expert this pass still needs
    for (int i = first; i < last; i++) {
        const int32_t s = c->key_slot[base + c->unique[i]];
        if (s >= 0) {
            c->slot_pinned[s]   = serial;
            c->slot_last_use[s] = ++c->tick;
            c->pass_slot[c->unique[i]] = s;
            atomic_fetch_add(&c->hits, 1);
        }
    }
    for (int i = first; i < last; i++) {
        const int32_t e = c->unique[i];
        if (c->pass_slot[e] >= 0) {
            continue;
        }
        int32_t victim = -1;
        for (int32_t s = 0; s < c->n_slots; s++) {
            if (c->slot_pinned[s] != serial && (victim < 0 || c->slot_last_use[s] < c->slot_last_use[victim])) {
                victim = s;
            }
        }
        // a pass never holds more experts than slots, so a free slot exists
        if (c->slot_key[victim] >= 0) {
            c->key_slot[c->slot_key[victim]] = -1;
        }
        c->slot_key[victim]      = base + e;
        c->key_slot[base + e]    = victim;
        c->slot_pinned[victim]   = serial;
        c->slot_last_use[victim] = ++c->tick;
        c->pass_slot[e]          = victim;
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

static void run_tasks(struct ggml_zipmoe_cache * c, int ith) {
    struct ggml_zipmoe_reader * r = NULL;
    for (;;) {
        const int i = atomic_fetch_add(&c->next_task, 1);
        if (i >= c->n_tasks) {
            break;
        }
        if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
            continue; // drain after a failure
        }
        if (r == NULL) {
            if (c->readers[ith] == NULL) {
                c->readers[ith] = ggml_zipmoe_reader_new(c->file); // once per thread index
            }
            r = c->readers[ith];
            if (r == NULL) {
                int ok = GGML_ZIPMOE_OK;
                if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_NOMEM)) {
                    snprintf(c->error, sizeof(c->error), "%s: out of memory for a chunk reader", c->file->path);
                }
                continue;
            }
        }
        const struct zipmoe_task * t = &c->tasks[i];
        uint16_t * dst = (uint16_t *) (c->slot_data[t->kind] + (size_t) t->slot * c->slot_stride[t->kind]);
        const int status = ggml_zipmoe_read_expert(r, t->tensor, t->expert, dst);
        if (status != GGML_ZIPMOE_OK) {
            int ok = GGML_ZIPMOE_OK;
            if (atomic_compare_exchange_strong(&c->status, &ok, status)) {
                snprintf(c->error, sizeof(c->error), "%s: %s", c->file->path, ggml_zipmoe_reader_error(r));
            }
        }
    }
    if (r != NULL) {
        struct zipmoe_read_times times;
        zipmoe_reader_take_times(r, &times);
        atomic_fetch_add(&c->io_ns, times.io_ns);
        atomic_fetch_add(&c->decode_ns, times.decode_ns);
        atomic_fetch_add(&c->recover_ns, times.recover_ns);
        atomic_fetch_add(&c->bytes_read, times.bytes_read);
    }
}

int ggml_zipmoe_cache_fetch(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                            int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids, int ith, int nth) {
    if (c == NULL || nth < 1 || ith < 0 || ith >= nth) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int n_workers = nth < ZIPMOE_MAX_THREADS ? nth : ZIPMOE_MAX_THREADS;
    uint64_t t0 = 0;
    if (ith == 0) {
        t0 = now_ns();
        pthread_mutex_lock(&c->lock);
        int status = GGML_ZIPMOE_ERR_ARG;
        if (!ggml_zipmoe_cache_has_layer(c, layer) || pass < 0 || ids == NULL || slot_ids == NULL) {
            snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_fetch: layer %d is not served or bad arguments", layer);
        } else {
            c->error[0] = '\0';
            status = plan_pass(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids);
        }
        atomic_store(&c->status, status);
        atomic_store(&c->next_task, 0);
        if (status != GGML_ZIPMOE_OK) {
            c->n_tasks = 0;
        }
    }
    barrier(c, nth);
    if (ith < n_workers) {
        run_tasks(c, ith);
    }
    barrier(c, nth);
    const int status = atomic_load(&c->status);
    if (ith == 0) {
        if (status != GGML_ZIPMOE_OK) {
            // slots whose fill failed hold garbage: forget what they were meant to hold
            for (int i = 0; i < c->n_tasks; i++) {
                const int32_t s = c->tasks[i].slot;
                if (c->slot_key[s] >= 0) {
                    c->key_slot[c->slot_key[s]] = -1;
                    c->slot_key[s] = -1;
                }
            }
        }
        atomic_fetch_add(&c->fetch_calls, 1);
        atomic_fetch_add(&c->fetch_ns, now_ns() - t0);
        pthread_mutex_unlock(&c->lock);
    }
    // the next call's thread 0 must not re-plan while another thread still reads this status
    barrier(c, nth);
    return status;
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

void ggml_zipmoe_cache_reset_stats(struct ggml_zipmoe_cache * c) {
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
