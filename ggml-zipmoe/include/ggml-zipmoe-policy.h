// ggml-zipmoe's policies, apart from the core API (ggml-zipmoe.h) that serving needs:
//   - the cache-affinity scheduler a fetch orders its reads and decodes with (ZipMoE Alg. 1),
//   - the pool planner behind the default pools and zipmoe-plan (ZipMoE Alg. 2-4),
//   - the opt-in LOSSY expert substitution policies (SMoE, BuddyMoE) and the routing trace
//     zipmoe-buddies records.
// The cache calls them; the llama.cpp glue and the Python tools use them directly.

#pragma once

#include "ggml-zipmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

//
// cache-affinity scheduling of a layer's expert tensors (ZipMoE paper §3.3, Appendix A Algorithm 1)
//
// A task is one expert tensor to make ready. Its stored chunks are an SM-chunk, read in time u,
// and K E-chunks, each read in rho*u/K (rho: compressed size of the exponent plane over its raw
// size) and decompressed in time c, which includes the shard's share of BF16 recovery (the paper
// runs recovery as a separate kernel; the cache's workers recover right after decoding, or as
// soon as the SM-chunk is in memory if it is not yet). The expert's compression state says
// which chunks are cached:
//
//   M  nothing cached      reads the K E-chunks and the SM-chunk, K decompressions   Type-I
//   E  E-chunks cached     reads the SM-chunk, K decompressions                      Type-I
//   S  SM-chunk cached     reads the K E-chunks, K decompressions                    Type-II
//   C  both cached         K decompressions                                          Type-II
//   F  full tensor cached  nothing
//
// Execution model (the paper's, with one I/O thread and L decompression workers): the I/O thread
// performs the schedule's reads back to back in order; a free worker starts the first
// decompression of the schedule's list whose E-chunk is in memory (work-conserving, the
// longest-free worker picks first); shard s needs only E-chunk s. A tensor is ready when its
// SM-chunk is in memory and its K shards are decompressed, an expert when all its tensors are.
// One execution stream runs the ready experts one at a time (p: time to run an expert on all its
// tokens), earliest ready first, which is optimal for one stream; the makespan, which the
// scheduler minimises, ends with the last expert execution.
//
// The schedule is a sequence of blocks. A block starts from the Type-I task of largest p left
// (Type-II when none is left) and takes the remaining tasks in turn, Type-II before Type-I, each
// by non-increasing p with an expert's tasks adjacent, each at the earliest position that adds no
// idle worker time (else after the block's tasks of at least its p: Type-II ones, or Type-I ones
// when there are none, or first) until the block is compute-dominant: with the schedule so far,
// the l-th earliest worker finishes at least l*rho*u/K after the I/O thread, 1 <= l <= min(L, K),
// so the next block's reads leave no worker waiting. A block reads its tasks' E-chunks before
// their SM-chunks, each in task order; its decompressions follow the task order, shards in order.
// Makespan <= (3 - 1/L) x optimal (the paper's Theorem 3.1).
//

enum ggml_zipmoe_expert_state {
    GGML_ZIPMOE_STATE_M = 0, // missed: nothing cached
    GGML_ZIPMOE_STATE_C = 1, // compressed expert: SM-chunk and E-chunks cached
    GGML_ZIPMOE_STATE_S = 2, // SM-expert: SM-chunk cached
    GGML_ZIPMOE_STATE_E = 3, // E-expert: E-chunks cached
    GGML_ZIPMOE_STATE_F = 4, // full BF16 tensor cached
};

struct ggml_zipmoe_sched_task {
    int32_t expert; // expert id: tasks of one expert share its execution
    int32_t state;  // enum ggml_zipmoe_expert_state
    double  p;      // the expert's execution time (the same for all its tasks)
};

struct ggml_zipmoe_sched_params {
    double  u;         // read time of an SM-chunk
    double  rho;       // exponent-plane compression ratio: an E-chunk reads in rho*u/K
    double  c;         // decompression + recovery time of one shard
    int32_t n_shards;  // K >= 1
    int32_t n_threads; // L >= 1 decompression workers
};

