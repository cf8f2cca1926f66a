// The serving object's state, shared by zipmoe-serving.c (memory, slot memory, sizing), zipmoe-geometry.c
// (the experts' geometry) and zipmoe-replan.c (the pools planned again from the routing seen). Not part of
// the public API.

#pragma once

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-policy.h"
#include "ggml-zipmoe-serving.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ZIPMOE_GIB (1024.0 * 1024.0 * 1024.0)
#define ZIPMOE_MIB (1024.0 * 1024.0)

// the routing of decode steps (one token of each sequence in the ubatch), for planning the pools once
// more (zipmoe-replan.c)
struct zipmoe_routing_profile {
    int32_t    n_expert;     // experts of the widest served layer (0: not started)
    uint64_t * seen_counts;  // [n_layer][n_expert] the cache's activation counts after the last graph
    uint64_t * seen_ubatches;// [n_layer]
    uint64_t * counts;       // [n_layer][n_expert] and after this one
    uint64_t * ubatches;     // [n_layer]
    double *   half_counts;  // [2][n_layer][n_expert] selections in decode steps, even and odd steps apart
    double *   token_counts; // [2][n_layer][n_expert] selections token by token (prompts too), even and odd
                             // tokens apart (the cache's, read at a re-plan)
    double *   half_n;       // [2][n_layer] the tokens (token_halves) or decode steps (step_halves) each
                             // layer ran in each half, for the one re-plan that reads them
    bool       several_seqs; // a graph ran several sequences: no re-plan after a prompt then
    bool       prompt_replan;  // the re-plan at the first decode step after a prompt has run
    uint64_t   token_steps;  // those steps (the even ones: (token_steps + 1) / 2)
    uint64_t   step_selections; // distinct experts those steps selected, summed over the served layers
    uint64_t   layer_steps;     // and the (step, served layer) pairs they summed over
    double *   observed;     // [n_expert] rank-based inclusion probabilities of those steps
    double     even_z;       // how far those steps are from a uniform router's (routing_even_z)
    double     design_effect; // and the discount for a prompt's repeated tokens it was taken with
    bool       even;         // as even as a uniform router's: plans keep the built-in profile
    bool       replanned;    // no more re-plans
    uint64_t   next_replan;  // the counted steps at which the next re-plan runs (twice the last one's, or
                             // sooner: where a change declined for its cost would repay)
    bool       adopted;      // the re-plan changed the pools: later plans for the memory left keep its profile
    // one sequence's tokens until the re-plan after its prompt, counted by id (ggml_zipmoe_serving_observe_tokens)
    int32_t *  token_ids;    // [token_cap] an open-addressed table of the ids seen (-1: empty)
    uint32_t * token_mult;   // [token_cap] how often each came
    size_t     token_cap;    // a power of two (0: no table)
    size_t     token_distinct;
    double     token_n;      // tokens counted
    double     token_sum_sq; // the sum over the ids of their multiplicity squared
};

struct ggml_zipmoe_serving {
    struct ggml_zipmoe_serving_params p;
    int32_t *                         layer_tensors; // the params' table, copied
    char                              budget_name[96]; // the params' budget_name, copied
    ggml_zipmoe_log_fn                log;
    void *                            log_data;

    // memory and geometry, fixed at load
    uint64_t                        available;
    char                            source[256];
    struct ggml_zipmoe_serving_info info;
    // slots in a device's memory (ggml_zipmoe_serving_fit_device): what it reported free, what the sizing
    // left for everything else there, and where the free figure came from
    uint64_t                        device_free;
    uint64_t                        device_reserve;
    char                            device_source[256];

    // slots
    struct ggml_zipmoe_cache * cache;
    bool                       on_gpu;
    void *                     mapping;       // host slots reserved here: one region (NULL: none, or the caller's)
    size_t                     mapping_bytes;
    int32_t                    host_zero_slots; // after the host slots, reserved with them (never written)
    uint8_t *                  slot_base[3];  // host slots: each kind's first (NULL: slots in device memory)
    size_t                     stride[3];
    int32_t                    n_slots;       // in use

    // the default pools
    bool                             auto_eligible;   // no pools given, host slots, rank eviction
    bool                             auto_active;     // auto_choice's pools are the cache's
    struct ggml_zipmoe_default_pools auto_choice;     // capacity all 0: one F pool
    double                           plan_rates[2];   // read and decode rates the pools are planned with
    uint64_t                         auto_budget;     // the bytes and decoding threads last planned for
    int32_t                          auto_threads;
    int32_t                          n_threads_max;
    struct zipmoe_routing_profile    routing;

    struct ggml_zipmoe_serving_plan plan; // the last sizing
};

// a size in words ("1.25 GiB") in one of a few rotating thread-local buffers (zipmoe-serving.c)
const char * zipmoe_size_text(uint64_t bytes);

// logs through the params' callback (printf format)
void zipmoe_serving_log(const struct ggml_zipmoe_serving * s, int level, const char * fmt, ...)
    __attribute__((format(printf, 3, 4)));

// n slots in use with the pools (capacity all 0: one F pool; NULL: the pools unchanged), the memory
// of the slots given up returned to the system, the experts moving from C or S to F decoded from their
// entries. Where the stores cannot be allocated the cache falls back to one F pool, and *pools says so.
// OK, or the cache's refusal (nothing changed)
int zipmoe_serving_use_slots(struct ggml_zipmoe_serving * s, int32_t n, struct ggml_zipmoe_default_pools * pools);

// zipmoe-geometry.c: s->info's geometry (slot shapes and bytes, every expert's bytes, MoE layers, the largest
// layer's and all experts' counts) from the file; ERR_ARG with a message where a layer's shapes differ
int zipmoe_serving_measure_experts(struct ggml_zipmoe_serving * s, char * err, size_t err_size);

// zipmoe-replan.c
void zipmoe_routing_profile_free(struct zipmoe_routing_profile * r);
// the experts a counted decode step selected per served layer, on average (zipmoe-replan.c): what the
// planner's k stands for with the observed profile
int32_t zipmoe_routing_step_k(const struct ggml_zipmoe_serving * s);
