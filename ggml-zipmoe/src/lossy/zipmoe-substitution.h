// The substitution policy as the expert cache calls it (internal): an object of its own, apart
// from the cache's state. The cache makes one, forwards the public ggml_zipmoe_cache_* calls of
// ggml-zipmoe-policy.h to it, and hands it what is resident when a layer's router has chosen
// (cache/zipmoe-substitution-hook.c). Nothing here sees the cache.

#pragma once

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-policy.h"

#include <stdint.h>

struct zipmoe_substitution;

// layer_n_expert: [n_layer] experts of each layer (0: a layer not served); copied. NULL if out of memory.
struct zipmoe_substitution * zipmoe_substitution_new(int n_layer, const int32_t * layer_n_expert);
void                         zipmoe_substitution_free(struct zipmoe_substitution * s);

// the policy (enum ggml_zipmoe_substitution) and SMoE's alpha; as ggml_zipmoe_cache_set/get_substitution
int zipmoe_substitution_set(struct zipmoe_substitution * s, int policy, float alpha);
int zipmoe_substitution_policy(const struct zipmoe_substitution * s, float * alpha);

// BuddyMoE's profiles and parameters, and the routing trace: as the ggml_zipmoe_cache_* functions
int zipmoe_substitution_set_buddies(struct zipmoe_substitution * s, int layer, const int32_t * buddies, const float * q,
                                    int32_t k_max, float tau);
int zipmoe_substitution_set_buddy_params(struct zipmoe_substitution * s, const struct ggml_zipmoe_buddy_params * p);
int zipmoe_substitution_trace(struct zipmoe_substitution * s, int on, float temperature, int64_t warmup);
int zipmoe_substitution_get_trace(struct zipmoe_substitution * s, int layer, double * activations, double * coact,
                                  double * coact_weighted, uint64_t * tae_hist, uint64_t * n_tokens);

// one layer's router output: records the trace (when on), then writes the ids with the policy applied
// to out; resident[e]: expert e is full in a slot now (NULL only with policy NONE). Counts what was
// replaced. OK, ERR_ARG (a layer not served, an id out of range) or ERR_NOMEM.
int zipmoe_substitution_route(struct zipmoe_substitution * s, int layer, const float * scores, int64_t n_expert,
                              int64_t scores_stride, const int32_t * ids, int64_t n_used, int64_t n_tokens,
                              int64_t ids_stride, const uint8_t * resident, int32_t * out);

// selections replaced and tokens routed since made or reset (LOSSY statistics)
void zipmoe_substitution_counts(const struct zipmoe_substitution * s, uint64_t * replaced, uint64_t * tokens);
void zipmoe_substitution_reset_counts(struct zipmoe_substitution * s);
