// Expert cache, migration: a change of pools that sends experts C or S holds to F decodes them from
// their entries into slots (S's after reading their E-chunks, a fifth of a miss's bytes), instead of
// dropping the entries and reading the experts again on their next use. Four Qwen1.5-MoE sequences at
// 20 GiB moved from C 60 to F 36-38: read again, the change took 10-11 s and came at 64 steps; decoded
// from C, 3.5-8 s (with the first touches of the new slots) at 32 steps, 1.15x the tok/s over 256
// tokens.
//
// Memory stays within the pools': C and S first shrink to what the new pools keep plus the experts
// bound for F; each of those entries' pages is given back once its expert is in a slot; then the stores
// shrink to their new sizes. Where the slots can take pages (the caller's own mapping, Linux), what the
// stores give up moves into the slots the change fills, ahead of the decoding threads' writes
// (zipmoe_sink_pages): those skip a first write's faults and zeroing, which took most of the change's
// time on the bench VM.

#include "cache/zipmoe-cache-impl.h"

#include <stdio.h>
#include <stdlib.h>

// layer's experts bound for F that a store holds and no slot does (ids ascending), with the store
// (pools) and the entry (entries) each is in
static int32_t layer_migrants(struct ggml_zipmoe_cache * c, int layer, int32_t * ids, int8_t * pools,
                              int32_t * entries) {
    const int64_t base = (int64_t) layer * c->layout.max_expert;
    int32_t n = 0;
    for (int32_t e = 0; e < c->layout.layer_n_expert[layer]; e++) {
        if (zipmoe_store_migrant(c, base + e)) {
            pools[n]   = c->pools.key_pool[base + e];
            entries[n] = c->pools.key_entry[base + e];
            ids[n++]   = e;
        }
    }
    return n;
}

static int by_entry(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

// the entries of the n migrants that store p held and forgot (their experts decoded), given back, each
// run of neighbours in one range: the huge-page blocks within a run move whole (zipmoe_sink_pages),
// where an entry alone might hold none. runs: room for n entries
static void release_runs(struct ggml_zipmoe_cache * c, int p, const int8_t * pools, const int32_t * entries,
                         int32_t n, int32_t * runs) {
    int32_t n_free = 0;
    for (int32_t i = 0; i < n; i++) {
        if (pools[i] == p && c->pools.store[p].entry_key[entries[i]] < 0) {
            runs[n_free++] = entries[i];
        }
    }
    qsort(runs, (size_t) n_free, sizeof(int32_t), by_entry);
    for (int32_t i = 0, j; i < n_free; i = j) {
        for (j = i + 1; j < n_free && runs[j] == runs[j - 1] + 1; j++) {
        }
        zipmoe_store_release(c, p, runs[i], j - i);
    }
}

// each served layer's migrants fetched (C and S hits: decoded from their entries, kept in F after use,
// their entries forgotten and given back); returns the experts moved, *status the first failure
static int32_t migrate_layers(struct ggml_zipmoe_cache * c, int n_threads, int * status) {
    const size_t n = (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1);
    int32_t * ids = (int32_t *) malloc(sizeof(int32_t) * n), * entries = (int32_t *) malloc(sizeof(int32_t) * n);
    int32_t * runs = (int32_t *) malloc(sizeof(int32_t) * n);
    int8_t *  pools = (int8_t *) malloc(n);
    int32_t   moved = 0;
    *status = ids != NULL && entries != NULL && runs != NULL && pools != NULL ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_NOMEM;
    for (int l = 0; l < c->layout.n_layer && *status == GGML_ZIPMOE_OK; l++) {
        if (!zipmoe_layer_served(c, l)) {
            continue;
        }
        pthread_mutex_lock(&c->lock);
        const int32_t n_layer = layer_migrants(c, l, ids, pools, entries);
        pthread_mutex_unlock(&c->lock);
        if (n_layer == 0) {
            continue;
        }
        *status = zipmoe_cache_fetch_on_threads(c, l, ids, n_layer, n_threads);
        pthread_mutex_lock(&c->lock);
        for (int32_t i = 0; i < n_layer; i++) {
            moved += c->slots.of_key[(int64_t) l * c->layout.max_expert + ids[i]] >= 0;
        }
        for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
            if (zipmoe_store_migrates_from(p)) {
                release_runs(c, p, pools, entries, n_layer, runs);
            }
        }
        pthread_mutex_unlock(&c->lock);
    }
    free(ids);
    free(entries);
    free(runs);
    free(pools);
    return moved;
}

int ggml_zipmoe_cache_set_pools_migrating(struct ggml_zipmoe_cache * c, const int32_t * capacity, int32_t n_slots,
                                          int inclusive, int n_threads, int32_t * n_migrated) {
    if (n_migrated != NULL) {
        *n_migrated = 0;
    }
    if (c == NULL || n_threads < 0) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    // a device's slots take copies the caller makes: not worth a change's time
    const int migrating = n_threads > 0 && zipmoe_cache_slots_in_host(c);
    int status = zipmoe_cache_change_pools(c, capacity, n_slots, inclusive, migrating);
    if (status != GGML_ZIPMOE_OK || !c->pools.migrating) {
        return status; // no sink is left on: change_pools opens one only for a migration it made
    }
    n_threads = n_threads < ZIPMOE_MAX_THREADS ? n_threads : ZIPMOE_MAX_THREADS;
    // what a fetch counts, kept as it was: a migration is the change's, not a graph's (its own counters)
    struct zipmoe_fetch_counts saved;
    zipmoe_stats_save_fetch(c, &saved);
    const uint64_t t0 = zipmoe_now_ns(), read_before = atomic_load(&c->stats.bytes_read);
    c->preloading = 1;
    int fetched = GGML_ZIPMOE_OK; // a failure stops the layers (its message stays in c->error)
    const int32_t moved = migrate_layers(c, n_threads, &fetched);
    c->preloading = 0;
    const uint64_t read = atomic_load(&c->stats.bytes_read) - read_before;
    zipmoe_stats_restore_fetch(c, &saved);
    atomic_fetch_add(&c->stats.bytes_read, read); // S's E-chunks: the disk's, whoever asked
    // C and S to their new sizes: the entries of experts not moved (after a failure) are forgotten there
    zipmoe_prefetch_pause(c, 1);
    pthread_mutex_lock(&c->lock);
    c->pools.migrating = 0;
    zipmoe_sink_close(c); // the slots are written: what the stores give up now goes back
    char msg[1024];
    status = zipmoe_cache_resize_stores(c, capacity, c->layout.max_e_bytes, msg, sizeof(msg));
    pthread_mutex_unlock(&c->lock);
    atomic_fetch_add(&c->stats.migrate_experts, (uint64_t) moved);
    atomic_fetch_add(&c->stats.migrate_ns, zipmoe_now_ns() - t0);
    if (n_migrated != NULL) {
        *n_migrated = moved;
    }
    if (status != GGML_ZIPMOE_OK) {
        snprintf(c->error, sizeof(c->error), "%s", msg);
    }
    // a failed fill (its message left in c->error) stopped the migration: the experts not moved are read
    // on their next use, as without one, and the pools are the new ones either way
    return status;
}
