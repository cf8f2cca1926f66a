// Expert cache: its statistics (ggml_zipmoe_cache_get_stats and reset, the activations the
// planner reads, the caller's graph time for the account of a token) and the cost model's rates
// (ggml_zipmoe_cache_rate: given, measured by its fetches, or policy/'s defaults).

#include "cache/zipmoe-cache-impl.h"

#include <string.h>

void ggml_zipmoe_cache_get_stats(const struct ggml_zipmoe_cache * c, struct ggml_zipmoe_cache_stats * s) {
    s->fetch_calls   = atomic_load(&c->stats.fetch_calls);
    s->expert_hits   = atomic_load(&c->stats.hits);
    s->expert_misses = atomic_load(&c->stats.misses);
    s->bytes_read    = atomic_load(&c->stats.bytes_read);
    s->io_ns         = atomic_load(&c->stats.io_ns);
    s->decode_ns     = atomic_load(&c->stats.decode_ns);
    s->recover_ns    = atomic_load(&c->stats.recover_ns);
    s->fetch_ns      = atomic_load(&c->stats.fetch_ns);
    s->c_hits        = atomic_load(&c->stats.store_hits[GGML_ZIPMOE_POOL_C]);
    s->s_hits        = atomic_load(&c->stats.store_hits[GGML_ZIPMOE_POOL_S]);
    s->e_hits        = atomic_load(&c->stats.store_hits[GGML_ZIPMOE_POOL_E]);
    s->prefetch_hits       = atomic_load(&c->prefetch.hits);
    s->prefetch_bytes_read = atomic_load(&c->prefetch.bytes_read);
    s->prefetch_bytes_used = atomic_load(&c->prefetch.bytes_used);
    s->h2d_bytes           = zipmoe_gpu_h2d_bytes(c->gpu) + atomic_load(&c->stats.slot_write_bytes);
    zipmoe_substitution_counts(c->subst, &s->substitutions, &s->substitution_tokens);
    s->lock_wait_ns   = atomic_load(&c->stats.lock_wait_ns);
    s->plan_ns        = atomic_load(&c->stats.plan_ns);
    s->fetch_work_ns  = atomic_load(&c->stats.fetch_work_ns);
    s->read_wait_ns   = atomic_load(&c->stats.read_wait_ns);
    s->finish_wait_ns = atomic_load(&c->stats.finish_wait_ns);
    s->decode_faults  = atomic_load(&c->stats.decode_faults);
    s->graph_ns       = atomic_load(&c->stats.graph_ns);
    s->graphs         = atomic_load(&c->stats.graphs);
    s->preload_experts    = atomic_load(&c->stats.preload_experts);
    s->preload_bytes_read = atomic_load(&c->stats.preload_bytes_read);
    s->populate_bytes     = atomic_load(&c->stats.populate_bytes);
    s->populate_ns        = atomic_load(&c->stats.populate_ns);
    s->migrate_experts    = atomic_load(&c->stats.migrate_experts);
    s->migrate_ns         = atomic_load(&c->stats.migrate_ns);
    s->moved_page_bytes   = atomic_load(&c->stats.moved_page_bytes);
    s->cpu_experts        = atomic_load(&c->stats.cpu_experts);
    s->device_experts     = atomic_load(&c->stats.device_experts);
    s->device_ns          = atomic_load(&c->stats.device_ns);
}

// the counters a fetch adds to, in struct zipmoe_fetch_counts order
static void fetch_counters(struct ggml_zipmoe_cache * c, atomic_uint_least64_t * out[ZIPMOE_FETCH_COUNTERS]) {
    atomic_uint_least64_t * all[ZIPMOE_FETCH_COUNTERS] = {
        &c->stats.fetch_calls, &c->stats.hits, &c->stats.misses, &c->stats.store_hits[0], &c->stats.store_hits[1],
        &c->stats.store_hits[2], &c->stats.store_hits[3], &c->stats.bytes_read, &c->stats.io_ns,
        &c->stats.decode_ns, &c->stats.recover_ns, &c->stats.fetch_ns, &c->stats.lock_wait_ns, &c->stats.plan_ns,
        &c->stats.fetch_work_ns, &c->stats.read_wait_ns, &c->stats.finish_wait_ns, &c->stats.decode_faults,
    };
    memcpy(out, all, sizeof(all));
}

void zipmoe_stats_save_fetch(struct ggml_zipmoe_cache * c, struct zipmoe_fetch_counts * saved) {
    atomic_uint_least64_t * counters[ZIPMOE_FETCH_COUNTERS];
    fetch_counters(c, counters);
    for (int i = 0; i < ZIPMOE_FETCH_COUNTERS; i++) {
        saved->v[i] = atomic_load(counters[i]);
    }
}

void zipmoe_stats_restore_fetch(struct ggml_zipmoe_cache * c, const struct zipmoe_fetch_counts * saved) {
    atomic_uint_least64_t * counters[ZIPMOE_FETCH_COUNTERS];
    fetch_counters(c, counters);
    for (int i = 0; i < ZIPMOE_FETCH_COUNTERS; i++) {
        atomic_store(counters[i], saved->v[i]);
    }
}