// an operation on chunk `chunk` of task `task`, numbered as in ggml_zipmoe_file_chunk: 0 is the
// SM-chunk, 1 + s is E-chunk s (a decompression names the E-chunk it decodes)
struct ggml_zipmoe_sched_op {
    int32_t task;
    int32_t chunk;
};

struct ggml_zipmoe_sched_result {
    // set by the caller: arrays for n_tasks tasks of K shards
    struct ggml_zipmoe_sched_op * io;          // n_tasks*(K + 1): the I/O thread's reads, in order
    struct ggml_zipmoe_sched_op * dec;         // n_tasks*K: the workers' decompressions, by priority
    // optional (NULL: not written; the expert cache reads only io and dec)
    int32_t *                     order;       // n_tasks: the tasks, block after block, in priority order
    int32_t *                     block_start; // n_tasks + 1: block b is order[block_start[b] .. block_start[b + 1])
    int32_t *                     task_block;  // n_tasks: block of each task (-1 for state F)
    // set by ggml_zipmoe_schedule
    int32_t n_io;
    int32_t n_dec;
    int32_t n_order;                           // tasks not in state F
    int32_t n_blocks;
};

// bytes of workspace ggml_zipmoe_schedule needs (aligned for double)
#define GGML_ZIPMOE_SCHED_WORK_SIZE(n_tasks, n_shards, n_threads)                                  \
    (sizeof(double)  * ((size_t) (n_tasks) * (size_t) (n_shards) + (size_t) (n_threads)) +        \
     sizeof(int32_t) * (3 * (size_t) (n_tasks) * (size_t) (n_shards) + 4 * (size_t) (n_tasks)))

// schedule n_tasks tasks (Algorithm 1); allocates nothing. Returns OK; ERR_ARG for a NULL pointer
// (only params and result are needed when n_tasks == 0), n_tasks < 0, K < 1,
// L < 1, n_tasks*(K + 1) > INT32_MAX, an unknown state, u, rho, c or p negative or not finite,
// tasks of one expert with different p, or a misaligned workspace; ERR_CAPACITY when work_size <
// GGML_ZIPMOE_SCHED_WORK_SIZE(n_tasks, K, L). Each placement is tried by simulating the schedule so
// far: O(n_tasks^2) simulations of O(n_tasks*K*(L + log(n_tasks*K))) each in the worst case.
GGML_ZIPMOE_API int ggml_zipmoe_schedule(const struct ggml_zipmoe_sched_task * tasks, int32_t n_tasks,
                                         const struct ggml_zipmoe_sched_params * params,
                                         void * work, size_t work_size,
                                         struct ggml_zipmoe_sched_result * result);

// SMoE's CPU-load balancer (Algorithm 2, its section 5.4): of n experts a device lacks, each chosen by
// batch[i] tokens, which are copied to the device (t_load seconds each) and which the CPU computes where
// they are held (t_cpu seconds per token). Sorted by batch, largest first (ties by index), two pointers
// walk in from both ends: while the device's cumulative load time is at most the CPU's, the largest left
// is loaded, else the CPU takes the smallest left, so that max(load, CPU) is balanced. At most max_cpu
// go to the CPU (its slots); the rest are loaded. on_cpu[i] gets 1 for the CPU's. work: n int32.
// Returns the number given to the CPU; -1 for a NULL pointer, n < 0, a negative batch, or t_load or
// t_cpu negative or not finite.
GGML_ZIPMOE_API int32_t ggml_zipmoe_balance_cpu_load(const int32_t * batch, int32_t n, double t_load, double t_cpu,
                                                     int32_t max_cpu, int32_t * work, uint8_t * on_cpu);

