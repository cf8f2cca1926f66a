// BuddyMoE (opt-in, lossy): a chosen expert that is not resident is replaced with a resident expert
// that often co-activates with it (its "buddy", from an offline profile), behind the paper's gates:
// the token's routing entropy (TAE), the batch's share of missing experts and a per-token budget.
// Also the routing trace that such profiles are made from (zipmoe-buddies).

#include "lossy/zipmoe-lossy-impl.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct ggml_zipmoe_buddy_params ggml_zipmoe_buddy_default_params(void) {
    struct ggml_zipmoe_buddy_params p = { -1.0f, 1.0f, 1.0f, 1.0f, 3, 16, 0.0f };
    return p;
}

static int valid_params(const struct ggml_zipmoe_buddy_params * p) {
    return p != NULL && p->tau <= 1.0f && p->tau == p->tau && p->temperature > 0.0f && p->gamma >= 0.0f &&
           p->beta >= 0.0f && p->beta <= 1.0f && p->rho >= 0 && p->search >= 0 && p->eta >= 0.0f;
}

// the chosen experts' scores as the gates see them: p^(1/T) renormalized over the chosen (NaN and
// negative scores count as 0); false if they sum to 0
static int renormalized(const float * s, int64_t n, float temperature, double * w) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        const double v = s[i] == s[i] && s[i] > 0 ? pow((double) s[i], 1.0 / (double) temperature) : 0.0;
        w[i] = v;
        sum += v;
    }
    if (!(sum > 0)) {
        return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        w[i] /= sum;
    }
    return 1;
}

static double tae_of(const double * w, int64_t n) {
    if (n < 2) {
        return 0.0;
    }
    double h = 0;
    for (int64_t i = 0; i < n; i++) {
        h -= w[i] > 0 ? w[i] * log(w[i]) : 0.0;
    }
    const double t = h / log((double) n);
    return t < 0 ? 0 : t > 1 ? 1 : t;
}

float ggml_zipmoe_buddy_tae(const float * chosen_scores, int64_t n_used, float temperature) {
    double w[64];
    if (chosen_scores == NULL || n_used < 1 || n_used > 64 || !(temperature > 0) ||
        !renormalized(chosen_scores, n_used, temperature, w)) {
        return 0.0f;
    }
    return (float) tae_of(w, n_used);
}

// the arguments of ggml_zipmoe_buddy_route are usable (the buddy lists' entries too)
static bool route_args_ok(const float * scores, int64_t n_expert, int64_t scores_stride, const int32_t * ids,
                          int64_t n_used, int64_t n_tokens, int64_t ids_stride, const uint8_t * resident,
                          const int32_t * buddies, const float * q, int32_t k_max,
                          const struct ggml_zipmoe_buddy_params * p, const int32_t * out) {
    return !(scores == NULL || ids == NULL || out == NULL || resident == NULL || n_expert < 1 || n_used < 1 ||
             n_used > 64 || n_tokens < 0 || scores_stride < n_expert || ids_stride < n_used || !valid_params(p) ||
             (out == ids && ids_stride != n_used) || k_max < 0 || (k_max > 0 && (buddies == NULL || q == NULL)));
}

// the distribution gate (eq. 2): the batch's share of distinct requested experts not resident is below
// beta (and some are missing); requested[n_expert] is zeroed scratch
static bool batch_gate_open(const int32_t * out, int64_t n, const uint8_t * resident, uint8_t * requested,
                            float beta) {
    int64_t n_req = 0, n_missing = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t e = out[i];
        if (!requested[e]) {
            requested[e] = 1;
            n_req++;
            n_missing += !resident[e];
        }
    }
    return n_missing > 0 && (double) n_missing / (double) n_req < (double) beta;
}