void ggml_zipmoe_cache_count_graph(struct ggml_zipmoe_cache * c, uint64_t ns) {
    if (c != NULL) {
        atomic_fetch_add(&c->stats.graph_ns, ns);
        atomic_fetch_add(&c->stats.graphs, 1);
    }
}

int ggml_zipmoe_cache_get_activations(const struct ggml_zipmoe_cache * c, int layer, uint64_t * counts,
                                      uint64_t * n_ubatches) {
    if (c == NULL || !zipmoe_layer_served(c, layer) || counts == NULL || n_ubatches == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int64_t base = (int64_t) layer * c->layout.max_expert;
    for (int32_t e = 0; e < c->layout.layer_n_expert[layer]; e++) {
        counts[e] = atomic_load(&c->stats.activations[base + e]);
    }
    *n_ubatches = atomic_load(&c->stats.layer_ubatches[layer]);
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_cache_get_selections(const struct ggml_zipmoe_cache * c, int layer, uint64_t * even, uint64_t * odd,
                                     uint64_t * n_tokens) {
    if (c == NULL || !zipmoe_layer_served(c, layer) || even == NULL || odd == NULL || n_tokens == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int64_t base   = (int64_t) layer * c->layout.max_expert;
    const size_t  n_keys = zipmoe_cache_n_keys(c);
    for (int32_t e = 0; e < c->layout.layer_n_expert[layer]; e++) {
        even[e] = atomic_load(&c->stats.selections[base + e]);
        odd[e]  = atomic_load(&c->stats.selections[n_keys + base + e]);
    }
    *n_tokens = atomic_load(&c->stats.layer_tokens[layer]);
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_cache_reset_stats(struct ggml_zipmoe_cache * c) {
    const size_t n_keys = zipmoe_cache_n_keys(c);
    for (size_t i = 0; i < n_keys; i++) {
        atomic_store(&c->stats.activations[i], 0);
        atomic_store(&c->stats.selections[i], 0);
        atomic_store(&c->stats.selections[n_keys + i], 0);
    }
    for (int l = 0; l < (c->layout.n_layer > 0 ? c->layout.n_layer : 1); l++) {
        atomic_store(&c->stats.layer_ubatches[l], 0);
        atomic_store(&c->stats.layer_tokens[l], 0);
    }
    atomic_uint_least64_t * counters[] = {
        &c->stats.fetch_calls, &c->stats.hits, &c->stats.misses, &c->stats.store_hits[0], &c->stats.store_hits[1],
        &c->stats.store_hits[2], &c->stats.store_hits[3], &c->stats.bytes_read, &c->stats.slot_write_bytes,
        &c->stats.io_ns, &c->stats.decode_ns, &c->stats.recover_ns, &c->stats.fetch_ns, &c->stats.lock_wait_ns,
        &c->stats.plan_ns, &c->stats.fetch_work_ns, &c->stats.read_wait_ns, &c->stats.finish_wait_ns,
        &c->stats.decode_faults, &c->stats.graph_ns, &c->stats.graphs, &c->stats.preload_experts,
        &c->stats.preload_bytes_read, &c->stats.populate_bytes, &c->stats.populate_ns, &c->stats.migrate_experts,
        &c->stats.migrate_ns, &c->stats.moved_page_bytes, &c->stats.cpu_experts,
    }; // device_experts and device_ns stay: the balancer's measure of a load
    for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
        atomic_store(counters[i], 0);
    }
    zipmoe_gpu_set_h2d_bytes(c->gpu, 0);
    zipmoe_prefetch_reset_stats(c);
    zipmoe_substitution_reset_counts(c->subst);
}

double ggml_zipmoe_cache_rate(const struct ggml_zipmoe_cache * c, int rate) {
    if (c == NULL) {
        return 0.0;
    }
    switch (rate) {
        case GGML_ZIPMOE_RATE_READ:    return c->plan.rate_read;
        case GGML_ZIPMOE_RATE_DECODE:  return c->plan.rate_decode;
        case GGML_ZIPMOE_RATE_COMPUTE: return c->plan.rate_compute;
        case GGML_ZIPMOE_RATE_TOUCH:   return ggml_zipmoe_default_rate(GGML_ZIPMOE_RATE_TOUCH);
        default:                       return 0.0;
    }
}

int ggml_zipmoe_cache_rate_origin(const struct ggml_zipmoe_cache * c, int rate) {
    if (c == NULL) {
        return -1;
    }
    switch (rate) {
        case GGML_ZIPMOE_RATE_READ:    return c->plan.measure_read;
        case GGML_ZIPMOE_RATE_DECODE:  return c->plan.measure_decode;
        case GGML_ZIPMOE_RATE_COMPUTE: return c->plan.compute_given ? GGML_ZIPMOE_RATE_GIVEN
                                                                     : GGML_ZIPMOE_RATE_DEFAULT;
        case GGML_ZIPMOE_RATE_TOUCH:   return GGML_ZIPMOE_RATE_DEFAULT;
        default:                       return -1;
    }
}
