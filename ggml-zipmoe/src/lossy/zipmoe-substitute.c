// Expert substitution (opt-in, lossy): a policy replaces some of the experts a router chose with
// experts already resident, before the layer's fetch plans its reads. Here the policy object the
// cache calls (lossy/zipmoe-substitution.h) and SMoE's expert-cache router (SMoE Alg. 1, with the
// batch-aware choice of its 5.4); BuddyMoE is in zipmoe-buddy.c.

#include "lossy/zipmoe-lossy-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// the (k+1)-th largest of a token's n scores (k < n); NaN scores are taken as -inf
static double kth_plus_one(const float * s, int64_t n, int64_t k, double * best) {
    int64_t filled = 0; // best[0..filled): the largest seen so far, descending
    for (int64_t e = 0; e < n; e++) {
        const double v = s[e] == s[e] ? (double) s[e] : -INFINITY;
        if (filled == k + 1 && v <= best[k]) {
            continue;
        }
        int64_t i = filled < k + 1 ? filled++ : k;
        while (i > 0 && best[i - 1] < v) {
            best[i] = best[i - 1];
            i--;
        }
        best[i] = v;
    }
    return best[k];
}

struct smoe_candidate {
    int32_t expert;
    int32_t position; // in the token's selections (replaceable ones), or -1
    int32_t users;    // tokens of the batch that chose it
    float   score;
};

// alternatives: the best first (batch-aware: more users first; then the higher score, the lower id)
static int better_alternative(const void * a, const void * b) {
    const struct smoe_candidate * x = a;
    const struct smoe_candidate * y = b;
    if (x->users != y->users) {
        return x->users > y->users ? -1 : 1;
    }
    if (x->score != y->score) {
        return x->score > y->score ? -1 : 1;
    }
    return x->expert < y->expert ? -1 : x->expert > y->expert;
}

// replaceable experts: the lowest score first (ties: the later position)
static int lower_replaceable(const void * a, const void * b) {
    const struct smoe_candidate * x = a;
    const struct smoe_candidate * y = b;
    if (x->score != y->score) {
        return x->score < y->score ? -1 : 1;
    }
    return x->position > y->position ? -1 : x->position < y->position;
}

int zipmoe_copy_ids(const int32_t * ids, int64_t n_used, int64_t n_tokens, int64_t ids_stride, int64_t n_expert,
                    int32_t * out) {
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) {
            const int32_t e = ids[t * ids_stride + i];
            if (e < 0 || e >= n_expert) {
                return 0;
            }
            out[t * n_used + i] = e; // ids may be out itself: row t is read before row t is written
        }
    }
    return 1;
}

// a route's working memory: per token its (k+1)-th score (beta), per expert the top-score set C, the
// batch's users and this token's choices, the candidates of one token
struct smoe_scratch {
    double *                best;   // [n_used + 1] kth_plus_one's
    double *                beta;   // [n_tokens]
    uint8_t *               top;    // [n_expert]
    int32_t *               users;  // [n_expert]
    uint8_t *               chosen; // [n_expert]
    struct smoe_candidate * alt;    // [n_expert]
    struct smoe_candidate * low;    // [n_used]
};

static void smoe_scratch_free(struct smoe_scratch * w) {
    free(w->best);
    free(w->beta);
    free(w->top);
    free(w->users);
    free(w->chosen);
    free(w->alt);
    free(w->low);
}

