// The default pools (ggml_zipmoe_cache_default_pools, ggml-zipmoe-policy.h): the pools a model loaded
// with no pool options gets for the memory left, from the planner (zipmoe-planner.c) and what the cache
// says of its store entries, rates and pools (a zipmoe_pool_view, made by cache/zipmoe-pool-view.c); its
// re-plan (serving/zipmoe-replan.c) calls it with a profile.

#include "policy/zipmoe-policy-impl.h"
#include "common/zipmoe-impl.h"
#include "ggml-zipmoe-options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// f scaled to sum k, capped at 1 (zipmoe_py/plan_math.py: round_to_subset_size with k given); f descending
static void scale_to_k(const double * f, int32_t n, int32_t k, double * out) {
    double tail = 0;
    for (int32_t i = 0; i < n; i++) {
        tail += f[i];
    }
    int32_t capped = 0;
    double  scale  = tail > 0 ? k / tail : 0;
    for (; capped < k && tail > 0; capped++) {
        scale = (k - capped) / tail;
        if (scale * f[capped] <= 1.0) {
            break;
        }
        tail -= f[capped];
    }
    for (int32_t i = 0; i < n; i++) {
        out[i] = i < capped ? 1.0 : (scale * f[i] < 1.0 ? scale * f[i] : 1.0);
    }
}

