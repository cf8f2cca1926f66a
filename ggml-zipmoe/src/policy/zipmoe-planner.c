// Pool planner: ZipMoE's Algorithms 2-4 (paper §3.4, Appendix C) for the runtime's default pools.
//
// The one planner: the runtime's default pools, their re-plan from an observed profile
// (serving/zipmoe-replan.c) and zipmoe-plan all run it; selection probabilities are fitted to a
// profile with the modified IPF (ggml_zipmoe_plan_fit) or, with none, taken from a built-in uniform
// profile (q_r = k / N: every expert equally likely, the worst case for a cache). tests/planner.py
// is the reference in Python; tests/test_default_pools.py holds the two to the same choices. The
// default rates its costs take (ggml_zipmoe_default_rate) are defined here too; a cache's own (given,
// default or measured: ggml_zipmoe_cache_rate) are the cache's (cache/zipmoe-stats.c).

#include "policy/zipmoe-policy-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// default rates of the scheduler's cost model (ggml_zipmoe_default_rate; the planner reads them)
#define ZIPMOE_READ_BYTES_PER_S    1.4e9  // O_DIRECT reads
#define ZIPMOE_DECODE_BYTES_PER_S  3.2e9  // decode + recover, BF16 output bytes per thread
#define ZIPMOE_COMPUTE_BYTES_PER_S 1.0e10 // expert products, BF16 weight bytes per token
// first writes of anonymous memory per thread: 0.8-2.0 GB/s in 4 KiB pages on the bench VM, and ~1.9 in
// a migration's new slots. Not measured: the stores'
// populate, the one timed first write, ran at 0.6 GB/s beside the load's threads
#define ZIPMOE_TOUCH_BYTES_PER_S   1.5e9

double ggml_zipmoe_default_rate(int rate) {
    switch (rate) {
        case GGML_ZIPMOE_RATE_READ:    return ZIPMOE_READ_BYTES_PER_S;
        case GGML_ZIPMOE_RATE_DECODE:  return ZIPMOE_DECODE_BYTES_PER_S;
        case GGML_ZIPMOE_RATE_COMPUTE: return ZIPMOE_COMPUTE_BYTES_PER_S;
        case GGML_ZIPMOE_RATE_TOUCH:   return ZIPMOE_TOUCH_BYTES_PER_S;
        default:                       return 0.0;
    }
}

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
        memset(g->best->grid_share, 0, sizeof(g->best->grid_share));
        for (int i = 0; i < g->n_chosen; i++) {
            g->best->grid_share[g->chosen[i]] = g->share[i];
        }
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

// P(X_i = 1 | sum X = k) for independent X_i ~ Bernoulli(q_i), by prefix and suffix DPs truncated
// at k hits (tests/planner.py: conditional_inclusion_probabilities); work: 2 (n + 2) (k + 1) doubles
static void conditional_inclusion(const double * q, int32_t n, int32_t k, double * out, double * work) {
    const size_t H = (size_t) k + 1;
    double * prefix = work;                        // prefix[i][h]: h hits among the first i
    double * suffix = work + (size_t) (n + 1) * H; // suffix[i][h]: h hits among i .. n-1
    memset(work, 0, sizeof(double) * 2 * (size_t) (n + 2) * H);
    prefix[0] = 1.0;
    suffix[(size_t) n * H] = 1.0;
    for (int32_t i = 0; i < n; i++) {
        const double * a = prefix + (size_t) i * H;
        double *       b = prefix + (size_t) (i + 1) * H;
        b[0] = a[0] * (1.0 - q[i]);
        for (size_t h = 1; h < H; h++) {
            b[h] = a[h] * (1.0 - q[i]) + a[h - 1] * q[i];
        }
    }
    for (int32_t i = n - 1; i >= 0; i--) {
        const double * a = suffix + (size_t) (i + 1) * H;
        double *       b = suffix + (size_t) i * H;
        b[0] = a[0] * (1.0 - q[i]);
        for (size_t h = 1; h < H; h++) {
            b[h] = a[h] * (1.0 - q[i]) + a[h - 1] * q[i];
        }
    }
    const double total = prefix[(size_t) n * H + k];
    for (int32_t i = 0; i < n; i++) {
        double others = 0.0; // k - 1 hits among the others of i
        for (int32_t a = 0; a < k; a++) {
            others += prefix[(size_t) i * H + a] * suffix[(size_t) (i + 1) * H + (k - 1 - a)];
        }
        out[i] = q[i] * others / total;
    }
}