// The pool planner (ZipMoE Alg. 2-4, paper 3.4): the per-layer capacities of the pools Lambda
// (those with entry_bytes != 0) that minimise the expected makespan of a sparse layer (Alg. 3's
// max(I/O time, decompression time / threads)), by a grid search over the shares of the budget in
// steps of 1 / grid_steps: a share gamma_p gives floor(gamma_p budget / (entry_bytes[p] n_layer))
// experts, packed onto consecutive ranks in hierarchy order; ties keep the earlier grid point, the
// first being all memory in the first pool of Lambda. tests/planner.py is the reference (it
// fits q to a profile with the modified IPF).
struct ggml_zipmoe_plan_params {
    int32_t        n_expert;       // N, experts per MoE layer
    int32_t        k;              // experts a ubatch selects per layer
    const double * q;              // [n_expert] selection probabilities by rank (NULL: uniform, k / N)
    uint64_t       budget;         // bytes for the pools of all n_layer MoE layers
    uint64_t       entry_bytes[4]; // one expert in F, C, S, E (0: the pool is not in Lambda)
    double         u, v, c;        // seconds: read one tensor's SM-chunk, read one E-chunk, decode one E-chunk
    int32_t        threads;        // L, decoding threads
    int32_t        n_shards;       // K, E-chunks per tensor
    int32_t        n_tensors;      // n, tensors per expert
    int32_t        n_layer;        // MoE layers
    int32_t        grid_steps;     // 1 / the grid step (20: 0.05)
};

struct ggml_zipmoe_plan_result {
    int32_t capacity[4];         // experts per layer in F, C, S, E
    double  expected_makespan_s; // Alg. 4's expected makespan of a layer
    int32_t grid_share[4];       // the grid point chosen: grid steps of the budget for F, C, S, E (0 outside Lambda)
};

// OK, or ERR_ARG for invalid params (nothing selectable, no pool, a q outside [0, 1])
GGML_ZIPMOE_API int ggml_zipmoe_plan_pools(const struct ggml_zipmoe_plan_params * params,
                                           struct ggml_zipmoe_plan_result * result);

// The pools a model loaded with no pool options gets for `budget` bytes of expert memory:
// - every expert fits full: one F pool (capacity all 0);
// - every compressed expert fits beside work_slots working slots: C holds every expert and F as
//   many as the rest allows, inclusive (nothing is read after warm-up);
// - short of that, with the built-in profile, when C holds all but at most k experts per layer
//   beside the E-chunks of the rest in E: those pools (a token reads at most the SM-chunks of
//   those in E; the planner, which does not model rank dispatch moving experts between partial
//   pools on a flat profile's noise, would pick partial pools that read far more);
// - otherwise the planner's choice for a uniform profile (every expert equally likely), with the
//   cache's rates (measured by its fetches, or the defaults) and the store entries' real sizes,
//   kept only if it expects a shorter makespan than one F pool.
struct ggml_zipmoe_default_pools {
    int32_t capacity[4];         // experts per served layer in F, C, S, E; all 0: one F pool of n_slots
    int32_t n_slots;             // slots to use (F's and the working slots)
    int32_t inclusive;           // for ggml_zipmoe_cache_set_pools
    double  expected_makespan_s; // the planner's expectation per layer (0 when it did not run)
    double  f_only_makespan_s;   // and its expectation for one F pool of the same budget
    double  current_makespan_s;  // and for the pools the cache has now (0 when the planner did not run)
    double  refill_s;            // what a change from those pools to these costs, rank by rank: reads (at the
                                 // plan's rate) of the chunks a new pool keeps and the old did not, decoding
                                 // (n_threads) of what goes to F, first writes of the slots past those in use
                                 // (the touch rate); nothing for what goes beyond every new pool
    char    why[320];            // one sentence for logs and statistics
};

// k: experts a token selects per layer; n_threads: decoding threads; rate_read, rate_decode: the
// cost model's rates (bytes per second; 0: the cache's, ggml_zipmoe_cache_rate); profile: NULL (the
// built-in uniform profile) or [n_expert] rank-based inclusion probabilities observed per token
// (descending, scaled to sum k): the planner then fits them (ggml_zipmoe_plan_fit) and every
// expert is kept in C only if it expects that to be the fastest. OK, ERR_ARG or ERR_NOMEM.
GGML_ZIPMOE_API int ggml_zipmoe_cache_default_pools(const struct ggml_zipmoe_cache * cache, uint64_t budget, int32_t k,
                                                    int32_t n_threads, int32_t work_slots, double rate_read,
                                                    double rate_decode, const double * profile,
                                                    struct ggml_zipmoe_default_pools * out);

