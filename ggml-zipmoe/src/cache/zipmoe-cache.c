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
// A fetch is split in two graph ops so that reading overlaps the graph's other work: begin plans
// (zipmoe-residency.c) and starts the reads, end decodes and recovers (zipmoe-fetch.c). This file
// holds the cache's lifecycle, its public queries and the multi-pass merge (statistics:
// zipmoe-stats.c, with the cost model's rates; preload: zipmoe-preload.c);
// zipmoe-cache-impl.h maps the cache's state to the files.

#include "cache/zipmoe-cache-impl.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_error(char * err, size_t err_size, const char * msg) {
    if (err != NULL && err_size > 0) {
        snprintf(err, err_size, "%s", msg);
    }
}

// every store entry forgotten, the stores freed
static void free_stores(struct ggml_zipmoe_cache * c) {
    const int32_t none[GGML_ZIPMOE_POOL_COUNT] = { 0, 0, 0, 0 };
    zipmoe_cache_resize_stores(c, none, 0, NULL, 0); // shrinking to nothing cannot fail
}

// experts in slots n_slots and beyond are forgotten (the caller may release their memory)
static void forget_slots_from(struct ggml_zipmoe_cache * c, int32_t n_slots) {
    for (int32_t s = n_slots; s < c->slots.n_used; s++) {
        if (c->slots.key[s] >= 0) {
            c->slots.of_key[c->slots.key[s]] = -1;
        }
        c->slots.key[s]       = -1;
        c->slots.pinned[s]    = 0;
        c->slots.marked[s]    = 0;
        c->slots.transient[s] = 0;
    }
}

void ggml_zipmoe_cache_free(struct ggml_zipmoe_cache * c) {
    if (c == NULL) {
        return;
    }
    if (c->fetch_open) {
        zipmoe_cache_abandon_fetch(c);
    }
    if (c->pipe.io_started) {
        atomic_store(&c->prefetch.interrupt, 1); // a prefetch's reads stop after the one in progress
        pthread_mutex_lock(&c->pipe.io_lock);
        c->pipe.io_quit = 1;
        pthread_cond_signal(&c->pipe.io_wake);
        pthread_mutex_unlock(&c->pipe.io_lock);
        pthread_join(c->pipe.io_thread, NULL);
    }
    pthread_mutex_destroy(&c->pipe.io_lock);
    pthread_cond_destroy(&c->pipe.io_wake);
    pthread_cond_destroy(&c->prefetch.idle);
    zipmoe_prefetch_free(c);
    zipmoe_substitution_free(c->subst);
    zipmoe_gpu_free(c->gpu);
    free(c->stats.activations);
    free(c->stats.layer_ubatches);
    free(c->stats.selections);
    free(c->stats.layer_tokens);
    for (int i = 0; i < ZIPMOE_MAX_THREADS; i++) {
        ggml_zipmoe_decoder_free(c->pipe.workers[i].decoder);
        free(c->pipe.workers[i].staging);
    }
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        free(c->pipe.sm_ring[i].mem);
        free(c->pipe.e_ring[i].mem);
    }
    free_stores(c);
    free(c->pools.key_pool);
    free(c->pools.key_entry);
    free(c->layout.layer_tensor);
    free(c->layout.layer_n_expert);
    free(c->slots.of_key);
    free(c->slots.key);
    free(c->slots.last_use);
    free(c->slots.inserted);
    free(c->slots.marked);
    free(c->slots.transient);
    free(c->policy.freq);
    free(c->policy.selected);
    free(c->policy.score_ring);
    free(c->policy.score_sum);
    free(c->policy.layer_iter);
    pthread_mutex_destroy(&c->policy.score_lock);
    free(c->slots.pinned);
    free(c->plan.unique);
    free(c->plan.seen);
    free(c->plan.pass_slot);
    zipmoe_cpu_slots_free(c);
    free(c->plan.tokens);
    free(c->plan.tasks);
    free(c->plan.sched_tasks);
    free(c->plan.io);
    free(c->plan.dec);
    free(c->pipe.op_state);
    free(c->pipe.parked);
    free(c->plan.sched_work);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