// the token's gates: its renormalized weights' TAE (eq. 1) above gate_tau, and no clear first choice
// (the margin gate: first less second under gamma)
static bool token_gates_open(const float * s, const int32_t * row, int64_t n_used,
                             const struct ggml_zipmoe_buddy_params * p, float gate_tau) {
    float  chosen[64];
    double w[64];
    for (int64_t i = 0; i < n_used; i++) {
        chosen[i] = s[row[i]];
    }
    if (!renormalized(chosen, n_used, p->temperature, w)) {
        return false;
    }
    if (!(tae_of(w, n_used) > gate_tau)) {
        return false;
    }
    double first = 0, second = 0;
    for (int64_t i = 0; i < n_used; i++) {
        if (w[i] > first) {
            second = first;
            first  = w[i];
        } else if (w[i] > second) {
            second = w[i];
        }
    }
    return !(n_used > 1 && first - second >= (double) p->gamma);
}

// local compatibility (eq. 3): the token's log scores into logs[n_expert], their mean and standard
// deviation (1 where they do not vary)
static void standardized_logs(const float * s, int64_t n_expert, double * logs, double * mean, double * sd) {
    double m = 0, var = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        logs[e] = log(s[e] == s[e] && s[e] > 0 ? (double) s[e] : 1e-30);
        m += logs[e];
    }
    m /= (double) n_expert;
    for (int64_t e = 0; e < n_expert; e++) {
        var += (logs[e] - m) * (logs[e] - m);
    }
    var /= (double) n_expert;
    *mean = m;
    *sd   = var > 0 ? sqrt(var) : 1.0;
}

// the token's scores, standardized (standardized_logs; with eta 0 none are read)
struct token_logs {
    const double * logs;
    double         mean, sd;
};

// the buddy of expert e to take: resident and not in the token, the first of its list with eta 0, else the
// best by psi (q weighted by the buddy's standardized score) among its first `search`; -1 if none
static int32_t pick_buddy(int32_t e, const int32_t * buddies, const float * q, int32_t k_max,
                          const struct ggml_zipmoe_buddy_params * p, const uint8_t * resident, const uint8_t * in_token,
                          const struct token_logs * tl) {
    int32_t best = -1;
    double  best_psi = -INFINITY;
    const int32_t h = p->search < k_max ? p->search : k_max;
    for (int32_t r = 0; r < h; r++) {
        const int32_t b = buddies[(int64_t) e * k_max + r];
        if (b < 0) {
            break;
        }
        if (!resident[b] || in_token[b]) {
            continue;
        }
        if (p->eta == 0) {
            return b; // Alg. 1: the first suitable buddy in the list's order
        }
        const double psi = (double) q[(int64_t) e * k_max + r] * (1.0 + p->eta * (tl->logs[b] - tl->mean) / tl->sd);
        if (psi > best_psi) {
            best_psi = psi;
            best     = b;
        }
    }
    return best;
}

// one token's row: up to rho of its experts not resident replaced by buddies; the experts replaced.
// in_token[n_expert] is zeroed scratch, zeroed again on return (ids_row: the token's original ids)
static int32_t replace_in_token(int32_t * row, const int32_t * ids_row, int64_t n_used, const int32_t * buddies,
                                const float * q, int32_t k_max, const struct ggml_zipmoe_buddy_params * p,
                                const uint8_t * resident, uint8_t * in_token, const struct token_logs * tl) {
    for (int64_t i = 0; i < n_used; i++) {
        in_token[row[i]] = 1;
    }
    int32_t done = 0;
    for (int64_t i = 0; i < n_used && done < p->rho; i++) {
        const int32_t e = row[i];
        if (resident[e]) {
            continue;
        }
        const int32_t best = pick_buddy(e, buddies, q, k_max, p, resident, in_token, tl);
        if (best >= 0) {
            row[i] = best;
            in_token[best] = 1; // no duplicate buddy within a token
            done++;
        }
    }
    for (int64_t i = 0; i < n_used; i++) {
        in_token[row[i]] = 0;
        in_token[ids_row[i]] = 0;
    }
    return done;
}