// the selection probabilities fitted to an observed profile into *q (made here, [2 N]), or NULL with
// *source saying the uniform profile stands in when it does not fit. OK or ERR_NOMEM.
static int fit_profile(const double * profile, int32_t N, int32_t k, double ** q, const char ** source) {
    *q = (double *) malloc(sizeof(double) * 2 * (size_t) N);
    if (*q == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    scale_to_k(profile, N, k, *q + N);
    *source = "observed profile";
    if (ggml_zipmoe_plan_fit(*q + N, N, k, *q) != GGML_ZIPMOE_OK) {
        free(*q);
        *q      = NULL;
        *source = "uniform profile (the observed one did not fit)";
    }
    return GGML_ZIPMOE_OK;
}

// a pool C store entry: an expert's SM-chunks and its largest E-chunks, as the cache makes them
static uint64_t entry_c_bytes(const struct zipmoe_pool_view * v) {
    return zipmoe_align_up(v->layout.sm_bytes + v->layout.max_e_bytes, 64);
}

// the planner's inputs for this cache: its store entries' real sizes, the delays of Algorithm 3 from
// the rates (bytes per second), the selection probabilities q (NULL: uniform)
static struct ggml_zipmoe_plan_params cost_model(const struct zipmoe_pool_view * v, int32_t k, const double * q,
                                                 uint64_t budget, double read, double decode, int32_t n_threads) {
    const uint64_t X = v->layout.expert_bytes; // a full expert: its slot
    const double   n = 3, K = v->layout.n_shards;
    struct ggml_zipmoe_plan_params p = { 0 };
    p.n_expert   = v->layout.max_expert;
    p.k          = k;
    p.q          = q;
    p.budget     = budget;
    p.entry_bytes[GGML_ZIPMOE_POOL_F] = X;
    p.entry_bytes[GGML_ZIPMOE_POOL_C] = entry_c_bytes(v);
    p.entry_bytes[GGML_ZIPMOE_POOL_S] = zipmoe_align_up(v->layout.sm_bytes, 64);
    p.entry_bytes[GGML_ZIPMOE_POOL_E] = zipmoe_align_up(v->layout.max_e_bytes, 64);
    p.u          = v->layout.sm_bytes / n / read;
    p.v          = v->layout.rho * v->layout.sm_bytes / (n * K) / read; // the mean E-chunk
    p.c          = X / (n * K) / decode;
    p.threads    = n_threads;
    p.n_shards   = (int32_t) K;
    p.n_tensors  = 3;
    p.n_layer    = v->layout.n_served;
    p.grid_steps = 20;
    return p;
}

// experts per served layer that one F pool of n_slots holds
static int32_t f_per_layer(const struct zipmoe_pool_view * v, int32_t n_slots) {
    const int32_t L = v->layout.n_served, N = v->layout.max_expert;
    return n_slots / L < N ? n_slots / L : N;
}

// the per-layer capacities of the pools the cache has now, packed in hierarchy order
static void current_pools(const struct zipmoe_pool_view * v, int32_t now[4]) {
    const int32_t L = v->layout.n_served, N = v->layout.max_expert;
    memset(now, 0, 4 * sizeof(int32_t));
    if (v->one_f_pool) {
        now[GGML_ZIPMOE_POOL_F] = f_per_layer(v, v->n_used);
        return;
    }
    int32_t left = N;
    for (int i = 0; i < 4; i++) {
        const int32_t held = i == 0 ? v->f_capacity / L : v->n_entries[i] / L;
        now[i] = held < left ? held : left;
        left -= now[i];
    }
}

// the pool a rank goes to in pools of these per-layer capacities (packed in hierarchy order; an
// inclusive C counts the ranks past F's), NO_POOL beyond every one
static int rank_pool(const int32_t capacity[4], int inclusive, int32_t rank) {
    int32_t bound = 0;
    for (int p = 0; p < 4; p++) {
        bound += p == GGML_ZIPMOE_POOL_C && inclusive ? capacity[p] - capacity[GGML_ZIPMOE_POOL_F] : capacity[p];
        if (rank < bound) {
            return p;
        }
    }
    return NO_POOL;
}

// the pools whose experts a change into host slots decodes into F (as the cache's stores migrate them)
static int migrates_from(int p) {
    return p == GGML_ZIPMOE_POOL_C || p == GGML_ZIPMOE_POOL_S;
}

// the experts of C or S that F decodes if it holds f_per_layer per layer (*from_s: those from S)
static int32_t count_migrants(const struct zipmoe_pool_view * v, int32_t f_per_layer, int32_t * from_s) {
    int32_t n = 0, s = 0;
    for (int32_t r = 0; r < f_per_layer && r < v->layout.max_expert; r++) {
        n += v->migrants[r];
        s += v->migrants_from_s[r];
    }
    *from_s = s;
    return n;
}

// an expert's mean stored E-chunks (rho of its SM-chunks' bytes)
static double mean_e_bytes(const struct zipmoe_pool_view * v) {
    return v->layout.rho * (double) v->layout.sm_bytes;
}

// stored bytes an expert moved from pool `from` (NO_POOL: none) to pool `to` reads on its next use. A
// change keeps an expert's entry only in its own pool (zipmoe_cache_resize_stores), so `to` reads all it
// keeps (a miss, for F), but two: C or S into host slots decodes its entry (set_pools_migrating; S's
// E-chunks counted with the migrants), and F's experts keep their entries in an inclusive C
static double fill_bytes(const struct zipmoe_pool_view * v, int from, int to, int host, int now_inclusive) {
    const double sm = (double) v->layout.sm_bytes, e = mean_e_bytes(v);
    if ((migrates_from(from) && to == GGML_ZIPMOE_POOL_F && host) ||
        (from == GGML_ZIPMOE_POOL_F && to == GGML_ZIPMOE_POOL_C && now_inclusive)) {
        return 0;
    }
    return to == GGML_ZIPMOE_POOL_S ? sm : to == GGML_ZIPMOE_POOL_E ? e : sm + e;
}

// seconds that a change from the pools the cache has now (now, inclusive or not as the cache's) to out's
// costs, rank by rank: an expert that keeps its pool costs nothing, nor one dropped beyond every new pool
// (its next use is a miss, as the new pools' makespan counts it); one that changes pool is read
// (fill_bytes) on its next use and, bound for F, decoded: then, or by the change for those C or S holds
// (ggml_zipmoe_cache_set_pools_migrating; S's read their E-chunks), on n_threads. Slots past those in use
// are written for the first time (page faults and zeroing, at the touch rate) by n_threads as well, less
// the pages that the entries the stores give up move into them where slots take pages (given_up_bytes).
// C's and S's experts that F takes are decoded only if used again (zipmoe_count_migrants); the others'
// next use, if any, is a miss.
static double given_up_bytes(const struct zipmoe_pool_view * v, const int32_t next[4],
                             const int32_t capacity[4]) {
    // the pages move where the change migrates (an F that takes experts, or one F pool) into host slots
    // that take them (zipmoe_cache_change_pools opens the sink)
    const int migrates = capacity[GGML_ZIPMOE_POOL_F] > 0 ||
                         capacity[GGML_ZIPMOE_POOL_C] + capacity[GGML_ZIPMOE_POOL_S] + capacity[GGML_ZIPMOE_POOL_E] == 0;
    if (!v->moves_pages || !migrates) {
        return 0;
    }
    double bytes = 0;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        const int32_t kept = next[p] * v->layout.n_served;
        // whole huge-page blocks move: an entry alone holds a block less than its size (runs of neighbours
        // hold more; v->entry_blocks), and the last layer's migrants give theirs once their slots are
        // written. The entries written have their pages; the populator faults only a window past them in
        const int32_t held = v->n_held[p];
        bytes += held > kept ? (double) (held - kept) * v->entry_blocks[p] : 0;
    }
    return bytes;
}

