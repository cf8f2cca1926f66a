// The substitution policy's state, shared by zipmoe-substitute.c (the object, the hook and SMoE)
// and zipmoe-buddy.c (BuddyMoE's profiles and the routing trace). Internal.

#pragma once

#include "lossy/zipmoe-substitution.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

// a layer's BuddyMoE profile and routing trace
struct zipmoe_buddy_layer {
    int32_t *  buddies;        // [n_expert][k_max], -1 ends a list (NULL: no profile)
    float *    q;              // [n_expert][k_max]
    int32_t    k_max;
    float      tau;
    double *   activations;    // trace: [n_expert]
    double *   coact;          // trace: [n_expert][n_expert]
    double *   coact_weighted; // trace: [n_expert][n_expert]
    uint64_t * tae_hist;       // trace: [GGML_ZIPMOE_TAE_BINS]
    uint64_t   n_tokens;       // trace
};

// set before serving, read by each layer's hook; the buddy profiles and the trace under buddy_lock
struct zipmoe_substitution {
    int                             n_layer;
    int32_t *                       layer_n_expert; // [n_layer], 0 for a layer not served
    atomic_int                      policy;         // enum ggml_zipmoe_substitution
    _Atomic float                   alpha;          // SMOE's alpha
    atomic_uint_least64_t           replaced, tokens;
    struct ggml_zipmoe_buddy_params buddy;
    struct zipmoe_buddy_layer *     layers;         // [n_layer], made on first use
    int                             trace;
    float                           trace_temperature;
    int64_t                         trace_warmup;
    pthread_mutex_t                 buddy_lock;
};

static inline int zipmoe_substitution_has_layer(const struct zipmoe_substitution * s, int layer) {
    return s != NULL && layer >= 0 && layer < s->n_layer && s->layer_n_expert[layer] > 0;
}

// zipmoe-substitute.c: ids ([n_tokens] rows of ids_stride) into out ([n_tokens][n_used]); 0 if one is
// outside [0, n_expert)
int  zipmoe_copy_ids(const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride, int64_t n_expert,
                     int32_t * out);

// zipmoe-buddy.c
void zipmoe_buddy_free_layers(struct zipmoe_substitution * s);
int  zipmoe_buddy_substitute(struct zipmoe_substitution * s, int layer, const float * scores, int64_t scores_stride,
                             const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                             const uint8_t * resident, int32_t * out, int64_t * n_replaced);
void zipmoe_buddy_trace(struct zipmoe_substitution * s, int layer, const float * scores, int64_t scores_stride,
                        const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride);