// The default pools when the slots are in a device's memory (a GPU, an rpc-server) and the stores in
// host memory: the device's n_device_slots less work_slots are F (as many per served layer as divide
// evenly), and host_bytes of host memory keep the other experts compressed: all in C where they fit,
// else C as many as leave room for the E-chunks of the rest, else E-chunks alone. A miss then reads
// from disk only what host memory could not hold, where one F pool read every miss. Every expert in
// F, too few slots for one per layer, or no compressed expert fitting: one F pool (capacity all 0)
// with why saying so. The serving layer applies them at a context's sizing (zipmoe-serving.c).
// OK or ERR_ARG.
GGML_ZIPMOE_API int ggml_zipmoe_cache_device_pools(const struct ggml_zipmoe_cache * cache, int32_t n_device_slots,
                                                   uint64_t host_bytes, int32_t work_slots,
                                                   struct ggml_zipmoe_default_pools * out);

// the modified IPF of ZipMoE's eq. (24) (tests/planner.py: ipf): selection probabilities q [n] whose
// conditional Bernoulli distribution on k-sets has the inclusion probabilities f [n] (sum k, each in
// [0, 1]; 1: always, 0: never selected). OK, or ERR_ARG (inconsistent f, or no convergence).
GGML_ZIPMOE_API int ggml_zipmoe_plan_fit(const double * f, int32_t n, int32_t k, double * q);

// The winner's curse of a profile counted over few steps: bias[r] = E[r-th largest count] / n_steps - k / n
// (r from 0) for n experts each chosen by a uniform router with probability k / n per step (counts
// independent Binomial(n_steps, k / n)). A rank profile of n_steps steps, less this, estimates the
// routing the next steps see: a uniform router's comes out flat, not concentrated by chance.
// OK, ERR_ARG or ERR_NOMEM.
GGML_ZIPMOE_API int ggml_zipmoe_plan_rank_bias(uint64_t n_steps, int32_t n, int32_t k, double * bias);

// A rank profile f [n] (inclusion probabilities, sum k) counted over n_steps steps, sorted and less its
// rank bias (above), clamped at 0 and scaled back to the same sum, sorted again: the routing the next
// steps are expected to see, where only total counts are known (zipmoe-plan's profiles). It assumes a
// uniform router's chance, so it lifts the never-chosen ranks of a router that concentrates; the
// runtime's re-plan, which keeps its steps' counts in two halves, cross-fits them instead.
// OK, ERR_ARG or ERR_NOMEM (f unchanged on error).
GGML_ZIPMOE_API int ggml_zipmoe_plan_debias_profile(uint64_t n_steps, int32_t n, int32_t k, double * f);

//
// expert substitution (opt-in, LOSSY) and the routing trace
//

// Expert substitution: opt-in and LOSSY, never on by default. Before a layer's fetch, a policy may
// replace experts the router chose with experts already resident, so that fewer are read; the
// model's output then differs from the model's own. Everything after it (weights, pools, the
// scheduler, prefetch) sees the final ids: llama.cpp takes the weights of the experts used from
// the router's scores, so a substitute is weighted by its own score.
#define GGML_ZIPMOE_SUBST_COUNT 3
enum ggml_zipmoe_substitution {
    GGML_ZIPMOE_SUBST_NONE  = 0, // lossless: the router's choice (the default)
    GGML_ZIPMOE_SUBST_SMOE  = 1, // SMoE's expert-cache router (its Alg. 1) with its batch-aware choice (5.4)
    GGML_ZIPMOE_SUBST_BUDDY = 2, // BuddyMoE (its Alg. 1): a missing expert's resident co-activation buddy,
                                 // behind its entropy, residency and budget gates (ggml_zipmoe_buddy_route)
};

