// Expert cache, the substitution hook: the public ggml_zipmoe_cache_* calls of the opt-in lossy
// policy (ggml-zipmoe-policy.h), forwarded to the policy object the cache holds
// (lossy/zipmoe-substitution.h), and what is resident when a layer's router has chosen.

#include "cache/zipmoe-cache-impl.h"

#include <stdlib.h>

int ggml_zipmoe_cache_set_substitution(struct ggml_zipmoe_cache * c, int policy, float alpha) {
    return c != NULL ? zipmoe_substitution_set(c->subst, policy, alpha) : GGML_ZIPMOE_ERR_ARG;
}

int ggml_zipmoe_cache_get_substitution(const struct ggml_zipmoe_cache * c, int * policy, float * alpha) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int p = zipmoe_substitution_policy(c->subst, alpha);
    if (policy != NULL) {
        *policy = p;
    }
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_cache_set_buddies(struct ggml_zipmoe_cache * c, int layer, const int32_t * buddies, const float * q,
                                  int32_t k_max, float tau) {
    return c != NULL ? zipmoe_substitution_set_buddies(c->subst, layer, buddies, q, k_max, tau) : GGML_ZIPMOE_ERR_ARG;
}

int ggml_zipmoe_cache_set_buddy_params(struct ggml_zipmoe_cache * c, const struct ggml_zipmoe_buddy_params * params) {
    return c != NULL ? zipmoe_substitution_set_buddy_params(c->subst, params) : GGML_ZIPMOE_ERR_ARG;
}

int ggml_zipmoe_cache_trace_routing(struct ggml_zipmoe_cache * c, int on, float temperature, int64_t warmup) {
    return c != NULL ? zipmoe_substitution_trace(c->subst, on, temperature, warmup) : GGML_ZIPMOE_ERR_ARG;
}

int ggml_zipmoe_cache_get_routing_trace(const struct ggml_zipmoe_cache * c, int layer, double * activations,
                                        double * coact, double * coact_weighted, uint64_t * tae_hist,
                                        uint64_t * n_tokens) {
    return c != NULL ? zipmoe_substitution_get_trace(c->subst, layer, activations, coact, coact_weighted, tae_hist,
                                                     n_tokens)
                     : GGML_ZIPMOE_ERR_ARG;
}

int ggml_zipmoe_cache_substitute(struct ggml_zipmoe_cache * c, int layer, const float * scores, int64_t n_expert,
                                 int64_t scores_stride, const int32_t * ids, int64_t n_used, int64_t n_tokens,
                                 int64_t ids_stride, int32_t * out) {
    if (c == NULL || !ggml_zipmoe_cache_has_layer(c, layer) || n_expert != c->layout.layer_n_expert[layer]) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (zipmoe_substitution_policy(c->subst, NULL) == GGML_ZIPMOE_SUBST_NONE) {
        return zipmoe_substitution_route(c->subst, layer, scores, n_expert, scores_stride, ids, n_used, n_tokens,
                                         ids_stride, NULL, out);
    }
    uint8_t * resident = calloc((size_t) n_expert, 1);
    if (resident == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    // what is in a slot now; a fetch that is open holds the lock until its slots are full
    pthread_mutex_lock(&c->lock);
    const int64_t base = (int64_t) layer * c->layout.max_expert;
    for (int64_t e = 0; e < n_expert; e++) {
        resident[e] = c->slots.of_key[base + e] >= 0;
    }
    pthread_mutex_unlock(&c->lock);
    const int status = zipmoe_substitution_route(c->subst, layer, scores, n_expert, scores_stride, ids, n_used,
                                                 n_tokens, ids_stride, resident, out);
    free(resident);
    return status;
}