// q_i = 1 / (1 + exp(-(log_w_i + shift))) with the shift making sum q == k (safeguarded Newton)
static void normalized_selection(const double * log_w, int32_t n, int32_t k, double * q) {
    double lo = 0, hi = 0, wmax = log_w[0], wmin = log_w[0];
    for (int32_t i = 1; i < n; i++) {
        wmax = log_w[i] > wmax ? log_w[i] : wmax;
        wmin = log_w[i] < wmin ? log_w[i] : wmin;
    }
    const double logit_mean = log((double) k / (n - k));
    lo = logit_mean - wmax;
    hi = logit_mean - wmin;
    double shift = 0.5 * (lo + hi);
    for (int it = 0; it < 200; it++) {
        double value = -k, slope = 0;
        for (int32_t i = 0; i < n; i++) {
            const double qi = 1.0 / (1.0 + exp(-(log_w[i] + shift)));
            value += qi;
            slope += qi * (1.0 - qi);
        }
        if (fabs(value) <= 1e-12 * k || hi - lo <= 1e-15 * (fabs(shift) > 1 ? fabs(shift) : 1)) {
            break;
        }
        if (value > 0) {
            hi = shift;
        } else {
            lo = shift;
        }
        const double step = slope > 0 ? shift - value / slope : NAN;
        shift = step > lo && step < hi ? step : 0.5 * (lo + hi);
    }
    for (int32_t i = 0; i < n; i++) {
        q[i] = 1.0 / (1.0 + exp(-(log_w[i] + shift)));
    }
}

// log of Binomial(trials, p)'s probability of x
static double log_binomial_pmf(double trials, double x, double p) {
    return lgamma(trials + 1) - lgamma(x + 1) - lgamma(trials - x + 1) + x * log(p) + (trials - x) * log1p(-p);
}