// the parameters a cache cannot be made from, as a message (NULL when they are fine)
static const char * check_params(const struct ggml_zipmoe_cache_params * p, int * n_pools) {
    if (p == NULL || p->file == NULL || p->n_slots < 1) {
        return "ggml_zipmoe_cache_new: invalid argument (no file or fewer than 1 slot)";
    }
    if (p->n_layer < 0 || (p->n_layer > 0 && p->layer_tensors == NULL)) {
        return "ggml_zipmoe_cache_new: n_layer is negative or layer_tensors is missing";
    }
    if (p->eviction < 0 || p->eviction >= GGML_ZIPMOE_EVICT_COUNT) {
        return "ggml_zipmoe_cache_new: unknown eviction policy";
    }
    *n_pools = 0;
    for (int i = 0; i < GGML_ZIPMOE_POOL_COUNT; i++) {
        if (p->pool_capacity[i] < 0) {
            return "ggml_zipmoe_cache_new: a pool capacity is negative";
        }
        *n_pools += p->pool_capacity[i] > 0;
    }
    if (*n_pools > 0 && p->eviction != GGML_ZIPMOE_EVICT_RANK) {
        return "ggml_zipmoe_cache_new: pools dispatch by rank: the eviction policy must be rank";
    }
    if (p->rate_read < 0 || p->rate_decode < 0 || p->rate_compute < 0) {
        return "ggml_zipmoe_cache_new: a rate of the cost model is negative";
    }
    if (p->prefetch_experts < 0) {
        return "ggml_zipmoe_cache_new: prefetch_experts is negative";
    }
    if (p->lookahead_experts < 0) {
        return "ggml_zipmoe_cache_new: lookahead_experts is negative";
    }
    if (p->slot_memory != GGML_ZIPMOE_SLOTS_HOST && p->slot_memory != GGML_ZIPMOE_SLOTS_CUDA &&
        p->slot_memory != GGML_ZIPMOE_SLOTS_DEVICE) {
        return "ggml_zipmoe_cache_new: slot_memory is not host, CUDA or a device's";
    }
    if (p->slot_memory == GGML_ZIPMOE_SLOTS_DEVICE && p->slot_write == NULL) {
        return "ggml_zipmoe_cache_new: slots in a device's memory (slot_memory DEVICE) need slot_write";
    }
    return NULL;
}