static void refill_cost(const struct zipmoe_pool_view * v, const int32_t now[4], double read, double decode,
                        int32_t n_threads, struct ggml_zipmoe_default_pools * out) {
    const int32_t L = v->layout.n_served, N = v->layout.max_expert;
    int32_t next[4];
    memcpy(next, out->capacity, sizeof(next));
    if (next[0] + next[1] + next[2] + next[3] == 0) { // one F pool of n_slots
        next[GGML_ZIPMOE_POOL_F] = f_per_layer(v, out->n_slots);
    }
    const int    host = v->host;
    const double X    = (double) v->layout.expert_bytes;
    double  read_bytes = 0, decoded = 0;
    int32_t filled     = 0; // ranks a layer that F fills on their next use
    for (int32_t r = 0; r < N; r++) {
        const int from = rank_pool(now, 0, r), to = rank_pool(next, out->inclusive, r);
        if (to == NO_POOL || to == from) {
            continue;
        }
        read_bytes += fill_bytes(v, from, to, host, v->inclusive);
        // from C or S into host slots: the experts the change decodes are counted whole below
        const int migrated = migrates_from(from) && to == GGML_ZIPMOE_POOL_F && host;
        decoded += to == GGML_ZIPMOE_POOL_F && !migrated ? X : 0;
        filled += to == GGML_ZIPMOE_POOL_F && !migrated;
    }
    int32_t       from_s   = 0;
    const int32_t migrants = host ? count_migrants(v, next[GGML_ZIPMOE_POOL_F], &from_s) : 0;
    decoded += X * migrants / L;
    read_bytes += mean_e_bytes(v) * from_s / L; // S's E-chunks
    // the slots written: the migrants' and the fills', of the new ones (those past the slots in use)
    const int32_t added     = host && out->n_slots > v->n_used ? out->n_slots - v->n_used : 0;
    const int32_t new_slots = added < migrants + filled * L ? added : migrants + filled * L;
    const double  touch     = v->rate_touch;
    const double  spared    = given_up_bytes(v, next, out->capacity);
    const double  touched   = new_slots * X > spared ? new_slots * X - spared : 0;
    out->refill_s = (read > 0 ? read_bytes * L / read : 0) + (decode > 0 ? decoded * L / (decode * n_threads) : 0) +
                    (touch > 0 ? touched / (touch * n_threads) : 0);
}

enum { HELD_NONE, HELD_ALL_IN_C, HELD_C_AND_E };

// the pools that keep every expert compressed, where the budget (less the working slots) allows:
// HELD_ALL_IN_C, every expert in C and as many as the rest allows full in F as well (inclusive);
// short of that, with the built-in profile, HELD_C_AND_E: C as many as fit, the E-chunks of the
// other (at most k) per layer in E. Rank dispatch on a flat profile moves experts between partial
// pools on noise, which the planner does not model (the full Qwen1.5-MoE geometry, uniform router,
// at 20 GiB decoded 1.66x faster than with the planner's partial pools)
static int compressed_pools(const struct zipmoe_pool_view * v, uint64_t budget, int32_t k, uint64_t work,
                            int observed, int32_t capacity[4]) {
    const int32_t  L = v->layout.n_served, N = v->layout.max_expert;
    const uint64_t X = v->layout.expert_bytes, entry_c = entry_c_bytes(v);
    const uint64_t entry_e = zipmoe_align_up(v->layout.max_e_bytes, 64);
    memset(capacity, 0, 4 * sizeof(int32_t));
    if (budget >= entry_c * N * L + work) {
        const uint64_t f = (budget - entry_c * N * L - work) / (X * L);
        capacity[GGML_ZIPMOE_POOL_F] = f < (uint64_t) N ? (int32_t) f : N;
        capacity[GGML_ZIPMOE_POOL_C] = N;
        return HELD_ALL_IN_C;
    }
    const uint64_t all_e  = entry_e * N * L;
    const uint64_t c_room = budget > work + all_e ? (budget - work - all_e) / ((entry_c - entry_e) * L) : 0;
    if (observed || c_room == 0 || c_room < (uint64_t) (N - k)) {
        return HELD_NONE;
    }
    capacity[GGML_ZIPMOE_POOL_C] = (int32_t) c_room;
    capacity[GGML_ZIPMOE_POOL_E] = N - (int32_t) c_room;
    return HELD_C_AND_E;
}

