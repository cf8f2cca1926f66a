// Pool planner: ZipMoE's Algorithms 2-4 (paper §3.4, Appendix C) for the runtime's default pools.
//
// zipmoe_py/planner.py is the reference (it also fits the selection probabilities of a profile
// with the modified IPF); this file runs the same grid search on given selection probabilities,
// so that a model loaded with no options gets the planner's pools for the memory it has, from a
// built-in uniform profile (q_r = k / N: every expert equally likely, the worst case for a cache).
// tests/test_planner_c.py holds the two to the same choices.

#include "zipmoe-cache-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Algorithm 3: the makespan of a layer for the hit pattern h (h_F, h_C, h_S, h_E) of k selections
static double makespan(const struct ggml_zipmoe_plan_params * p, const int32_t h[4]) {
    const double n    = p->n_tensors;
    const double K    = p->n_shards;
    const double n_sm = n * (p->k - (h[0] + h[1] + h[2]));     // misses and E hits read their SM-chunks
    const double n_e  = n * K * (p->k - (h[0] + h[1] + h[3])); // misses and S hits read their E-chunks
    const double io   = n_sm * p->u + n_e * p->v;
    const double dec  = (n_e * p->v + n * K * (p->k - h[0]) * p->c) / p->threads;
    return io > dec ? io : dec;
}

// Algorithm 2 for every rank interval: phi[(a * (N + 1) + b) * (k + 1) + h] = P(h hits in ranks [a, b))
static double * interval_hits(const double * q, int32_t N, int32_t k) {
    const size_t H = (size_t) k + 1, W = (size_t) N + 1;
    double * phi = (double *) calloc(W * W * H, sizeof(double));
    if (phi == NULL) {
        return NULL;
    }
    for (int32_t a = 0; a <= N; a++) {
        phi[((size_t) a * W + a) * H] = 1.0;
        for (int32_t b = a; b < N; b++) {
            const double * prev = phi + ((size_t) a * W + b) * H;
            double *       next = phi + ((size_t) a * W + b + 1) * H;
            next[0] = prev[0] * (1.0 - q[b]);
            for (size_t h = 1; h < H; h++) {
                next[h] = prev[h] * (1.0 - q[b]) + prev[h - 1] * q[b];
            }
        }
    }
    return phi;
}

// Algorithm 4, lines 8-29: the expected makespan of per-layer capacities packed in hierarchy order
static double expected_makespan(const struct ggml_zipmoe_plan_params * p, const double * phi, const int32_t cap[4]) {
    const int32_t N = p->n_expert, k = p->k;
    const size_t  H = (size_t) k + 1, W = (size_t) N + 1;
    int32_t start[5];
    start[0] = 0;
    for (int i = 0; i < 4; i++) {
        start[i + 1] = start[i] + cap[i];
    }
    const double * pool[4];
    for (int i = 0; i < 4; i++) {
        pool[i] = phi + ((size_t) start[i] * W + start[i + 1]) * H;
    }
    const double * miss = phi + ((size_t) start[4] * W + N) * H;
    double total = 0.0;
    int32_t h[4];
    for (h[0] = 0; h[0] <= k; h[0]++) {
        for (h[1] = 0; h[0] + h[1] <= k; h[1]++) {
            for (h[2] = 0; h[0] + h[1] + h[2] <= k; h[2]++) {
                for (h[3] = 0; h[0] + h[1] + h[2] + h[3] <= k; h[3]++) {
                    const double pr = miss[k - (h[0] + h[1] + h[2] + h[3])] * pool[0][h[0]] * pool[1][h[1]] *
                                      pool[2][h[2]] * pool[3][h[3]];
                    if (pr != 0.0) {
                        total += makespan(p, h) * pr;
                    }
                }
            }
        }
    }
    return total / phi[W * H * 0 + (size_t) N * H + (size_t) k];
}

struct grid_search {
    const struct ggml_zipmoe_plan_params * p;
    const double *                         phi;
    int                                    chosen[4]; // Lambda, hierarchy order
    int                                    n_chosen;
    int32_t                                share[4];  // grid steps of each chosen pool
    struct ggml_zipmoe_plan_result *       best;
    int                                    found;
};

