// Expert cache, preload: where the slots in use (and C) hold every expert, the empty ones filled before
// serving, each served layer up to its share, as a memory-mapped model's populate does for its weights
// (ggml_zipmoe_cache_preload), by the fetch a graph runs, on threads of its own.

#include "cache/zipmoe-cache-impl.h"

#include <pthread.h>
#include <stdlib.h>

struct preload_worker {
    struct ggml_zipmoe_cache * cache;
    int                        ith;
    atomic_int *               nth; // 0 until every worker that could be started is
};

static void * preload_worker_main(void * arg) {
    const struct preload_worker * w = (const struct preload_worker *) arg;
    int nth;
    for (unsigned spins = 0; (nth = atomic_load(w->nth)) == 0; spins++) {
        zipmoe_pause_waiting(spins);
    }
    ggml_zipmoe_cache_fetch_end(w->cache, w->ith, nth);
    return NULL;
}

// one pass of a preload fetch
static int preload_fetch_pass(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int32_t n,
                              int n_threads, int32_t * slot_ids) {
    const int status = ggml_zipmoe_cache_fetch_begin(c, layer, pass, ids, n, 1, n, slot_ids);
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
    return status != GGML_ZIPMOE_OK ? status : end_status;
}

int zipmoe_cache_fetch_on_threads(struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int32_t n,
                                  int n_threads) {
    int32_t slot_ids_small[256];
    int32_t * slot_ids = n <= 256 ? slot_ids_small : (int32_t *) malloc(sizeof(int32_t) * (size_t) n);
    if (slot_ids == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    int status = GGML_ZIPMOE_OK;
    const int n_passes = ggml_zipmoe_cache_n_passes(c, layer, n);
    for (int pass = 0; pass < n_passes && status == GGML_ZIPMOE_OK; pass++) {
        status = preload_fetch_pass(c, layer, pass, ids, n, n_threads, slot_ids);
    }
    if (slot_ids != slot_ids_small) {
        free(slot_ids);
    }
    return status;
}

// whether the preload leaves every expert of every served layer in a slot or in C. Where it cannot,
// it loads nothing: a prompt reads nearly every expert anyway, and experts guessed in id order
// before any activation was counted were evicted unused once the first tokens ranked others above
// them (DeepSeek-V2-Lite at 20 GiB: 4.5 GB preloaded, 3.9 GB more read per run and TTFT 4 s worse)
static int preload_keeps_every_expert(const struct ggml_zipmoe_cache * c, int32_t share, int32_t stored, int32_t n_work) {
    for (int l = 0; l < c->layout.n_layer; l++) {
        const int32_t n_expert = c->layout.layer_n_expert[l];
        if (ggml_zipmoe_cache_has_layer(c, l) && share < n_expert && !(n_work > 0 && stored >= n_expert)) {
            return 0;
        }
    }
    return 1;
}

int ggml_zipmoe_cache_preload(struct ggml_zipmoe_cache * c, int n_threads, int32_t * n_loaded) {
    if (n_loaded != NULL) {
        *n_loaded = 0;
    }
    if (c == NULL || n_threads < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    n_threads = n_threads < ZIPMOE_MAX_THREADS ? n_threads : ZIPMOE_MAX_THREADS;
    // what a fetch counts, kept as it was: preloading is not serving. The bytes sent to the slots' device
    // are counted (h2d_bytes: what crossed the bus, preload included)
    struct zipmoe_fetch_counts saved;
    zipmoe_stats_save_fetch(c, &saved);
    const uint64_t read_before = atomic_load(&c->stats.bytes_read);
    // each served layer's share of the slots in use (F's capacity with pools), experts in id order;
    // then, where C keeps every expert, the rest into C (by id: no activation is counted yet), as
    // many at a time as there are working slots, so that nothing is read again. Other stores are
    // left to fill on use: an entry preloaded is decoded here and again when used (a prompt's
    // first pass reads nearly every expert anyway), and may be evicted before that
    const int32_t n_served = c->layout.n_served > 0 ? c->layout.n_served : 1;
    const int32_t share = c->pools.f_capacity / n_served;
    const int32_t stored = c->pools.inclusive ? c->pools.threshold[GGML_ZIPMOE_POOL_C] - c->policy.rank_delta : 0;
    const int32_t n_work = c->slots.n_used - c->pools.f_capacity;
    if (!preload_keeps_every_expert(c, share, stored, n_work)) {
        return GGML_ZIPMOE_OK;
    }
    int32_t * ids = (int32_t *) malloc(sizeof(int32_t) * (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1));
    int status = ids != NULL ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_NOMEM;
    int32_t loaded = 0;
    c->preloading = 1;
    for (int l = 0; l < c->layout.n_layer && status == GGML_ZIPMOE_OK; l++) {
        if (!ggml_zipmoe_cache_has_layer(c, l)) {
            continue;
        }
        const int64_t base = (int64_t) l * c->layout.max_expert;
        int32_t n = 0;
        for (int32_t e = 0; e < c->layout.layer_n_expert[l] && n < share; e++) {
            if (c->slots.of_key[base + e] < 0) {
                ids[n++] = e;
            }
        }
        if (n > 0) {
            status = zipmoe_cache_fetch_on_threads(c, l, ids, n, n_threads);
            loaded += status == GGML_ZIPMOE_OK ? n : 0;
        }
        int32_t e = share;
        while (status == GGML_ZIPMOE_OK && n_work > 0 && e < stored && e < c->layout.layer_n_expert[l]) {
            for (n = 0; n < n_work && e < stored && e < c->layout.layer_n_expert[l]; e++) {
                if (c->slots.of_key[base + e] < 0 && c->pools.key_pool[base + e] == NO_POOL) {
                    ids[n++] = e;
                }
            }
            if (n > 0) {
                status = zipmoe_cache_fetch_on_threads(c, l, ids, n, n_threads);
                loaded += status == GGML_ZIPMOE_OK ? n : 0;
            }
        }
    }
    c->preloading = 0;
    free(ids);
    atomic_fetch_add(&c->stats.preload_bytes_read, atomic_load(&c->stats.bytes_read) - read_before);
    atomic_fetch_add(&c->stats.preload_experts, (uint64_t) loaded);
    zipmoe_stats_restore_fetch(c, &saved);
    if (n_loaded != NULL) {
        *n_loaded = loaded;
    }
    return status;
}