GGML_ZIPMOE_API const char * ggml_zipmoe_substitution_name(int policy); // "none", "smoe", "buddy"; NULL if unknown

// SMoE's expert-cache router (SMoE Alg. 1 and 5.4) for one layer, a pure function. Per token t,
// with beta the (k+1)-th largest of its scores (k = n_used): its chosen experts scoring above
// (1 + alpha) beta are top-score, the rest low-score; every token's top-score experts form the set
// C. A low-score expert that is resident (resident[e] != 0) or in C is kept. The others may be
// replaced with alternatives: experts the token did not choose, scoring in [(1 - alpha) beta, beta),
// that are resident, in C, or (batch_aware) chosen by another token of the batch. With m
// replaceable and A alternatives, the best min(m, |A|) alternatives (batch_aware: chosen by the
// most tokens first; then by score) replace the lowest-scoring replaceable experts, in place.
// alpha = 0 (or n_used >= n_expert) changes nothing. scores: [n_tokens][n_expert] (row stride
// scores_stride), ids: [n_tokens][n_used] (row stride ids_stride), out: [n_tokens][n_used]
// contiguous (may be ids when ids_stride == n_used). *n_replaced (may be NULL) gets the selections
// replaced. OK, ERR_ARG (an id out of range, alpha outside [0, 1]) or ERR_NOMEM.
GGML_ZIPMOE_API int ggml_zipmoe_smoe_route(const float * scores, int64_t n_expert, int64_t scores_stride,
                                           const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                                           const uint8_t * resident, float alpha, int batch_aware, int32_t * out,
                                           int64_t * n_replaced);

// BuddyMoE's gates and search (its 3.1, 3.3 and Alg. 1)
struct ggml_zipmoe_buddy_params {
    float   tau;         // TAE gate: a token's experts may be replaced only if its TAE (eq. 1) > tau; < 0: the
                         // layer's calibrated tau (ggml_zipmoe_cache_set_buddies)
    float   temperature; // T of the TAE: the chosen experts' scores p^(1/T), renormalized (softmax(z/T) over S)
    float   gamma;       // margin gate: no replacement when the top-1 minus top-2 renormalized score >= gamma
                         // (>= 1: off)
    float   beta;        // distribution gate (eq. 2): no replacement in a batch whose fraction of requested
                         // experts not resident is >= beta
    int32_t rho;         // replacement budget: at most rho replacements per token (0: none)
    int32_t search;      // H: buddies searched per missing expert, in the list's order
    float   eta;         // priority (eq. 3): q_{j|i} (1 + eta z_j), z_j the token's standardized log score
                         // of j (0: the list's order, Alg. 1); one machine has no cross-link hop (kappa)
};

// the defaults: tau -1 (calibrated), T 1, gamma 1 (off), beta 1, rho 3, search 16, eta 0
GGML_ZIPMOE_API struct ggml_zipmoe_buddy_params ggml_zipmoe_buddy_default_params(void);

// BuddyMoE's substitution (its Alg. 1 with the gates of its 3.1) for one layer, a pure function. No
// replacement at all when the batch's fraction of distinct requested experts that are not resident is
// >= p->beta, or none is missing. Per token: the gates on its chosen experts' renormalized scores
// (TAE <= tau, or margin >= gamma: none), then, in selection order while fewer than p->rho were
// replaced, a chosen expert e that is not resident is replaced with the best of the first p->search
// entries of its buddy list buddies[e * k_max ..] (-1 ends a list) that is resident and not yet among
// the token's experts (by q_{j|e} (1 + eta z_j); at eta 0 the first such). Shapes as
// ggml_zipmoe_smoe_route; q: [n_expert][k_max] the buddies' q_{j|e}. *n_replaced (may be NULL) gets the
// selections replaced. OK, ERR_ARG or ERR_NOMEM.
GGML_ZIPMOE_API int ggml_zipmoe_buddy_route(const float * scores, int64_t n_expert, int64_t scores_stride,
                                            const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                                            const uint8_t * resident, const int32_t * buddies, const float * q,
                                            int32_t k_max, float tau, const struct ggml_zipmoe_buddy_params * p,
                                            int32_t * out, int64_t * n_replaced);