static int smoe_scratch_new(struct smoe_scratch * w, int64_t n_expert, int64_t n_used, int64_t n_tokens) {
    w->best   = malloc(sizeof(double) * (size_t) (n_used + 1));
    w->beta   = malloc(sizeof(double) * (size_t) n_tokens);
    w->top    = calloc((size_t) n_expert, 1);
    w->users  = calloc((size_t) n_expert, sizeof(int32_t));
    w->chosen = calloc((size_t) n_expert, 1);
    w->alt    = malloc(sizeof(*w->alt) * (size_t) n_expert);
    w->low    = malloc(sizeof(*w->low) * (size_t) n_used);
    if (!w->best || !w->beta || !w->top || !w->users || !w->chosen || !w->alt || !w->low) {
        smoe_scratch_free(w);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    return GGML_ZIPMOE_OK;
}

// the top-score set C over the batch (a score above (1 + alpha) beta), and how many tokens chose each expert
static void batch_top_set(const float * scores, int64_t n_expert, int64_t scores_stride, const int32_t * out,
                          int64_t n_used, int64_t n_tokens, float alpha, struct smoe_scratch * w) {
    for (int64_t t = 0; t < n_tokens; t++) {
        const float * s = scores + t * scores_stride;
        w->beta[t] = kth_plus_one(s, n_expert, n_used, w->best);
        const double top_above = (1.0 + (double) alpha) * w->beta[t];
        for (int64_t i = 0; i < n_used; i++) {
            const int32_t e = out[t * n_used + i];
            w->users[e]++;
            if ((double) s[e] > top_above) {
                w->top[e] = 1;
            }
        }
    }
}

// one token's row (scores s, beta its (k+1)-th): its low-score experts replaced by the best alternatives
// in [(1 - alpha) beta, beta), as many as both have; the experts replaced
static int32_t replace_in_row(const float * s, int32_t * row, int64_t n_expert, int64_t n_used, double beta,
                              float alpha, const uint8_t * resident, int batch_aware, struct smoe_scratch * w) {
    const double top_above = (1.0 + (double) alpha) * beta;
    const double alt_from  = (1.0 - (double) alpha) * beta;
    int32_t n_low = 0, n_alt = 0;
    for (int64_t i = 0; i < n_used; i++) {
        const int32_t e = row[i];
        w->chosen[e] = 1;
        // low-score, not resident and not wanted by the batch anyway: may be replaced
        if (!((double) s[e] > top_above) && !resident[e] && !w->top[e]) {
            w->low[n_low++] = (struct smoe_candidate) { e, (int32_t) i, 0, s[e] };
        }
    }
    if (n_low > 0) {
        for (int32_t e = 0; e < n_expert; e++) {
            const double v = (double) s[e];
            // users counts this token's own choices, which chosen[] excludes here
            if (!w->chosen[e] && v >= alt_from && v < beta &&
                (resident[e] || w->top[e] || (batch_aware && w->users[e] > 0))) {
                w->alt[n_alt++] = (struct smoe_candidate) { e, -1, batch_aware ? w->users[e] : 0, s[e] };
            }
        }
    }
    for (int64_t i = 0; i < n_used; i++) {
        w->chosen[row[i]] = 0;
    }
    const int32_t n = n_low < n_alt ? n_low : n_alt;
    if (n == 0) {
        return 0;
    }
    qsort(w->alt, (size_t) n_alt, sizeof(*w->alt), better_alternative);
    qsort(w->low, (size_t) n_low, sizeof(*w->low), lower_replaceable);
    for (int32_t j = 0; j < n; j++) {
        row[w->low[j].position] = w->alt[j].expert;
    }
    return n;
}

int ggml_zipmoe_smoe_route(const float * scores, int64_t n_expert, int64_t scores_stride, const int32_t * ids,
                           int64_t n_used, int64_t n_tokens, int64_t ids_stride, const uint8_t * resident,
                           float alpha, int batch_aware, int32_t * out, int64_t * n_replaced) {
    if (n_replaced != NULL) {
        *n_replaced = 0;
    }
    if (scores == NULL || ids == NULL || out == NULL || resident == NULL || n_expert < 1 || n_used < 1 ||
        n_tokens < 0 || scores_stride < n_expert || ids_stride < n_used || !(alpha >= 0.0f && alpha <= 1.0f) ||
        (out == ids && ids_stride != n_used)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (!zipmoe_copy_ids(ids, n_used, n_tokens, ids_stride, n_expert, out)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (alpha == 0.0f || n_used >= n_expert || n_tokens == 0) {
        return GGML_ZIPMOE_OK; // no score lies in [beta, beta): nothing is replaced
    }
    struct smoe_scratch w;
    if (smoe_scratch_new(&w, n_expert, n_used, n_tokens) != GGML_ZIPMOE_OK) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    batch_top_set(scores, n_expert, scores_stride, out, n_used, n_tokens, alpha, &w);
    int64_t replaced = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        replaced += replace_in_row(scores + t * scores_stride, out + t * n_used, n_expert, n_used, w.beta[t], alpha,
                                   resident, batch_aware, &w);
    }
    if (n_replaced != NULL) {
        *n_replaced = replaced;
    }
    smoe_scratch_free(&w);
    return GGML_ZIPMOE_OK;
}

struct zipmoe_substitution * zipmoe_substitution_new(int n_layer, const int32_t * layer_n_expert) {
    struct zipmoe_substitution * s = calloc(1, sizeof(*s));
    int32_t * n_expert = malloc(sizeof(int32_t) * (size_t) (n_layer > 0 ? n_layer : 1));
    if (s == NULL || n_expert == NULL) {
        free(s);
        free(n_expert);
        return NULL;
    }
    memcpy(n_expert, layer_n_expert, sizeof(int32_t) * (size_t) (n_layer > 0 ? n_layer : 0));
    s->n_layer        = n_layer;
    s->layer_n_expert = n_expert;
    s->buddy          = ggml_zipmoe_buddy_default_params();
    atomic_init(&s->policy, GGML_ZIPMOE_SUBST_NONE);
    atomic_init(&s->alpha, 0.0f);
    atomic_init(&s->replaced, 0);
    atomic_init(&s->tokens, 0);
    pthread_mutex_init(&s->buddy_lock, NULL);
    return s;
}

void zipmoe_substitution_free(struct zipmoe_substitution * s) {
    if (s == NULL) {
        return;
    }
    zipmoe_buddy_free_layers(s);
    pthread_mutex_destroy(&s->buddy_lock);
    free(s->layer_n_expert);
    free(s);
}

int zipmoe_substitution_set(struct zipmoe_substitution * s, int policy, float alpha) {
    if (s == NULL || policy < 0 || policy >= GGML_ZIPMOE_SUBST_COUNT || !(alpha >= 0.0f && alpha <= 1.0f)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    atomic_store(&s->alpha, alpha);
    atomic_store(&s->policy, policy);
    return GGML_ZIPMOE_OK;
}

int zipmoe_substitution_policy(const struct zipmoe_substitution * s, float * alpha) {
    struct zipmoe_substitution * m = (struct zipmoe_substitution *) s; // atomics load from non-const
    if (alpha != NULL) {
        *alpha = atomic_load(&m->alpha);
    }
    return atomic_load(&m->policy);
}

int zipmoe_substitution_route(struct zipmoe_substitution * s, int layer, const float * scores, int64_t n_expert,
                              int64_t scores_stride, const int32_t * ids, int64_t n_used, int64_t n_tokens,
                              int64_t ids_stride, const uint8_t * resident, int32_t * out) {
    float alpha = 0.0f;
    const int policy = zipmoe_substitution_policy(s, &alpha);
    if (!zipmoe_substitution_has_layer(s, layer) || n_expert != s->layer_n_expert[layer] || scores == NULL ||
        ids == NULL || out == NULL || scores_stride < n_expert || ids_stride < n_used || n_used < 1 || n_tokens < 0 ||
        (resident == NULL && policy != GGML_ZIPMOE_SUBST_NONE) || (out == ids && ids_stride != n_used)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    zipmoe_buddy_trace(s, layer, scores, scores_stride, ids, n_used, n_tokens, ids_stride); // a no-op unless on
    if (policy == GGML_ZIPMOE_SUBST_NONE) {
        return zipmoe_copy_ids(ids, n_used, n_tokens, ids_stride, n_expert, out) ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_ARG;
    }
    int64_t replaced = 0;
    const int status = policy == GGML_ZIPMOE_SUBST_BUDDY
        ? zipmoe_buddy_substitute(s, layer, scores, scores_stride, ids, n_used, n_tokens, ids_stride, resident, out,
                                  &replaced)
        : ggml_zipmoe_smoe_route(scores, n_expert, scores_stride, ids, n_used, n_tokens, ids_stride, resident, alpha,
                                 1, out, &replaced);
    if (status == GGML_ZIPMOE_OK) {
        atomic_fetch_add(&s->replaced, (uint64_t) replaced);
        atomic_fetch_add(&s->tokens, (uint64_t) n_tokens);
    }
    return status;
}

void zipmoe_substitution_counts(const struct zipmoe_substitution * s, uint64_t * replaced, uint64_t * tokens) {
    struct zipmoe_substitution * m = (struct zipmoe_substitution *) s;
    *replaced = atomic_load(&m->replaced);
    *tokens   = atomic_load(&m->tokens);
}

void zipmoe_substitution_reset_counts(struct zipmoe_substitution * s) {
    atomic_store(&s->replaced, 0);
    atomic_store(&s->tokens, 0);
}