// the layout from the caller's layer -> tensors table: one slot shape per kind, all three kinds
// or none in a layer, the same expert count for a layer's kinds
static int map_layers(struct ggml_zipmoe_cache * c, const struct ggml_zipmoe_cache_params * p, char * msg,
                      size_t msg_size) {
    static const char * kinds[3] = { "gate", "up", "down" };
    const struct ggml_zipmoe_file * file = c->file;
    struct zipmoe_layout * lay = &c->layout;
    lay->n_layer        = p->n_layer;
    lay->layer_tensor   = (int32_t *) malloc(sizeof(int32_t) * 3 * (size_t) (lay->n_layer > 0 ? lay->n_layer : 1));
    lay->layer_n_expert = (int32_t *) calloc((size_t) (lay->n_layer > 0 ? lay->n_layer : 1), sizeof(int32_t));
    if (lay->layer_tensor == NULL || lay->layer_n_expert == NULL) {
        snprintf(msg, msg_size, "ggml_zipmoe_cache_new: out of memory");
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    int64_t slot_ne[3][2] = { { 0, 0 }, { 0, 0 }, { 0, 0 } };
    for (int l = 0; l < lay->n_layer; l++) {
        int found = 0;
        for (int k = 0; k < 3; k++) {
            const int32_t t = p->layer_tensors[l * 3 + k];
            if (t < -1 || t >= file->n_tensors) {
                snprintf(msg, msg_size, "ggml_zipmoe_cache_new: layer %d's %s tensor index %d is not a repacked tensor "
                         "of %s (0..%d)", l, kinds[k], t, file->path, file->n_tensors - 1);
                return GGML_ZIPMOE_ERR_ARG;
            }
            lay->layer_tensor[l * 3 + k] = t;
            if (t < 0) {
                continue;
            }
            found++;
            const int64_t * ne = file->tensors[t].ne;
            if (slot_ne[k][0] == 0) {
                slot_ne[k][0] = ne[0];
                slot_ne[k][1] = ne[1];
            }
            // a quantized file may give some layers' experts another type (Q4_K_M: Q6_K in some): its
            // slots are the largest
            const struct zipmoe_tensor * ft = &file->tensors[t];
            lay->kind_n[k]     = ft->sm_size > lay->kind_n[k] ? ft->sm_size : lay->kind_n[k];
            lay->kind_bytes[k] = ft->bytes > lay->kind_bytes[k] ? ft->bytes : lay->kind_bytes[k];
            lay->any_raw      |= ft->raw;
            if (ft->bytes > c->slots.stride[k] && c->slots.stride[k] != 0) {
                snprintf(msg, msg_size, "%s: an expert of %s takes %llu bytes, more than the %zu bytes between "
                         "%s slots", file->path, ft->name, (unsigned long long) ft->bytes, c->slots.stride[k], kinds[k]);
                return GGML_ZIPMOE_ERR_ARG;
            }
            if (ne[0] != slot_ne[k][0] || ne[1] != slot_ne[k][1]) {
                snprintf(msg, msg_size, "%s: %s is %lld x %lld, other layers' %s experts are %lld x %lld: one slot "
                         "shape cannot hold both", file->path, file->tensors[t].name, (long long) ne[0],
                         (long long) ne[1], kinds[k], (long long) slot_ne[k][0], (long long) slot_ne[k][1]);
                return GGML_ZIPMOE_ERR_ARG;
            }
            if (lay->layer_n_expert[l] == 0) {
                lay->layer_n_expert[l] = (int32_t) ne[2];
            }
            if (ne[2] != lay->layer_n_expert[l]) {
                snprintf(msg, msg_size, "%s: layer %d's gate, up and down experts differ in count", file->path, l);
                return GGML_ZIPMOE_ERR_ARG;
            }
        }
        if (found != 0 && found != 3) {
            snprintf(msg, msg_size, "%s: layer %d has %d of the 3 routed-expert tensors repacked (gate, up, down "
                     "must all be)", file->path, l, found);
            return GGML_ZIPMOE_ERR_ARG;
        }
        lay->max_expert = lay->layer_n_expert[l] > lay->max_expert ? lay->layer_n_expert[l] : lay->max_expert;
        lay->n_served += found == 3;
    }
    lay->sm_bytes     = lay->kind_n[0] + lay->kind_n[1] + lay->kind_n[2];
    lay->expert_bytes = lay->kind_bytes[0] + lay->kind_bytes[1] + lay->kind_bytes[2];
    return GGML_ZIPMOE_OK;
}

// the per-key, per-slot and per-task arrays
static int alloc_bookkeeping(struct ggml_zipmoe_cache * c) {
    const size_t n_keys    = zipmoe_cache_n_keys(c);
    const size_t n_exp     = (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1);
    const size_t cap       = (size_t) c->slots.capacity;
    const size_t max_tasks = 3 * cap;
    const size_t K         = (size_t) c->file->n_shards;
    struct zipmoe_slots * sl = &c->slots;
    struct zipmoe_plan *  pl = &c->plan;
    sl->of_key    = (int32_t *) malloc(n_keys * sizeof(int32_t));
    sl->key       = (int64_t *) malloc(cap * sizeof(int64_t));
    sl->last_use  = (uint64_t *) calloc(cap, sizeof(uint64_t));
    sl->pinned    = (uint64_t *) calloc(cap, sizeof(uint64_t));
    sl->inserted  = (uint64_t *) calloc(cap, sizeof(uint64_t));
    sl->marked    = (uint8_t *) calloc(cap, 1);
    sl->transient = (uint8_t *) calloc(cap, 1);
    c->pools.key_pool  = (int8_t *) malloc(n_keys);
    c->pools.key_entry = (int32_t *) malloc(n_keys * sizeof(int32_t));
    c->policy.freq     = (uint64_t *) calloc(n_keys, sizeof(uint64_t));
    c->policy.selected = (uint64_t *) calloc(n_keys, sizeof(uint64_t));
    if (c->policy.eviction == GGML_ZIPMOE_EVICT_SCORE) {
        c->policy.score_ring = (float *) calloc(n_keys * GGML_ZIPMOE_SCORE_WINDOW, sizeof(float));
        c->policy.score_sum  = (double *) calloc(n_keys, sizeof(double));
        c->policy.layer_iter = (uint64_t *) calloc((size_t) (c->layout.n_layer > 0 ? c->layout.n_layer : 1),
                                                   sizeof(uint64_t));
        if (!c->policy.score_ring || !c->policy.score_sum || !c->policy.layer_iter) {
            return GGML_ZIPMOE_ERR_NOMEM;
        }
    }
    pl->unique      = (int32_t *) malloc(n_exp * sizeof(int32_t));
    pl->seen        = (uint8_t *) calloc(n_exp, 1);
    pl->pass_slot   = (int32_t *) malloc(n_exp * sizeof(int32_t));
    pl->tokens      = (int32_t *) malloc(n_exp * sizeof(int32_t));
    pl->tasks       = (struct zipmoe_task *) calloc(max_tasks, sizeof(struct zipmoe_task));
    pl->sched_tasks = (struct ggml_zipmoe_sched_task *) malloc(max_tasks * sizeof(struct ggml_zipmoe_sched_task));
    pl->io          = (struct ggml_zipmoe_sched_op *) malloc(max_tasks * (K + 1) * sizeof(struct ggml_zipmoe_sched_op));
    pl->dec         = (struct ggml_zipmoe_sched_op *) malloc(max_tasks * K * sizeof(struct ggml_zipmoe_sched_op));
    c->pipe.op_state      = (atomic_int *) calloc(max_tasks * K, sizeof(atomic_int));
    c->pipe.parked        = (uint8_t **) calloc(max_tasks * K, sizeof(uint8_t *));
    c->stats.activations  = (atomic_uint_least64_t *) calloc(n_keys, sizeof(atomic_uint_least64_t));
    c->stats.layer_ubatches = (atomic_uint_least64_t *) calloc((size_t) (c->layout.n_layer > 0 ? c->layout.n_layer : 1),
                                                               sizeof(atomic_uint_least64_t));
    c->stats.selections   = (atomic_uint_least64_t *) calloc(2 * n_keys, sizeof(atomic_uint_least64_t));
    c->stats.layer_tokens = (atomic_uint_least64_t *) calloc((size_t) (c->layout.n_layer > 0 ? c->layout.n_layer : 1),
                                                             sizeof(atomic_uint_least64_t));
    if (!sl->of_key || !sl->key || !sl->last_use || !sl->pinned || !sl->inserted || !sl->marked || !sl->transient ||
        !c->pools.key_pool || !c->pools.key_entry || !c->policy.freq || !pl->unique || !pl->seen || !pl->pass_slot ||
        !pl->tokens || !pl->tasks || !pl->sched_tasks || !pl->io || !pl->dec || !c->pipe.op_state || !c->pipe.parked ||
        !c->stats.activations || !c->stats.layer_ubatches || !c->policy.selected || !c->stats.selections ||
        !c->stats.layer_tokens) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    for (size_t i = 0; i < n_keys; i++) {
        sl->of_key[i]         = -1;
        c->pools.key_pool[i]  = NO_POOL;
        c->pools.key_entry[i] = -1;
    }
    for (size_t s = 0; s < cap; s++) {
        sl->key[s] = -1;
    }
    return GGML_ZIPMOE_OK;
}

// the active pools, their thresholds tau_p and F's capacity; the stores of C, S and E
static int set_up_pools(struct ggml_zipmoe_cache * c, const int32_t * capacity, int n_pools, uint64_t max_e,
                        char * msg, size_t msg_size) {
    struct zipmoe_pools * pools = &c->pools;
    if (n_pools == 0) {
        // one F pool of every slot (the planner's Lambda = {F}); only the RANK policy dispatches
        pools->n_active  = 1;
        pools->active[0] = GGML_ZIPMOE_POOL_F;
        zipmoe_cache_share_single_pool(c);
        if (pools->migrating) { // C keeps the experts F takes until they are decoded from it
            return zipmoe_cache_resize_stores(c, capacity, max_e, msg, msg_size);
        }
        free_stores(c);
        return GGML_ZIPMOE_OK;
    }
    int32_t sum = 0;
    for (int i = 0; i < GGML_ZIPMOE_POOL_COUNT; i++) {
        if (capacity[i] > 0) {
            sum += capacity[i];
            pools->active[pools->n_active++] = i;
            pools->threshold[i] = sum + c->policy.rank_delta;
        }
    }
    pools->f_capacity = capacity[GGML_ZIPMOE_POOL_F] * c->layout.n_served;
    if (pools->f_capacity >= c->slots.n_used) {
        snprintf(msg, msg_size, "ggml_zipmoe_cache_new: pool F holds %d experts in %d served layers = %d slots, "
                 "but there are only %d slots: at least one must be a working slot", capacity[GGML_ZIPMOE_POOL_F],
                 c->layout.n_served, pools->f_capacity, c->slots.n_used);
        return GGML_ZIPMOE_ERR_ARG;
    }
    return zipmoe_cache_resize_stores(c, capacity, max_e, msg, msg_size);
}

struct ggml_zipmoe_cache * ggml_zipmoe_cache_new(const struct ggml_zipmoe_cache_params * p, char * err, size_t err_size) {
    int n_pools = 0;
    const char * bad = check_params(p, &n_pools);
    if (bad != NULL) {
        set_error(err, err_size, bad);
        return NULL;
    }
    struct ggml_zipmoe_cache * c = (struct ggml_zipmoe_cache *) calloc(1, sizeof(*c));
    if (c == NULL) {
        set_error(err, err_size, "ggml_zipmoe_cache_new: out of memory");
        return NULL;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->policy.score_lock, NULL);
    pthread_mutex_init(&c->pipe.io_lock, NULL);
    pthread_cond_init(&c->pipe.io_wake, NULL);
    pthread_cond_init(&c->prefetch.idle, NULL);
    c->file              = p->file;
    c->slots.n_used      = p->n_slots;
    c->slots.capacity    = p->n_slots;
    c->policy.rank_delta = p->rank_delta > 0 ? p->rank_delta : 0;
    c->policy.eviction   = p->eviction;
    c->policy.rng        = 0x9E3779B97F4A7C15ull;
    c->n_decoders        = p->n_decoders > 0 ? p->n_decoders : 0;
    c->plan.rate_read     = p->rate_read > 0 ? p->rate_read : ggml_zipmoe_default_rate(GGML_ZIPMOE_RATE_READ);
    c->plan.rate_decode   = p->rate_decode > 0 ? p->rate_decode : ggml_zipmoe_default_rate(GGML_ZIPMOE_RATE_DECODE);
    c->plan.rate_compute  = p->rate_compute > 0 ? p->rate_compute : ggml_zipmoe_default_rate(GGML_ZIPMOE_RATE_COMPUTE);
    c->plan.measure_read   = p->rate_read > 0 ? GGML_ZIPMOE_RATE_GIVEN : GGML_ZIPMOE_RATE_DEFAULT;
    c->plan.measure_decode = p->rate_decode > 0 ? GGML_ZIPMOE_RATE_GIVEN : GGML_ZIPMOE_RATE_DEFAULT;
    c->plan.compute_given  = p->rate_compute > 0;
    c->plan.sched_threads = c->n_decoders > 0 ? c->n_decoders : 1;
    for (int k = 0; k < 3; k++) {
        c->slots.data[k]   = (uint8_t *) p->slot_data[k];
        c->slots.stride[k] = p->slot_stride[k];
    }
    c->slots.fill       = p->slot_fill;
    c->slots.fill_data  = p->slot_fill_data;
    c->slots.own_pages  = p->slot_pages_movable && p->slot_memory == GGML_ZIPMOE_SLOTS_HOST;
    c->slots.take_pages = c->slots.own_pages && zipmoe_can_move_pages();
    char msg[1024] = "ggml_zipmoe_cache_new: out of memory";
    int status = map_layers(c, p, msg, sizeof(msg));
    if (status == GGML_ZIPMOE_OK) {
        status = alloc_bookkeeping(c);
    }
    if (status == GGML_ZIPMOE_OK) {
        c->subst = zipmoe_substitution_new(c->layout.n_layer, c->layout.layer_n_expert);
        status   = c->subst != NULL ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_NOMEM;
    }
    if (status == GGML_ZIPMOE_OK) {
        status = zipmoe_prefetch_init(c, p->prefetch_experts, p->lookahead_experts);
    }
    const int32_t compressed_pools = p->pool_capacity[GGML_ZIPMOE_POOL_C] + p->pool_capacity[GGML_ZIPMOE_POOL_S] +
                                     p->pool_capacity[GGML_ZIPMOE_POOL_E];
    if (status == GGML_ZIPMOE_OK && c->layout.any_raw && (compressed_pools > 0 || p->slot_memory == GGML_ZIPMOE_SLOTS_CUDA)) {
        // nothing to decompress: no compressed pool to keep, and no recovery kernel for them
        snprintf(msg, sizeof(msg), "%s: its routed experts are not BF16 (a quantized file: stored raw, nothing to "
                 "decompress), so %s", c->file->path, compressed_pools > 0 ? "pools C, S and E do not apply: give F "
                 "only, or no pools" : "this build serves them from host memory only, not from slots in CUDA memory");
        status = GGML_ZIPMOE_ERR_ARG;
    }
    if (status == GGML_ZIPMOE_OK) {
        status = zipmoe_device_init(c, p, msg, sizeof(msg));
    }
    if (status == GGML_ZIPMOE_OK) {
        c->layout.max_e_bytes = zipmoe_cache_measure_e_bytes(c); // also rho, for the scheduler
        status = set_up_pools(c, p->pool_capacity, n_pools, c->layout.max_e_bytes, msg, sizeof(msg));
    }
    if (status != GGML_ZIPMOE_OK) {
        set_error(err, err_size, msg);
        ggml_zipmoe_cache_free(c);
        return NULL;
    }
    return c;
}

int ggml_zipmoe_cache_pool_entries(const struct ggml_zipmoe_cache * c, int pool, size_t * entry_bytes) {
    if (c == NULL || pool < GGML_ZIPMOE_POOL_F || pool > GGML_ZIPMOE_POOL_E) {
        return -1;
    }
    if (pool == GGML_ZIPMOE_POOL_F) {
        if (entry_bytes != NULL) {
            *entry_bytes = (size_t) c->layout.expert_bytes;
        }
        return c->pools.f_capacity;
    }
    if (entry_bytes != NULL) {
        *entry_bytes = c->pools.store[pool].entry_size;
    }
    return c->pools.store[pool].n_entries;
}

int32_t ggml_zipmoe_cache_n_slots(const struct ggml_zipmoe_cache * c) {
    return __atomic_load_n(&c->slots.n_used, __ATOMIC_RELAXED);
}

int32_t ggml_zipmoe_cache_slot_capacity(const struct ggml_zipmoe_cache * c) {
    return c->slots.capacity;
}

int ggml_zipmoe_cache_set_n_slots(struct ggml_zipmoe_cache * c, int32_t n_slots) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    ggml_zipmoe_cache_cancel(c); // a fetch this thread left open would hold the lock
    pthread_mutex_lock(&c->lock);
    int status = GGML_ZIPMOE_OK;
    if (n_slots < 1 || n_slots > c->slots.capacity) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_n_slots: %d slots asked, the slot tensors hold "
                 "1 to %d", n_slots, c->slots.capacity);
        status = GGML_ZIPMOE_ERR_ARG;
    }
    if (status == GGML_ZIPMOE_OK && !(c->pools.n_active == 1 && c->pools.active[0] == GGML_ZIPMOE_POOL_F) &&
        n_slots <= c->pools.f_capacity) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_n_slots: pool F holds %d slots, so at least %d "
                 "slots are needed (one working slot), not %d", c->pools.f_capacity, c->pools.f_capacity + 1, n_slots);
        status = GGML_ZIPMOE_ERR_ARG;
    }
    if (status == GGML_ZIPMOE_OK) {
        forget_slots_from(c, n_slots); // slots taken on start empty
        __atomic_store_n(&c->slots.n_used, n_slots, __ATOMIC_RELAXED);
        if (c->pools.n_active == 1 && c->pools.active[0] == GGML_ZIPMOE_POOL_F) {
            zipmoe_cache_share_single_pool(c);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return status;
}

int ggml_zipmoe_cache_set_pools(struct ggml_zipmoe_cache * c, const int32_t * capacity, int32_t n_slots,
                                int inclusive) {
    return zipmoe_cache_change_pools(c, capacity, n_slots, inclusive, 0);
}

int zipmoe_cache_change_pools(struct ggml_zipmoe_cache * c, const int32_t * capacity, int32_t n_slots, int inclusive,
                              int migrating) {
    if (c == NULL || capacity == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    int n_pools = 0;
    for (int i = 0; i < GGML_ZIPMOE_POOL_COUNT; i++) {
        if (capacity[i] < 0) {
            snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_pools: pool %s's capacity is negative",
                     ggml_zipmoe_pool_name(i));
            return GGML_ZIPMOE_ERR_ARG;
        }
        n_pools += capacity[i] > 0;
    }
    if (n_pools > 0 && c->policy.eviction != GGML_ZIPMOE_EVICT_RANK) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_pools: pools dispatch by rank: the eviction "
                 "policy must be rank, not %s", ggml_zipmoe_eviction_name(c->policy.eviction));
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (n_slots < 1 || n_slots > c->slots.capacity) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_pools: %d slots asked, the slot tensors hold 1 "
                 "to %d", n_slots, c->slots.capacity);
        return GGML_ZIPMOE_ERR_ARG;
    }
    ggml_zipmoe_cache_cancel(c); // a fetch this thread left open would hold the lock
    zipmoe_prefetch_pause(c, 1); // a prefetch planned with the old pools reads nothing more
    pthread_mutex_lock(&c->lock);
    pthread_mutex_lock(&c->pipe.io_lock);
    c->prefetch.latest  = -1;
    c->prefetch.pending = 0;
    pthread_mutex_unlock(&c->pipe.io_lock);
    // the stores keep what still fits them (set_up_pools resizes them under the new thresholds);
    // experts in the slots given up are forgotten
    forget_slots_from(c, n_slots);
    const int32_t old_used = c->slots.n_used;
    if (c->slots.own_pages && zipmoe_cache_slots_in_host(c)) {
        // before the stores grow, whose new entries are faulted in at once: four DeepSeek-V2-Lite sequences
        // at 20 GiB changing from F 20 / C 27 to more C held both, 2.7 GB more, and the cap ended them
        for (int j = 0; j < 3 && n_slots < old_used; j++) {
            zipmoe_release_pages(c->slots.data[j] + (size_t) n_slots * c->slots.stride[j],
                                 (size_t) (old_used - n_slots) * c->slots.stride[j]);
        }
    }
    for (int32_t s = 0; s < c->slots.capacity; s++) {
        c->slots.pinned[s]    = 0;
        c->slots.marked[s]    = 0;
        c->slots.transient[s] = 0;
    }
    __atomic_store_n(&c->slots.n_used, n_slots, __ATOMIC_RELAXED);
    c->pools.n_active  = 0;
    c->pools.inclusive = 0;
    c->pools.migrating = migrating && (n_pools == 0 || capacity[GGML_ZIPMOE_POOL_F] > 0); // an F that takes experts
    // the slots past those in use so far, empty, take the pages of the entries the stores give up (the
    // migration closes the sink once its experts are decoded, before C's last shrink)
    const int sink = c->pools.migrating && c->slots.take_pages && zipmoe_cache_slots_in_host(c);
    zipmoe_sink_open(c, old_used, sink ? n_slots : 0);
    char msg[1024];
    int status = set_up_pools(c, capacity, n_pools, c->layout.max_e_bytes, msg, sizeof(msg));
    if (status != GGML_ZIPMOE_OK) {
        zipmoe_sink_close(c);
        // the stores could not be made: one F pool of every slot, as before any pools
        const int32_t none[GGML_ZIPMOE_POOL_COUNT] = { 0, 0, 0, 0 };
        c->pools.n_active = 0;
        c->pools.migrating = 0;
        set_up_pools(c, none, 0, 0, NULL, 0); // frees the stores
        snprintf(c->error, sizeof(c->error), "%s", msg);
    } else {
        c->pools.inclusive = inclusive && n_pools > 0 && capacity[GGML_ZIPMOE_POOL_C] >= c->layout.max_expert;
    }
    pthread_mutex_unlock(&c->lock);
    return status;
}