// the grid point's capacities: floor(share * budget / (steps * entry * layers)), capped at the ranks left
static void visit(struct grid_search * g) {
    const struct ggml_zipmoe_plan_params * p = g->p;
    int32_t cap[4] = { 0, 0, 0, 0 };
    int32_t free_ranks = p->n_expert;
    for (int i = 0; i < g->n_chosen; i++) {
        const int      pool = g->chosen[i];
        const uint64_t fits = (uint64_t) g->share[i] * p->budget /
                              ((uint64_t) p->grid_steps * p->entry_bytes[pool] * (uint64_t) p->n_layer);
        cap[pool] = fits < (uint64_t) free_ranks ? (int32_t) fits : free_ranks;
        free_ranks -= cap[pool];
    }
    const double cost = expected_makespan(p, g->phi, cap);
    if (!g->found || cost < g->best->expected_makespan_s) {
        g->found = 1;
        g->best->expected_makespan_s = cost;
        memcpy(g->best->capacity, cap, sizeof(cap));
    }
}

// every split of `steps` over the chosen pools from index i on, the first pool's largest share first
static void walk(struct grid_search * g, int i, int32_t steps) {
    if (i + 1 >= g->n_chosen || i >= 3) {
        g->share[i] = steps;
        visit(g);
        return;
    }
    for (int32_t first = steps; first >= 0; first--) {
        g->share[i] = first;
        walk(g, i + 1, steps - first);
    }
}

static int bad_params(const struct ggml_zipmoe_plan_params * p) {
    if (p == NULL || p->n_expert < 1 || p->k < 1 || p->k > p->n_expert || p->threads < 1 || p->n_shards < 1 ||
        p->n_tensors < 1 || p->n_layer < 1 || p->grid_steps < 1 || p->budget == 0 || !(p->u >= 0) || !(p->v >= 0) ||
        !(p->c >= 0)) {
        return 1;
    }
    int any = 0;
    for (int i = 0; i < 4; i++) {
        any |= p->entry_bytes[i] != 0;
    }
    if (!any) {
        return 1;
    }
    for (int32_t r = 0; p->q != NULL && r < p->n_expert; r++) {
        if (!(p->q[r] >= 0.0 && p->q[r] <= 1.0)) {
            return 1;
        }
    }
    return 0;
}