// out's pools and reason for compressed_pools' choice (held), whose expected makespan is makespan_s
static void take_compressed(const struct zipmoe_pool_view * v, int held, const int32_t capacity[4], double makespan_s,
                            uint64_t budget, int32_t work_slots, const char * source,
                            struct ggml_zipmoe_default_pools * out) {
    const int32_t L = v->layout.n_served, N = v->layout.max_expert;
    char          all_c[32], room[32];
    ggml_zipmoe_size_text(entry_c_bytes(v) * (uint64_t) N * (uint64_t) L, all_c, sizeof(all_c));
    ggml_zipmoe_size_text(budget, room, sizeof(room));
    memcpy(out->capacity, capacity, sizeof(out->capacity));
    out->inclusive           = held == HELD_ALL_IN_C;
    out->n_slots             = capacity[GGML_ZIPMOE_POOL_F] * L + work_slots;
    out->expected_makespan_s = makespan_s;
    if (held == HELD_ALL_IN_C) {
        snprintf(out->why, sizeof(out->why), "every compressed expert fits: C holds all %d per layer (%s), F "
                 "keeps %d per layer full as well (room left in %s): nothing is read after warm-up (%s)",
                 N, all_c, capacity[GGML_ZIPMOE_POOL_F], room, source);
    } else {
        snprintf(out->why, sizeof(out->why), "every expert kept compressed: C holds %d per layer, E the E-chunks of "
                 "the other %d (all in C would take %s of %s): a token reads at most their SM-chunks (%s)",
                 capacity[GGML_ZIPMOE_POOL_C], capacity[GGML_ZIPMOE_POOL_E], all_c, room, source);
    }
}

#define ZIPMOE_POOLS_GAIN 0.9 // pools on an observed profile: at most this share of one F pool's makespan

// one F pool where pools cannot help: no layer to plan for, every expert fits full, or too few slots for
// pools' working slots and one F expert per layer. Returns 1 with out said so, else 0
static int one_f_pool_plainly(const struct zipmoe_pool_view * v, uint64_t budget, int32_t k, int32_t work_slots,
                              struct ggml_zipmoe_default_pools * out) {
    const int32_t  L = v->layout.n_served;
    const int32_t  N = v->layout.max_expert;
    const uint64_t X = v->layout.expert_bytes; // a full expert: its slot
    out->n_slots = L > 0 && N > 0 ? (int32_t) (budget / X < (uint64_t) N * L ? budget / X : (uint64_t) N * L) : 0;
    if (L < 1 || N < 1 || k > N) {
        snprintf(out->why, sizeof(out->why), "one F pool: no layer to plan for");
        return 1;
    }
    char room[32], all_f[32];
    ggml_zipmoe_size_text(budget, room, sizeof(room));
    if (budget >= X * N * L) {
        ggml_zipmoe_size_text(X * (uint64_t) N * (uint64_t) L, all_f, sizeof(all_f));
        snprintf(out->why, sizeof(out->why), "one F pool: every expert fits full (%s of %s)", all_f, room);
        return 1;
    }
    const uint64_t work = (uint64_t) work_slots * X;
    if (budget <= work + X * L) {
        // said in slots: the budget may hold fewer slots than the working slots pools would need
        snprintf(out->why, sizeof(out->why), "one F pool: %s holds %llu full experts, too few for pools, "
                 "which need more than %d working slots and one expert per MoE layer in F (%d)",
                 room, (unsigned long long) (budget / X), work_slots, work_slots + L);
        return 1;
    }
    return 0;
}

// the candidates the planner weighs for a budget: its pools (best), one F pool (f_best), the pools that
// keep every expert compressed (held, held_capacity, held_makespan_s) and the pools the cache has now (now)
struct pool_candidates {
    struct ggml_zipmoe_plan_result best, f_best;
    int     held;
    int32_t held_capacity[4];
    double  held_makespan_s;
    int32_t now[4];
};