int32_t ggml_zipmoe_cache_resident_base(struct ggml_zipmoe_cache * c, int layer) {
    if (!ggml_zipmoe_cache_has_layer(c, layer) || pthread_mutex_trylock(&c->lock) != 0) {
        return -1; // a fetch is open: nothing can be promised about the slots
    }
    const int64_t k0   = (int64_t) layer * c->layout.max_expert;
    const int32_t n    = c->layout.layer_n_expert[layer];
    int32_t       base = c->slots.of_key[k0];
    if (c->fetch_open || base < 0 || base + n > c->slots.n_used) {
        base = -1;
    }
    for (int32_t e = 1; base >= 0 && e < n; e++) {
        if (c->slots.of_key[k0 + e] != base + e) {
            base = -1;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return base;
}

int ggml_zipmoe_cache_has_layer(const struct ggml_zipmoe_cache * c, int layer) {
    return c != NULL && zipmoe_layer_served(c, layer);
}

int32_t ggml_zipmoe_cache_n_expert(const struct ggml_zipmoe_cache * c, int layer) {
    return ggml_zipmoe_cache_has_layer(c, layer) ? c->layout.layer_n_expert[layer] : 0;
}

int ggml_zipmoe_cache_n_passes(const struct ggml_zipmoe_cache * c, int layer, int64_t n_ids) {
    const int64_t n_expert = ggml_zipmoe_cache_n_expert(c, layer);
    const int64_t distinct = n_ids < n_expert ? n_ids : n_expert;
    const int64_t width    = zipmoe_cache_pass_width(c);
    return distinct <= 0 ? 1 : (int) ((distinct + width - 1) / width);
}

size_t ggml_zipmoe_cache_extra_bytes(const struct ggml_zipmoe_cache * c, int n_threads) {
    if (c == NULL) {
        return 0;
    }
    size_t total = 0;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        total += c->pools.store[p].entry_size * (size_t) c->pools.store[p].n_entries;
    }
    // the staging rings as ensure_staging makes them, and a decoder per decoding thread
    const size_t sm_region = (size_t) zipmoe_align_up(c->file->max_sm_size, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    const size_t e_region  = c->pipe.e_region != 0 ? c->pipe.e_region : zipmoe_cache_e_region_bytes(c);
    total += ZIPMOE_N_STAGING * (sm_region + (size_t) c->file->n_shards * e_region);
    total += zipmoe_prefetch_bytes(c);
    const int n_decoders = c->n_decoders > 0 && c->n_decoders < n_threads ? c->n_decoders : n_threads;
    total += (size_t) (n_decoders > 0 ? n_decoders : 1) * ZIPMOE_DECODER_BYTES;
    // per-slot and per-expert bookkeeping, the scheduler's arrays
    const size_t K = (size_t) c->file->n_shards;
    total += (size_t) c->slots.capacity * (48 + 3 * (sizeof(struct zipmoe_task) + sizeof(struct ggml_zipmoe_sched_task) +
                                                      (2 * K + 1) * sizeof(struct ggml_zipmoe_sched_op) + K * sizeof(atomic_int)));
    return total;
}

int ggml_zipmoe_cache_merge_pass(const struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                 int64_t n_used, int64_t n_tokens, int64_t ids_stride, const void * acc,
                                 const void * pass_out, void * out, size_t row_bytes, size_t nb1, size_t nb2) {
    // the pass of a selection is its expert's rank among the distinct experts, / the pass width; it
    // is recomputed here from the ids alone (no state shared with the fetch)
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
    const int32_t width = zipmoe_cache_pass_width(c);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e     = ids[t * ids_stride + k];
            const int     mine  = e >= 0 && e < n_expert && rank[e] >= 0 && rank[e] / width == pass;
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

const char * ggml_zipmoe_cache_error(const struct ggml_zipmoe_cache * c) {
    return c != NULL ? c->error : "no cache";
}