int ggml_zipmoe_plan_rank_bias(uint64_t n_steps, int32_t n, int32_t k, double * bias) {
    if (n_steps == 0 || n < 1 || k < 1 || k > n || bias == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const double p = (double) k / n, T = (double) n_steps;
    if (k == n) {
        for (int32_t r = 0; r < n; r++) {
            bias[r] = 0.0; // every expert every step
        }
        return GGML_ZIPMOE_OK;
    }
    // E[X_(r)] = sum over x >= 1 of P(at least r + 1 counts >= x); below lo every count is >= x
    // (to 1e-15), above hi none is, so only x in [lo, hi] is summed
    const double sd = sqrt(T * p * (1 - p));
    const double lo = fmax(1.0, floor(T * p - 9 * sd - 1)), hi = fmin(T, ceil(T * p + 9 * sd + 1));
    double * tail_n = (double *) malloc(sizeof(double) * (size_t) (n + 1));
    if (tail_n == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    for (int32_t r = 0; r < n; r++) {
        bias[r] = lo - 1; // x = 1 .. lo - 1
    }
    double q = 0.0; // P(count >= x), summed from the top (the mass above hi is negligible)
    for (double x = hi; x >= lo; x--) {
        q += exp(log_binomial_pmf(T, x, p));
        const double qx = fmin(q, 1.0);
        // P(at least m of the n counts are >= x), m = n .. 1
        double above = 0.0;
        for (int32_t m = n; m >= 1; m--) {
            above += qx <= 0.0 ? 0.0 : qx >= 1.0 ? (m == n) : exp(log_binomial_pmf(n, m, qx));
            tail_n[m] = fmin(above, 1.0);
        }
        for (int32_t r = 0; r < n; r++) {
            bias[r] += tail_n[r + 1];
        }
    }
    free(tail_n);
    for (int32_t r = 0; r < n; r++) {
        bias[r] = bias[r] / T - p;
    }
    return GGML_ZIPMOE_OK;
}

static int descending_doubles(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? 1 : x > y ? -1 : 0;
}

int ggml_zipmoe_plan_debias_profile(uint64_t n_steps, int32_t n, int32_t k, double * f) {
    if (f == NULL || n < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    double * bias = (double *) malloc(sizeof(double) * (size_t) n);
    if (bias == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    const int rc = ggml_zipmoe_plan_rank_bias(n_steps, n, k, bias);
    if (rc != GGML_ZIPMOE_OK) {
        free(bias);
        return rc;
    }
    qsort(f, (size_t) n, sizeof(double), descending_doubles);
    double sum = 0.0, kept = 0.0;
    for (int32_t r = 0; r < n; r++) {
        sum += f[r];
        f[r] = fmax(0.0, f[r] - bias[r]);
        kept += f[r];
    }
    for (int32_t r = 0; r < n && kept > 0; r++) {
        f[r] *= sum / kept; // the same total: k per step
    }
    qsort(f, (size_t) n, sizeof(double), descending_doubles);
    free(bias);
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_plan_fit(const double * f, int32_t n, int32_t k, double * q) {
    if (f == NULL || q == NULL || n < 1 || k < 1 || k > n) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    double sum = 0;
    int32_t always = 0, n_free = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!(f[i] >= 0.0 && f[i] <= 1.0)) {
            return GGML_ZIPMOE_ERR_ARG;
        }
        sum += f[i];
        always += f[i] == 1.0;
        n_free += f[i] > 0.0 && f[i] < 1.0;
    }
    if (fabs(sum - k) > 1e-8 * k) {
        return GGML_ZIPMOE_ERR_ARG; // every selection has exactly k experts
    }
    const int32_t k_free = k - always;
    for (int32_t i = 0; i < n; i++) {
        q[i] = f[i] == 1.0 ? 1.0 : 0.0;
    }
    if (n_free == 0) {
        return GGML_ZIPMOE_OK;
    }
    if (k_free <= 0 || k_free >= n_free) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    double * target = (double *) malloc(sizeof(double) * (size_t) n_free * 4);
    double * work   = (double *) malloc(sizeof(double) * 2 * (size_t) (n_free + 2) * (size_t) (k_free + 1));
    int status = target != NULL && work != NULL ? GGML_ZIPMOE_ERR_ARG : GGML_ZIPMOE_ERR_NOMEM;
    if (status == GGML_ZIPMOE_ERR_ARG) {
        double * log_w = target + n_free, * qf = target + 2 * (size_t) n_free, * fitted = target + 3 * (size_t) n_free;
        double free_sum = 0;
        for (int32_t i = 0, j = 0; i < n; i++) {
            if (f[i] > 0.0 && f[i] < 1.0) {
                target[j++] = f[i];
                free_sum += f[i];
            }
        }
        int ok = 1;
        for (int32_t j = 0; j < n_free; j++) {
            target[j] *= k_free / free_sum; // consistent targets: the free ones carry k_free
            ok &= target[j] < 1.0;
            log_w[j] = log(target[j]); // w(0) = f
        }
        for (int it = 0; ok && it <= 100000; it++) {
            normalized_selection(log_w, n_free, k_free, qf);
            conditional_inclusion(qf, n_free, k_free, fitted, work);
            double error = 0;
            for (int32_t j = 0; j < n_free; j++) {
                const double e = fabs(fitted[j] - target[j]);
                error = e > error ? e : error;
            }
            if (error <= 1e-10) {
                for (int32_t i = 0, j = 0; i < n; i++) {
                    if (f[i] > 0.0 && f[i] < 1.0) {
                        q[i] = qf[j++];
                    }
                }
                status = GGML_ZIPMOE_OK;
                break;
            }
            for (int32_t j = 0; j < n_free; j++) {
                log_w[j] += log(target[j]) - log(fitted[j]);
            }
        }
    }
    free(target);
    free(work);
    return status;
}

// Algorithm 2's table for p's selection probabilities (p->q, or uniform k / N); NULL when out of memory
static double * selection_table(const struct ggml_zipmoe_plan_params * p) {
    double * q = (double *) malloc(sizeof(double) * (size_t) p->n_expert);
    if (q == NULL) {
        return NULL;
    }
    for (int32_t r = 0; r < p->n_expert; r++) {
        q[r] = p->q != NULL ? p->q[r] : (double) p->k / p->n_expert;
    }
    double * phi = interval_hits(q, p->n_expert, p->k);
    free(q);
    return phi;
}

// the expected makespan of given per-layer capacities (packed in hierarchy order) under p's q and costs
int zipmoe_plan_evaluate(const struct ggml_zipmoe_plan_params * p, const int32_t capacity[4], double * makespan_s) {
    double * phi = selection_table(p);
    if (phi == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    *makespan_s = expected_makespan(p, phi, capacity);
    free(phi);
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_plan_pools(const struct ggml_zipmoe_plan_params * p, struct ggml_zipmoe_plan_result * out) {
    if (out == NULL || bad_params(p)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    memset(out, 0, sizeof(*out));
    double * phi = selection_table(p);
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