int ggml_zipmoe_plan_pools(const struct ggml_zipmoe_plan_params * p, struct ggml_zipmoe_plan_result * out) {
    if (out == NULL || bad_params(p)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    memset(out, 0, sizeof(*out));
    double * q = (double *) malloc(sizeof(double) * (size_t) p->n_expert);
    if (q == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    for (int32_t r = 0; r < p->n_expert; r++) {
        q[r] = p->q != NULL ? p->q[r] : (double) p->k / p->n_expert;
    }
    double * phi = interval_hits(q, p->n_expert, p->k);
    free(q);
    if (phi == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    if (!(phi[(size_t) p->n_expert * (p->k + 1) + p->k] > 0.0)) {
        free(phi);
        return GGML_ZIPMOE_ERR_ARG; // no k-set has a non-zero probability
    }
    struct grid_search g = { p, phi, { 0 }, 0, { 0 }, out, 0 };
    for (int pool = 0; pool < 4; pool++) {
        if (p->entry_bytes[pool] != 0) {
            g.chosen[g.n_chosen++] = pool;
        }
    }
    walk(&g, 0, p->grid_steps);
    free(phi);
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_cache_default_pools(const struct ggml_zipmoe_cache * c, uint64_t budget, int32_t k, int32_t n_threads,
                                    int32_t work_slots, double rate_read, double rate_decode,
                                    struct ggml_zipmoe_default_pools * out) {
    if (c == NULL || out == NULL || k < 1 || n_threads < 1 || work_slots < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    memset(out, 0, sizeof(*out));
    const int32_t  L = c->layout.n_served;
    const int32_t  N = c->layout.max_expert;
    const uint64_t X = 2 * c->layout.sm_bytes; // a full expert: its slot
    const uint64_t entry_c = zipmoe_align_up(c->layout.sm_bytes + c->layout.max_e_bytes, 64);
    out->n_slots = L > 0 && N > 0 ? (int32_t) (budget / X < (uint64_t) N * L ? budget / X : (uint64_t) N * L) : 0;
    if (L < 1 || N < 1 || k > N) {
        snprintf(out->why, sizeof(out->why), "one F pool: no layer to plan for");
        return GGML_ZIPMOE_OK;
    }
    if (budget >= X * N * L) {
        snprintf(out->why, sizeof(out->why), "one F pool: every expert fits full (%.2f GiB of %.2f GiB)",
                 X * N * (double) L / (1 << 30), budget / (double) (1 << 30));
        return GGML_ZIPMOE_OK;
    }
    const uint64_t work = (uint64_t) work_slots * X;
    const uint64_t all_c = entry_c * N * L;
    if (budget >= all_c + work) {
        // every expert in C, and as many as room allows full in F as well: after warm-up nothing is read
        const uint64_t f = (budget - all_c - work) / (X * L);
        out->capacity[GGML_ZIPMOE_POOL_F] = f < (uint64_t) N ? (int32_t) f : N;
        out->capacity[GGML_ZIPMOE_POOL_C] = N;
        out->inclusive = 1;
        out->n_slots   = out->capacity[GGML_ZIPMOE_POOL_F] * L + work_slots;
        snprintf(out->why, sizeof(out->why), "every compressed expert fits: C holds all %d per layer (%.2f GiB), F "
                 "keeps %d per layer full as well (room left in %.2f GiB): nothing is read after warm-up",
                 N, all_c / (double) (1 << 30), out->capacity[GGML_ZIPMOE_POOL_F], budget / (double) (1 << 30));
        return GGML_ZIPMOE_OK;
    }
    if (budget <= work + X * L) {
        snprintf(out->why, sizeof(out->why), "one F pool: %.2f GiB is too little for pools beside %d working slots",
                 budget / (double) (1 << 30), work_slots);
        return GGML_ZIPMOE_OK;
    }
    const double read   = rate_read > 0 ? rate_read : c->plan.rate_read;
    const double decode = rate_decode > 0 ? rate_decode : c->plan.rate_decode;
    const double n = 3, K = c->file->n_shards;
    struct ggml_zipmoe_plan_params p = { 0 };
    p.n_expert   = N;
    p.k          = k;
    p.q          = NULL;
    p.budget     = budget - work;
    p.entry_bytes[GGML_ZIPMOE_POOL_F] = X;
    p.entry_bytes[GGML_ZIPMOE_POOL_C] = entry_c;
    p.entry_bytes[GGML_ZIPMOE_POOL_S] = zipmoe_align_up(c->layout.sm_bytes, 64);
    p.entry_bytes[GGML_ZIPMOE_POOL_E] = zipmoe_align_up(c->layout.max_e_bytes, 64);
    p.u          = c->layout.sm_bytes / n / read;
    p.v          = c->layout.rho * c->layout.sm_bytes / (n * K) / read; // the mean E-chunk
    p.c          = X / (n * K) / decode;
    p.threads    = n_threads;
    p.n_shards   = (int32_t) K;
    p.n_tensors  = 3;
    p.n_layer    = L;
    p.grid_steps = 20;
    struct ggml_zipmoe_plan_result best;
    int status = ggml_zipmoe_plan_pools(&p, &best);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    struct ggml_zipmoe_plan_params f_only = p;
    memset(f_only.entry_bytes + 1, 0, 3 * sizeof(uint64_t));
    f_only.budget = budget; // one F pool needs no working slots of its own
    struct ggml_zipmoe_plan_result f_best;
    status = ggml_zipmoe_plan_pools(&f_only, &f_best);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    out->expected_makespan_s = best.expected_makespan_s;
    out->f_only_makespan_s   = f_best.expected_makespan_s;
    const int pools = best.capacity[1] + best.capacity[2] + best.capacity[3] > 0;
    if (!pools || best.expected_makespan_s >= f_best.expected_makespan_s) {
        snprintf(out->why, sizeof(out->why), "one F pool: the planner (uniform profile, read %.2f GB/s, decode %.2f "
                 "GB/s x %d threads) expects %.2f ms per layer, pools no better", read / 1e9, decode / 1e9, n_threads,
                 f_best.expected_makespan_s * 1e3);
        return GGML_ZIPMOE_OK;
    }
    memcpy(out->capacity, best.capacity, sizeof(best.capacity));
    out->n_slots = best.capacity[GGML_ZIPMOE_POOL_F] * L + work_slots;
    snprintf(out->why, sizeof(out->why), "the planner (uniform profile, read %.2f GB/s, decode %.2f GB/s x %d threads) "
             "for %.2f GiB: %.2f ms per layer expected, against %.2f ms with one F pool", read / 1e9, decode / 1e9,
             n_threads, budget / (double) (1 << 30), best.expected_makespan_s * 1e3, f_best.expected_makespan_s * 1e3);
    return GGML_ZIPMOE_OK;
}