int ggml_zipmoe_buddy_route(const float * scores, int64_t n_expert, int64_t scores_stride, const int32_t * ids,
                            int64_t n_used, int64_t n_tokens, int64_t ids_stride, const uint8_t * resident,
                            const int32_t * buddies, const float * q, int32_t k_max, float tau,
                            const struct ggml_zipmoe_buddy_params * p, int32_t * out, int64_t * n_replaced) {
    if (n_replaced != NULL) {
        *n_replaced = 0;
    }
    if (!route_args_ok(scores, n_expert, scores_stride, ids, n_used, n_tokens, ids_stride, resident, buddies, q,
                       k_max, p, out)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (!zipmoe_copy_ids(ids, n_used, n_tokens, ids_stride, n_expert, out)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    for (int64_t i = 0; i < (int64_t) n_expert * k_max; i++) {
        if (buddies[i] < -1 || buddies[i] >= n_expert) {
            return GGML_ZIPMOE_ERR_ARG;
        }
    }
    if (p->rho == 0 || p->search == 0 || k_max == 0 || n_tokens == 0) {
        return GGML_ZIPMOE_OK;
    }
    const float gate_tau = p->tau >= 0 ? p->tau : tau;

    uint8_t * requested = calloc((size_t) n_expert, 1);
    uint8_t * in_token  = calloc((size_t) n_expert, 1);
    double *  logs      = malloc(sizeof(double) * (size_t) n_expert);
    if (!requested || !in_token || !logs) {
        free(requested);
        free(in_token);
        free(logs);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    int64_t replaced = 0;
    if (batch_gate_open(out, n_tokens * n_used, resident, requested, p->beta)) {
        for (int64_t t = 0; t < n_tokens; t++) {
            const float * s   = scores + t * scores_stride;
            int32_t *     row = out + t * n_used;
            if (!token_gates_open(s, row, n_used, p, gate_tau)) {
                continue;
            }
            struct token_logs tl = { logs, 0, 1.0 };
            if (p->eta > 0) {
                standardized_logs(s, n_expert, logs, &tl.mean, &tl.sd);
            }
            replaced += replace_in_token(row, ids + t * ids_stride, n_used, buddies, q, k_max, p, resident, in_token,
                                         &tl);
        }
    }
    free(requested);
    free(in_token);
    free(logs);
    if (n_replaced != NULL) {
        *n_replaced = replaced;
    }
    return GGML_ZIPMOE_OK;
}

//
// the policy's profiles and trace
//

static void free_trace(struct zipmoe_buddy_layer * l) {
    free(l->activations);
    free(l->coact);
    free(l->coact_weighted);
    free(l->tae_hist);
    l->activations = l->coact = l->coact_weighted = NULL;
    l->tae_hist = NULL;
    l->n_tokens = 0;
}

void zipmoe_buddy_free_layers(struct zipmoe_substitution * s) {
    if (s->layers != NULL) {
        for (int l = 0; l < s->n_layer; l++) {
            free(s->layers[l].buddies);
            free(s->layers[l].q);
            free_trace(&s->layers[l]);
        }
        free(s->layers);
        s->layers = NULL;
    }
}

// under buddy_lock
static struct zipmoe_buddy_layer * layer_state(struct zipmoe_substitution * s, int layer) {
    if (s->layers == NULL) {
        s->layers = calloc((size_t) (s->n_layer > 0 ? s->n_layer : 1), sizeof(*s->layers));
    }
    return s->layers != NULL ? &s->layers[layer] : NULL;
}

int zipmoe_substitution_set_buddies(struct zipmoe_substitution * s, int layer, const int32_t * buddies, const float * q,
                                  int32_t k_max, float tau) {
    if (s == NULL || !zipmoe_substitution_has_layer(s, layer) || k_max < 1 || buddies == NULL || q == NULL ||
        !(tau >= 0.0f && tau <= 1.0f)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int32_t n_expert = s->layer_n_expert[layer];
    const size_t  n        = (size_t) n_expert * (size_t) k_max;
    for (size_t i = 0; i < n; i++) {
        if (buddies[i] < -1 || buddies[i] >= n_expert || buddies[i] == (int32_t) (i / (size_t) k_max) ||
            !(q[i] >= 0.0f && q[i] <= 1.0f)) {
            return GGML_ZIPMOE_ERR_ARG;
        }
    }
    int32_t * b2 = malloc(n * sizeof(int32_t));
    float *   q2 = malloc(n * sizeof(float));
    if (b2 == NULL || q2 == NULL) {
        free(b2);
        free(q2);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    memcpy(b2, buddies, n * sizeof(int32_t));
    memcpy(q2, q, n * sizeof(float));
    pthread_mutex_lock(&s->buddy_lock);
    struct zipmoe_buddy_layer * l = layer_state(s, layer);
    if (l == NULL) {
        pthread_mutex_unlock(&s->buddy_lock);
        free(b2);
        free(q2);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    free(l->buddies);
    free(l->q);
    l->buddies = b2;
    l->q       = q2;
    l->k_max   = k_max;
    l->tau     = tau;
    pthread_mutex_unlock(&s->buddy_lock);
    return GGML_ZIPMOE_OK;
}

int zipmoe_substitution_set_buddy_params(struct zipmoe_substitution * s, const struct ggml_zipmoe_buddy_params * p) {
    if (s == NULL || !valid_params(p)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->buddy_lock);
    s->buddy = *p;
    pthread_mutex_unlock(&s->buddy_lock);
    return GGML_ZIPMOE_OK;
}

int zipmoe_buddy_substitute(struct zipmoe_substitution * s, int layer, const float * scores, int64_t scores_stride,
                            const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride,
                            const uint8_t * resident, int32_t * out, int64_t * n_replaced) {
    const int64_t n_expert = s->layer_n_expert[layer];
    pthread_mutex_lock(&s->buddy_lock);
    const struct zipmoe_buddy_layer * l = s->layers != NULL ? &s->layers[layer] : NULL;
    const int has = l != NULL && l->buddies != NULL;
    const int status = ggml_zipmoe_buddy_route(scores, n_expert, scores_stride, ids, n_used, n_tokens, ids_stride,
                                               resident, has ? l->buddies : NULL, has ? l->q : NULL,
                                               has ? l->k_max : 0, has ? l->tau : 1.0f, &s->buddy, out,
                                               n_replaced);
    pthread_mutex_unlock(&s->buddy_lock);
    return status;
}

int zipmoe_substitution_trace(struct zipmoe_substitution * s, int on, float temperature, int64_t warmup) {
    if (s == NULL || !(temperature > 0) || warmup < 0) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->buddy_lock);
    int status = GGML_ZIPMOE_OK;
    if (layer_state(s, 0) == NULL) {
        status = GGML_ZIPMOE_ERR_NOMEM;
    } else {
        for (int l = 0; l < s->n_layer; l++) {
            free_trace(&s->layers[l]);
        }
        s->trace             = on != 0;
        s->trace_temperature = temperature;
        s->trace_warmup      = warmup;
    }
    pthread_mutex_unlock(&s->buddy_lock);
    return status;
}

void zipmoe_buddy_trace(struct zipmoe_substitution * s, int layer, const float * scores, int64_t scores_stride,
                        const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride) {
    const int64_t n_expert = s->layer_n_expert[layer];
    if (n_used > 64) {
        return;
    }
    pthread_mutex_lock(&s->buddy_lock);
    struct zipmoe_buddy_layer * l = s->trace ? layer_state(s, layer) : NULL;
    if (l != NULL && l->activations == NULL) {
        l->activations    = calloc((size_t) n_expert, sizeof(double));
        l->coact          = calloc((size_t) (n_expert * n_expert), sizeof(double));
        l->coact_weighted = calloc((size_t) (n_expert * n_expert), sizeof(double));
        l->tae_hist       = calloc(GGML_ZIPMOE_TAE_BINS, sizeof(uint64_t));
        if (!l->activations || !l->coact || !l->coact_weighted || !l->tae_hist) {
            free_trace(l); // a trace that cannot be kept records nothing; the profile says 0 tokens
            l = NULL;
        }
    }
    for (int64_t t = 0; l != NULL && t < n_tokens; t++) {
        const int32_t * row = ids + t * ids_stride;
        const float *   row_scores = scores + t * scores_stride;
        float  chosen[64];
        double w[64];
        int ok = 1;
        for (int64_t i = 0; i < n_used; i++) {
            ok &= row[i] >= 0 && row[i] < n_expert;
            chosen[i] = ok ? row_scores[row[i]] : 0.0f;
        }
        if (!ok) {
            continue;
        }
        const double weight = s->trace_warmup > 0 && (int64_t) l->n_tokens < s->trace_warmup
                                  ? (double) (l->n_tokens + 1) / (double) s->trace_warmup : 1.0;
        if (renormalized(chosen, n_used, s->trace_temperature, w)) {
            const double tae = tae_of(w, n_used);
            int bin = (int) (tae * GGML_ZIPMOE_TAE_BINS);
            l->tae_hist[bin < GGML_ZIPMOE_TAE_BINS ? bin : GGML_ZIPMOE_TAE_BINS - 1]++;
        } else {
            memset(w, 0, sizeof(w));
        }
        // the weights renormalized at T = 1 (BuddyMoE 3.3's probability weighting)
        double p1[64];
        if (!renormalized(chosen, n_used, 1.0f, p1)) {
            memset(p1, 0, sizeof(p1));
        }
        for (int64_t i = 0; i < n_used; i++) {
            l->activations[row[i]] += weight;
            for (int64_t j = 0; j < n_used; j++) {
                if (j != i && row[j] != row[i]) {
                    const int64_t k = (int64_t) row[i] * n_expert + row[j];
                    l->coact[k]          += weight;
                    l->coact_weighted[k] += weight * (p1[i] < p1[j] ? p1[i] : p1[j]);
                }
            }
        }
        l->n_tokens++;
    }
    pthread_mutex_unlock(&s->buddy_lock);
}

int zipmoe_substitution_get_trace(struct zipmoe_substitution * s, int layer, double * activations, double * coact,
                                  double * coact_weighted, uint64_t * tae_hist, uint64_t * n_tokens) {
    if (s == NULL || !zipmoe_substitution_has_layer(s, layer)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const size_t n = (size_t) s->layer_n_expert[layer];
    pthread_mutex_lock(&s->buddy_lock);
    const struct zipmoe_buddy_layer * l = s->layers != NULL ? &s->layers[layer] : NULL;
    const int has = l != NULL && l->activations != NULL;
    if (activations) {
        has ? memcpy(activations, l->activations, n * sizeof(double)) : memset(activations, 0, n * sizeof(double));
    }
    if (coact) {
        has ? memcpy(coact, l->coact, n * n * sizeof(double)) : memset(coact, 0, n * n * sizeof(double));
    }
    if (coact_weighted) {
        has ? memcpy(coact_weighted, l->coact_weighted, n * n * sizeof(double))
            : memset(coact_weighted, 0, n * n * sizeof(double));
    }
    if (tae_hist) {
        has ? memcpy(tae_hist, l->tae_hist, GGML_ZIPMOE_TAE_BINS * sizeof(uint64_t))
            : memset(tae_hist, 0, GGML_ZIPMOE_TAE_BINS * sizeof(uint64_t));
    }
    if (n_tokens) {
        *n_tokens = has ? l->n_tokens : 0;
    }
    pthread_mutex_unlock(&s->buddy_lock);
    return GGML_ZIPMOE_OK;
}
