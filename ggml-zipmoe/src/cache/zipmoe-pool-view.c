// The default pools' entry points (ggml_zipmoe_cache_default_pools, ggml_zipmoe_cache_device_pools,
// ggml-zipmoe-policy.h): what the cache says of itself for policy/zipmoe-default-pools.c, which decides
// from that alone (a zipmoe_pool_view: its geometry, its pools now, its rates, the experts a change
// would decode into F).

#include "cache/zipmoe-cache-impl.h"
#include "policy/zipmoe-policy-impl.h"

#include <stdlib.h>
#include <string.h>

// the view of c; by_rank ([2 max_expert], or NULL: none) takes the migrants by rank where the slots are
// in host memory (the default pools count them only there)
static void pool_view(const struct ggml_zipmoe_cache * c, int32_t * by_rank, struct zipmoe_pool_view * v) {
    memset(v, 0, sizeof(*v));
    v->layout.n_served     = c->layout.n_served;
    v->layout.max_expert   = c->layout.max_expert;
    v->layout.n_shards     = c->file->n_shards;
    v->layout.expert_bytes = c->layout.expert_bytes;
    v->layout.sm_bytes     = c->layout.sm_bytes;
    v->layout.max_e_bytes  = c->layout.max_e_bytes;
    v->layout.rho          = c->layout.rho;
    v->one_f_pool = c->pools.n_active == 1 && c->pools.active[0] == GGML_ZIPMOE_POOL_F;
    v->n_used     = c->slots.n_used;
    v->f_capacity = c->pools.f_capacity;
    v->inclusive  = c->pools.inclusive;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        const struct zipmoe_store * s = &c->pools.store[p];
        v->n_entries[p] = s->n_entries;
        for (int32_t i = 0; i < s->n_entries; i++) {
            v->n_held[p] += s->entry_key[i] >= 0;
        }
        v->entry_blocks[p] = s->entry_size > ZIPMOE_MOVE_BLOCK ? (double) (s->entry_size - ZIPMOE_MOVE_BLOCK) : 0;
    }
    v->host        = zipmoe_cache_slots_in_host(c);
    v->moves_pages = c->slots.take_pages && v->host;
    v->rate_read   = c->plan.rate_read;
    v->rate_decode = c->plan.rate_decode;
    v->rate_touch  = ggml_zipmoe_cache_rate(c, GGML_ZIPMOE_RATE_TOUCH);
    if (by_rank != NULL && v->host) {
        zipmoe_migrants_by_rank(c, by_rank, by_rank + c->layout.max_expert);
        v->migrants        = by_rank;
        v->migrants_from_s = by_rank + c->layout.max_expert;
    }
}

int ggml_zipmoe_cache_default_pools(const struct ggml_zipmoe_cache * c, uint64_t budget, int32_t k, int32_t n_threads,
                                    int32_t work_slots, double rate_read, double rate_decode, const double * profile,
                                    struct ggml_zipmoe_default_pools * out) {
    if (c == NULL || out == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    int32_t * by_rank = malloc(sizeof(int32_t) * 2 * (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1));
    if (by_rank == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    struct zipmoe_pool_view v;
    pool_view(c, by_rank, &v);
    const int status = zipmoe_default_pools(&v, budget, k, n_threads, work_slots, rate_read, rate_decode, profile, out);
    free(by_rank);
    return status;
}

int ggml_zipmoe_cache_device_pools(const struct ggml_zipmoe_cache * c, int32_t n_device_slots, uint64_t host_bytes,
                                   int32_t work_slots, struct ggml_zipmoe_default_pools * out) {
    if (c == NULL || out == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    struct zipmoe_pool_view v;
    pool_view(c, NULL, &v);
    return zipmoe_device_pools(&v, n_device_slots, host_bytes, work_slots, out);
}