// the candidates under p (the planner's inputs, budget less the working slots `work`); the current pools'
// expected makespan into out. OK, or the planner's error
static int plan_candidates(const struct zipmoe_pool_view * v, const struct ggml_zipmoe_plan_params * p,
                           uint64_t budget, int32_t k, uint64_t work, int observed, struct pool_candidates * c,
                           struct ggml_zipmoe_default_pools * out) {
    int status = ggml_zipmoe_plan_pools(p, &c->best);
    struct ggml_zipmoe_plan_params f_only = *p;
    memset(f_only.entry_bytes + 1, 0, 3 * sizeof(uint64_t));
    f_only.budget = budget; // one F pool needs no working slots of its own
    if (status == GGML_ZIPMOE_OK) {
        status = ggml_zipmoe_plan_pools(&f_only, &c->f_best);
    }
    // every expert kept compressed: with the built-in profile it is taken whenever it fits; with an
    // observed one, when the planner expects it to be the fastest
    int32_t evaluated[4];
    c->held            = compressed_pools(v, budget, k, work, observed, c->held_capacity);
    c->held_makespan_s = 0;
    if (status == GGML_ZIPMOE_OK && c->held != HELD_NONE) {
        memcpy(evaluated, c->held_capacity, sizeof(evaluated));
        evaluated[GGML_ZIPMOE_POOL_C] -= evaluated[GGML_ZIPMOE_POOL_F]; // an inclusive C's hits, as exclusive pools
        status = zipmoe_plan_evaluate(p, evaluated, &c->held_makespan_s);
    }
    memset(c->now, 0, sizeof(c->now));
    if (status == GGML_ZIPMOE_OK) {
        // the pools the cache has now, under the same profile: a caller changes them only for a real gain
        current_pools(v, c->now);
        status = zipmoe_plan_evaluate(p, c->now, &out->current_makespan_s);
    }
    return status;
}

