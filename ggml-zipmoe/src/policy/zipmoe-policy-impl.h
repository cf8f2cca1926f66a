// The policies' internal declarations (not part of the public API). policy/ holds the decisions the
// cache and serving take from pure functions of their inputs:
//
//   zipmoe-sched.c          Algorithm 1: the order of a fetch's tasks (ggml_zipmoe_schedule; the cache's
//                           fetch calls it)
//   zipmoe-planner.c        Algorithms 2-4: the pools for a budget (ggml_zipmoe_plan_pools), the modified
//                           IPF, the cost model's default rates
//   zipmoe-default-pools.c  the pools a budget gets with no pool options: from a zipmoe_pool_view, what
//                           the cache says of itself (cache/zipmoe-pool-view.c fills it)
//
// policy/ sits below the cache: it calls common/ and format/ only, and sees the cache through the
// view its caller fills, never through the cache's struct.

#pragma once

#include "ggml-zipmoe.h"
#include "ggml-zipmoe-policy.h"

#include <stdint.h>

// zipmoe-planner.c: the expected makespan of per-layer capacities (hierarchy order) under p's q and costs
int zipmoe_plan_evaluate(const struct ggml_zipmoe_plan_params * p, const int32_t capacity[4], double * makespan_s);

// What the default pools read of a cache: its geometry, its pools now, its rates, and the experts a
// change would decode into F (all read when the view is made; the cache is not touched after).
struct zipmoe_pool_view {
    struct {
        int32_t  n_served;     // layers served
        int32_t  max_expert;   // largest n_expert over layers
        int32_t  n_shards;     // the file's shards per expert (K)
        uint64_t expert_bytes; // an expert in its slot
        uint64_t sm_bytes;     // an expert's SM-chunks
        uint64_t max_e_bytes;  // the largest stored E bytes of one expert
        double   rho;          // stored E bytes over exponent bytes, over the file
    } layout;
    // the pools now
    int      one_f_pool;       // a single active pool, F
    int32_t  n_used;           // slots in use
    int32_t  f_capacity;       // slots that may hold F's experts
    int      inclusive;        // C holds every expert
    int32_t  n_entries[4];     // the C, S and E stores' entries (by pool; F's is 0)
    int32_t  n_held[4];        // of them, those holding an expert
    double   entry_blocks[4];  // bytes of whole huge-page blocks an entry alone gives back when its store
                               // shrinks into slots (its size less one block, or 0)
    int      host;             // slots in host memory
    int      moves_pages;      // host slots that take the pages a store gives up
    // rates (bytes per second): the cache's read and decode, the default first write of a slot
    double   rate_read;
    double   rate_decode;
    double   rate_touch;
    // per rank r ([max_expert], over the served layers): the experts of rank r in C or S that a change
    // decodes into an F holding that rank (zipmoe_migrants_by_rank), and those of them from S; NULL where
    // !host
    const int32_t * migrants;
    const int32_t * migrants_from_s;
};

// zipmoe-default-pools.c: ggml_zipmoe_cache_default_pools and ggml_zipmoe_cache_device_pools on a view
int zipmoe_default_pools(const struct zipmoe_pool_view * v, uint64_t budget, int32_t k, int32_t n_threads,
                         int32_t work_slots, double rate_read, double rate_decode, const double * profile,
                         struct ggml_zipmoe_default_pools * out);
int zipmoe_device_pools(const struct zipmoe_pool_view * v, int32_t n_device_slots, uint64_t host_bytes,
                        int32_t work_slots, struct ggml_zipmoe_default_pools * out);