// the token's TAE (BuddyMoE eq. 1) from its chosen experts' scores: the normalized entropy of
// p^(1/T) renormalized over them, in [0, 1] (0 for one expert)
GGML_ZIPMOE_API float ggml_zipmoe_buddy_tae(const float * chosen_scores, int64_t n_used, float temperature);

// a layer's buddy profile (zipmoe-buddies): buddies and q as in ggml_zipmoe_buddy_route,
// copied; tau: the layer's calibrated TAE threshold. OK or ERR_ARG (a layer not served, an id out of
// range) or ERR_NOMEM. Without a profile a layer replaces nothing.
GGML_ZIPMOE_API int ggml_zipmoe_cache_set_buddies(struct ggml_zipmoe_cache * cache, int layer, const int32_t * buddies,
                                                  const float * q, int32_t k_max, float tau);
GGML_ZIPMOE_API int ggml_zipmoe_cache_set_buddy_params(struct ggml_zipmoe_cache * cache,
                                                       const struct ggml_zipmoe_buddy_params * params);

// Routing trace, for buddy profiles: while on, the substitution hook records per layer, over the tokens
// it routes (before any substitution), each expert's activations A(i), the pairwise co-activations
// M(i, j) of the same token (binary, and weighted by min of the two renormalized scores, BuddyMoE
// 3.3), and a histogram of the tokens' TAE at temperature T (GGML_ZIPMOE_TAE_BINS bins over [0, 1]).
// The first `warmup` tokens of each layer are down-weighted linearly (token n counts (n + 1) / warmup).
// Turning it on clears what was recorded. OK or ERR_ARG / ERR_NOMEM.
#define GGML_ZIPMOE_TAE_BINS 1000
GGML_ZIPMOE_API int ggml_zipmoe_cache_trace_routing(struct ggml_zipmoe_cache * cache, int on, float temperature,
                                                    int64_t warmup);
// what the trace recorded for a layer: activations [n_expert], coact and coact_weighted [n_expert][n_expert],
// tae_hist [GGML_ZIPMOE_TAE_BINS] (any may be NULL), *n_tokens the tokens seen. OK or ERR_ARG.
GGML_ZIPMOE_API int ggml_zipmoe_cache_get_routing_trace(const struct ggml_zipmoe_cache * cache, int layer,
                                                        double * activations, double * coact, double * coact_weighted,
                                                        uint64_t * tae_hist, uint64_t * n_tokens);

// the cache's substitution policy (enum ggml_zipmoe_substitution) and its parameter (SMOE: alpha in
// [0, 1]); NONE when the cache is made. OK or ERR_ARG.
GGML_ZIPMOE_API int ggml_zipmoe_cache_set_substitution(struct ggml_zipmoe_cache * cache, int policy, float alpha);
GGML_ZIPMOE_API int ggml_zipmoe_cache_get_substitution(const struct ggml_zipmoe_cache * cache, int * policy,
                                                       float * alpha);

// the substitution hook, called after the router's top-k and before the layer's fetch: out
// ([n_tokens][n_used], contiguous) gets ids with the cache's policy applied, "resident" meaning
// full in a slot now; with NONE, ids unchanged. Records the routing when a trace is on. Counts
// substitutions in the statistics. OK or ERR_ARG (a layer not served, a shape that is not the
// layer's, an id out of range) or ERR_NOMEM.
GGML_ZIPMOE_API int ggml_zipmoe_cache_substitute(struct ggml_zipmoe_cache * cache, int layer, const float * scores,
                                                 int64_t n_expert, int64_t scores_stride, const int32_t * ids,
                                                 int64_t n_used, int64_t n_tokens, int64_t ids_stride, int32_t * out);

#ifdef __cplusplus
}
#endif