int zipmoe_default_pools(const struct zipmoe_pool_view * v, uint64_t budget, int32_t k, int32_t n_threads,
                         int32_t work_slots, double rate_read, double rate_decode, const double * profile,
                         struct ggml_zipmoe_default_pools * out) {
    if (v == NULL || out == NULL || k < 1 || n_threads < 1 || work_slots < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    memset(out, 0, sizeof(*out));
    if (one_f_pool_plainly(v, budget, k, work_slots, out)) {
        return GGML_ZIPMOE_OK;
    }
    const int32_t  L = v->layout.n_served;
    const int32_t  N = v->layout.max_expert;
    const uint64_t work = (uint64_t) work_slots * v->layout.expert_bytes;
    char room[32];
    ggml_zipmoe_size_text(budget, room, sizeof(room));

    double *     q      = NULL;
    const char * source = "uniform profile";
    if (profile != NULL && fit_profile(profile, N, k, &q, &source) != GGML_ZIPMOE_OK) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    const double read   = rate_read > 0 ? rate_read : v->rate_read;
    const double decode = rate_decode > 0 ? rate_decode : v->rate_decode;
    const struct ggml_zipmoe_plan_params p = cost_model(v, k, q, budget - work, read, decode, n_threads);
    struct pool_candidates c;
    const int status = plan_candidates(v, &p, budget, k, work, profile != NULL, &c, out);
    free(q);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    out->expected_makespan_s = c.best.expected_makespan_s;
    out->f_only_makespan_s   = c.f_best.expected_makespan_s;
    // pools planned on an observed profile must expect a tenth less than one F pool: the makespan leaves
    // out what they cost beyond it (the stores' first writes, decoding on the graph's threads, a change's
    // migration into new slots), and the full Qwen1.5-MoE geometry at 12 GiB decoded at 1.3-1.5x one F
    // pool's step with pools expected 1% faster
    const double f_only_s = profile == NULL ? c.f_best.expected_makespan_s
                                            : ZIPMOE_POOLS_GAIN * c.f_best.expected_makespan_s;
    if (c.held != HELD_NONE && (profile == NULL || (c.held_makespan_s <= c.best.expected_makespan_s &&
                                                    c.held_makespan_s < f_only_s))) {
        take_compressed(v, c.held, c.held_capacity, c.held_makespan_s, budget, work_slots, source, out);
    } else if (c.best.capacity[1] + c.best.capacity[2] + c.best.capacity[3] == 0 ||
               c.best.expected_makespan_s >= f_only_s) {
        snprintf(out->why, sizeof(out->why), "one F pool: the planner (%s, read %.2f GB/s, decode %.2f GB/s x %d "
                 "threads) expects %.2f ms per layer, pools no better%s (%.2f ms)", source, read / 1e9, decode / 1e9,
                 n_threads, c.f_best.expected_makespan_s * 1e3, profile != NULL ? " by a tenth" : "",
                 c.best.expected_makespan_s * 1e3);
    } else {
        memcpy(out->capacity, c.best.capacity, sizeof(c.best.capacity));
        out->n_slots = c.best.capacity[GGML_ZIPMOE_POOL_F] * L + work_slots;
        snprintf(out->why, sizeof(out->why), "the planner (%s, read %.2f GB/s, decode %.2f GB/s x %d threads) for "
                 "%s: %.2f ms per layer expected, against %.2f ms with one F pool", source, read / 1e9, decode / 1e9,
                 n_threads, room, c.best.expected_makespan_s * 1e3, c.f_best.expected_makespan_s * 1e3);
    }
    refill_cost(v, c.now, read, decode, n_threads, out);
    return GGML_ZIPMOE_OK;
}

int zipmoe_device_pools(const struct zipmoe_pool_view * v, int32_t n_device_slots, uint64_t host_bytes,
                        int32_t work_slots, struct ggml_zipmoe_default_pools * out) {
    if (v == NULL || out == NULL || work_slots < 1 || n_device_slots < 0) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    memset(out, 0, sizeof(*out));
    out->n_slots = n_device_slots;
    const int32_t L = v->layout.n_served, N = v->layout.max_expert;
    if (L < 1 || N < 1) {
        snprintf(out->why, sizeof(out->why), "one F pool: no layer to plan for");
        return GGML_ZIPMOE_OK;
    }
    const int32_t f = n_device_slots > work_slots ? (n_device_slots - work_slots) / L : 0;
    if (n_device_slots >= N * L) {
        snprintf(out->why, sizeof(out->why), "one F pool: the device's %d slots hold every expert", n_device_slots);
        return GGML_ZIPMOE_OK;
    }
    if (f < 1) {
        snprintf(out->why, sizeof(out->why), "one F pool: the device's %d slots are too few for pools, which need "
                 "more than %d working slots and one expert per MoE layer in F (%d)", n_device_slots, work_slots,
                 work_slots + L);
        return GGML_ZIPMOE_OK;
    }
    const int32_t  rest    = N - (f < N ? f : N);
    const uint64_t entry_c = entry_c_bytes(v), entry_e = zipmoe_align_up(v->layout.max_e_bytes, 64);
    const uint64_t per_layer = host_bytes / (uint64_t) L;
    int32_t held_c = 0, held_e = 0;
    if (per_layer >= entry_c * (uint64_t) rest) {
        held_c = rest;
    } else if (per_layer >= entry_e * (uint64_t) rest) {
        held_c = (int32_t) ((per_layer - entry_e * (uint64_t) rest) / (entry_c - entry_e));
        held_e = rest - held_c;
    } else {
        held_e = (int32_t) (per_layer / entry_e);
    }
    char host[32];
    ggml_zipmoe_size_text(host_bytes, host, sizeof(host));
    if (held_c + held_e == 0) {
        snprintf(out->why, sizeof(out->why), "one F pool in the device's memory: %s of host memory holds no "
                 "compressed expert per layer", host);
        return GGML_ZIPMOE_OK;
    }
    out->capacity[GGML_ZIPMOE_POOL_F] = f;
    out->capacity[GGML_ZIPMOE_POOL_C] = held_c;
    out->capacity[GGML_ZIPMOE_POOL_E] = held_e;
    out->n_slots = n_device_slots; // the slots past F's are working slots: the device's memory is taken anyway
    snprintf(out->why, sizeof(out->why), "F in the device's memory (%d slots), C and E in %s of host memory: "
             "%d of the other %d experts per layer kept whole compressed, %d as E-chunks; a miss reads %s",
             n_device_slots, host, held_c, rest, held_e,
             held_c == rest ? "nothing after its first use" : held_c + held_e == rest ? "at most its SM-chunks"
                                                                                  : "the experts not kept in full");
    return GGML_ZIPMOE_OK;
}
