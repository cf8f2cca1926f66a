// Serving, re-planning: the default pools planned again from the routing seen. After
// zipmoe.replan_tokens decode steps (ubatches of one token of each of their sequences: one sequence
// decoding, or several in parallel), the rank-based inclusion probabilities of those steps replace
// the planner's built-in uniform profile, planned for the experts a step selects (its union over
// the sequences, which a step of four sequences makes about 3.5 times one's on DeepSeek-V2-Lite).
// It plans again each time the steps counted double, from all of them. One sequence's first decode
// step after a prompt of zipmoe.replan_tokens tokens or more plans from its tokens, the prompt's
// included.

#include "serving/zipmoe-serving-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void zipmoe_routing_profile_free(struct zipmoe_routing_profile * r) {
    free(r->seen_counts);
    free(r->seen_ubatches);
    free(r->counts);
    free(r->ubatches);
    free(r->observed);
    free(r->half_counts);
    free(r->token_counts);
    free(r->half_n);
    free(r->token_ids);
    free(r->token_mult);
    memset(r, 0, sizeof(*r));
}

// the arrays, for the widest served layer; false if they cannot be made (no re-plan then)
static bool start_profile(struct ggml_zipmoe_serving * s) {
    struct zipmoe_routing_profile * r = &s->routing;
    const int n_layer = s->p.n_layer;
    int32_t n_expert = 0;
    for (int il = 0; il < n_layer; ++il) {
        n_expert = MAX(n_expert, ggml_zipmoe_cache_n_expert(s->cache, il));
    }
    const size_t cells = (size_t) n_layer * (size_t) MAX(n_expert, 1);
    r->seen_counts   = calloc(cells, sizeof(uint64_t));
    r->counts        = calloc(cells, sizeof(uint64_t));
    r->seen_ubatches = calloc((size_t) n_layer, sizeof(uint64_t));
    r->ubatches      = calloc((size_t) n_layer, sizeof(uint64_t));
    r->observed      = calloc((size_t) MAX(n_expert, 1), sizeof(double));
    r->half_counts   = calloc(2 * cells, sizeof(double));
    r->token_counts  = calloc(2 * cells, sizeof(double));
    r->half_n        = calloc(2 * (size_t) n_layer, sizeof(double));
    if (!r->half_n || !r->seen_counts || !r->counts || !r->seen_ubatches || !r->ubatches || !r->observed ||
        !r->half_counts || !r->token_counts) {
        zipmoe_routing_profile_free(r);
        r->replanned = true; // give up: the pools stay as planned
        return false;
    }
    r->n_expert = n_expert;
    return n_expert > 0;
}

// this graph's selections: counted if it was a decode step (n_tokens tokens of as many sequences) and
// every served layer ran it as one ubatch selecting at most n_expert_used experts per token. A prompt
// (several tokens of one sequence) or a ubatch mixing a prompt with decoding is not counted.
static bool count_step(struct ggml_zipmoe_serving * s, int32_t n_tokens, int32_t n_seqs) {
    struct zipmoe_routing_profile * r = &s->routing;
    const int32_t n_exp = r->n_expert;
    bool decode = n_tokens >= 1 && n_tokens == n_seqs, any = false;
    r->several_seqs |= n_seqs > 1;
    uint64_t selections = 0, layers = 0;
    for (int il = 0; il < s->p.n_layer; ++il) {
        if (!ggml_zipmoe_cache_has_layer(s->cache, il)) {
            continue;
        }
        uint64_t * counts = r->counts + (size_t) il * n_exp;
        const uint64_t * seen = r->seen_counts + (size_t) il * n_exp;
        ggml_zipmoe_cache_get_activations(s->cache, il, counts, &r->ubatches[il]);
        uint64_t selected = 0;
        for (int32_t e = 0; e < n_exp; ++e) {
            selected += counts[e] - seen[e];
        }
        const uint64_t steps = r->ubatches[il] - r->seen_ubatches[il];
        any |= steps > 0;
        decode &= steps == 1 && selected <= (uint64_t) MAX(n_tokens, 1) * (uint64_t) s->p.n_expert_used;
        selections += selected;
        layers++;
    }
    const bool counted = decode && any;
    if (counted) {
        const size_t cells = (size_t) s->p.n_layer * n_exp;
        double * half = r->half_counts + (r->token_steps % 2) * cells;
        for (size_t i = 0; i < cells; ++i) {
            half[i] += (double) (r->counts[i] - r->seen_counts[i]);
        }
        r->token_steps++;
        r->step_selections += selections;
        r->layer_steps += layers;
    }
    uint64_t * t = r->seen_counts;
    r->seen_counts = r->counts;
    r->counts = t;
    t = r->seen_ubatches;
    r->seen_ubatches = r->ubatches;
    r->ubatches = t;
    return counted;
}

// n_expert_used for one sequence, the union of their selections for several
int32_t zipmoe_routing_step_k(const struct ggml_zipmoe_serving * s) {
    const struct zipmoe_routing_profile * r = &s->routing;
    const double mean = r->layer_steps ? (double) r->step_selections / (double) r->layer_steps : 0;
    return MIN(MAX(s->p.n_expert_used, (int32_t) lround(mean)), MAX(r->n_expert, s->p.n_expert_used));
}

static int descending(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? 1 : x > y ? -1 : 0;
}

// the experts in descending order of by[] (ties in id order); n is small (a layer's experts)
static void rank_experts(const double * by, int32_t n, int32_t * order) {
    for (int32_t i = 0; i < n; ++i) {
        int32_t j = i;
        for (; j > 0 && by[order[j - 1]] < by[i]; --j) {
            order[j] = order[j - 1];
        }
        order[j] = i;
    }
}

// the selections a profile is made from, in two halves: [2][n_layer][n_expert] counts, the steps (or
// tokens) each layer ran in each half ([2][n_layer]), the experts each selects, and how much their
// repeated tokens inflate the counts' spread (1: independent draws)
struct routing_halves {
    const double * counts;
    const double * n;
    int32_t        k;
    double         design_effect;
};

// the decode steps' selections (their union over the sequences), even and odd steps apart
static struct routing_halves step_halves(struct ggml_zipmoe_serving * s) {
    struct zipmoe_routing_profile * r = &s->routing;
    for (int il = 0; il < s->p.n_layer; ++il) {
        r->half_n[il]                = (double) ((r->token_steps + 1) / 2);
        r->half_n[s->p.n_layer + il] = (double) (r->token_steps / 2);
    }
    return (struct routing_halves) { r->half_counts, r->half_n, zipmoe_routing_step_k(s), 1.0 };
}

// one sequence's tokens, its prompt's included, even and odd tokens apart (the cache's counts): a
// prompt's tokens choose their experts as its decode steps do, but they are no independent draws (a
// token repeated routes alike), so only the re-plan after a prompt plans from them. False if the
// cache's counts cannot be read.
static bool token_halves(struct ggml_zipmoe_serving * s, struct routing_halves * h) {
    struct zipmoe_routing_profile * r = &s->routing;
    const int32_t n_exp = r->n_expert;
    const size_t  cells = (size_t) s->p.n_layer * n_exp;
    const int     n_layer = s->p.n_layer;
    uint64_t * even = malloc(2 * sizeof(uint64_t) * (size_t) n_exp); // and the odd tokens' after them
    if (even == NULL) {
        return false;
    }
    for (int il = 0; il < s->p.n_layer; ++il) {
        if (!ggml_zipmoe_cache_has_layer(s->cache, il)) {
            continue;
        }
        uint64_t n = 0;
        if (ggml_zipmoe_cache_get_selections(s->cache, il, even, even + n_exp, &n) != GGML_ZIPMOE_OK) {
            free(even);
            return false;
        }
        for (int32_t e = 0; e < ggml_zipmoe_cache_n_expert(s->cache, il); ++e) {
            r->token_counts[(size_t) il * n_exp + e]         = (double) even[e];
            r->token_counts[cells + (size_t) il * n_exp + e] = (double) even[n_exp + e];
        }
        // a layer's own: the last runs a prompt's output tokens only (stock drops the others before its FFN)
        r->half_n[il]           = (double) ((n + 1) / 2);
        r->half_n[n_layer + il] = (double) (n / 2);
    }
    free(even);
    const double design_effect = r->token_n > 0 ? MAX(1.0, r->token_sum_sq / r->token_n) : 1.0;
    *h = (struct routing_halves) { r->token_counts, r->half_n, s->p.n_expert_used, design_effect };
    return true;
}

// the most tokens a served layer ran (the others run a prompt's every token; the last, its output's)
static double routed_tokens(const struct ggml_zipmoe_serving * s, const struct routing_halves * h) {
    double most = 0;
    for (int il = 0; il < s->p.n_layer; ++il) {
        most = MAX(most, h->n[il] + h->n[s->p.n_layer + il]);
    }
    return most;
}

// rank-based inclusion probabilities of the steps counted, averaged over the served layers and
// cross-fitted: each layer's experts ranked by the even steps' counts, each rank's probability read
// from the odd steps', and the other way round, the two averaged. Ranking and measuring on the same
// steps overstates the top ranks by chance (a uniform router's top expert of 16 steps looks twice as
// likely as the rest); taking a uniform router's expected excess off instead
// (ggml_zipmoe_plan_debias_profile, which zipmoe-plan applies to a profile's total counts) lifts the
// tail of a concentrated router: on the 8.1 GB Qwen model at half its size it put one F pool's misses
// at several times the run's, and the pools chosen over it decoded at 1.8 times its step.
// Cross-fitting assumes nothing of the router.
static bool rank_profile(struct ggml_zipmoe_serving * s, const struct routing_halves * h) {
    struct zipmoe_routing_profile * r = &s->routing;
    const int32_t n_exp = r->n_expert;
    int32_t * order = malloc(sizeof(int32_t) * (size_t) n_exp);
    if (order == NULL) {
        return false;
    }
    memset(r->observed, 0, sizeof(double) * (size_t) n_exp);
    const size_t cells = (size_t) s->p.n_layer * n_exp;
    double weights = 0; // each layer's by the steps or tokens it ran: the last runs a prompt's output only
    for (int il = 0; il < s->p.n_layer; ++il) {
        const double * n_half = h->n + il, w = n_half[0] + n_half[s->p.n_layer];
        if (!ggml_zipmoe_cache_has_layer(s->cache, il) || n_half[s->p.n_layer] < 1) {
            continue; // not served, or no odd step or token to read from
        }
        const int32_t n = ggml_zipmoe_cache_n_expert(s->cache, il);
        for (int half = 0; half < 2; ++half) {
            const double * by   = h->counts + (size_t) half * cells + (size_t) il * n_exp;
            const double * read = h->counts + (size_t) (1 - half) * cells + (size_t) il * n_exp;
            rank_experts(by, n, order);
            for (int32_t e = 0; e < n; ++e) {
                r->observed[e] += 0.5 * w * read[order[e]] / n_half[(size_t) (1 - half) * s->p.n_layer];
            }
        }
        weights += w;
    }
    for (int32_t e = 0; e < n_exp; ++e) {
        r->observed[e] /= MAX(1, weights);
    }
    qsort(r->observed, (size_t) n_exp, sizeof(double), descending);
    free(order);
    return weights > 0;
}

#define ZIPMOE_EVEN_Z 3.0 // a z-score a uniform router's steps exceed about once in a thousand re-plans

// how far the steps counted are from a uniform router's: the sum over the served layers and their
// experts of (count - T p)^2 / (T p q), p = k / n, against its mean under a uniform router (n per
// layer) in units of its spread (each term's variance 2 - 6 / T + 1 / (T p q), binomial counts).
// A prompt's tokens come in clusters, a token's repeats routing alike: the sum is taken over their mean
// multiplicity first (Rao and Scott's first-order correction). That is exact where routing follows the
// token alone and discounts more than the repeats explain deeper, where attention mixes in the context:
// the 77-token bench prompt (each token 2.09 times on average) read z = 28.7 on DeepSeek-V2-Lite's
// uniform router, and pools planned on that ran 1.2 times slower than the built-in profile's
static double routing_even_z(const struct ggml_zipmoe_serving * s, const struct routing_halves * h) {
    const struct zipmoe_routing_profile * r = &s->routing;
    const size_t cells = (size_t) s->p.n_layer * r->n_expert;
    double sum = 0, mean = 0, var = 0;
    for (int il = 0; il < s->p.n_layer; ++il) {
        const double  T = h->n[il] + h->n[s->p.n_layer + il];
        const int32_t n = ggml_zipmoe_cache_has_layer(s->cache, il) ? ggml_zipmoe_cache_n_expert(s->cache, il) : 0;
        const double  p = n > 0 ? (double) MIN(h->k, n) / n : 0, q = 1 - p;
        if (n < 1 || p <= 0 || q <= 0 || T < 1) {
            continue;
        }
        for (int32_t e = 0; e < n; ++e) {
            const size_t i = (size_t) il * r->n_expert + e;
            const double d = h->counts[i] + h->counts[cells + i] - T * p;
            sum += d * d / (T * p * q);
        }
        mean += n;
        var  += n * (2 - 6 / T + 1 / (T * p * q));
    }
    return var > 0 ? (sum / h->design_effect - mean) / sqrt(var) : 0;
}

// n slots with the pools of choice, and the plan that reports them; false (nothing changed, logged as
// what) where the cache refuses
static bool adopt_pools(struct ggml_zipmoe_serving * s, int32_t n, struct ggml_zipmoe_default_pools * choice,
                        const char * what) {
    if (zipmoe_serving_use_slots(s, n, choice) != GGML_ZIPMOE_OK) {
        zipmoe_serving_log(s, 1, "%s not made (%s): %s", what, choice->why, ggml_zipmoe_cache_error(s->cache));
        return false;
    }
    s->auto_active = choice->capacity[1] + choice->capacity[2] + choice->capacity[3] > 0;
    s->auto_choice = *choice;
    memcpy(s->plan.pools, choice->capacity, sizeof(s->plan.pools));
    s->plan.n_slots = s->n_slots;
    snprintf(s->plan.pools_why, sizeof(s->plan.pools_why), "%s", choice->why);
    return true;
}

// the pools the planner would take now, into *choice: with the rates the fetches measured (kept for later
// plans for the memory left), on the observed profile unless the routing seen is as even as a uniform
// router's (then what it shows beyond the built-in profile is noise, and partial pools planned on noise
// move experts between them, reads, on every change of rank). False where the planner failed
static bool plan_from_routing(struct ggml_zipmoe_serving * s, const struct routing_halves * h,
                              struct ggml_zipmoe_default_pools * choice) {
    struct zipmoe_routing_profile * r = &s->routing;
    memset(choice, 0, sizeof(*choice));
    // the first plan had only the default rates (or those given); by now the fetches have measured
    // this machine's (zipmoe-fetch.c: calibrate), and later plans for the memory left keep them
    s->plan_rates[0] = ggml_zipmoe_cache_rate(s->cache, GGML_ZIPMOE_RATE_READ);
    s->plan_rates[1] = ggml_zipmoe_cache_rate(s->cache, GGML_ZIPMOE_RATE_DECODE);
    r->even_z        = routing_even_z(s, h);
    r->even          = r->even_z < ZIPMOE_EVEN_Z;
    r->design_effect = h->design_effect;
    return ggml_zipmoe_cache_default_pools(s->cache, s->auto_budget, h->k, s->auto_threads, s->p.work_slots,
                                           s->plan_rates[0], s->plan_rates[1], r->even ? NULL : r->observed,
                                           choice) == GGML_ZIPMOE_OK;
}

// what a change to the pools of choice would be worth
struct replan_weighing {
    int32_t n;        // slots it would use
    double  expected; // its expected makespan per layer
    double  repaid;   // steps until its gain repays its fills (refill_s), INFINITY with no gain
    double  horizon;  // the steps it must repay in
    bool    in_use;   // the pools in use already
    bool    same;     // no gain of a tenth or more
};

// choice weighed against the pools in use; false where its slots do not fit the cache's
static bool weigh_change(const struct ggml_zipmoe_serving * s, const struct ggml_zipmoe_default_pools * choice,
                         struct replan_weighing * w) {
    const bool    use_pools = choice->capacity[1] + choice->capacity[2] + choice->capacity[3] > 0;
    const int32_t capacity  = ggml_zipmoe_cache_slot_capacity(s->cache);
    const int32_t fewest    = MIN(capacity, s->p.n_expert_used);
    if (use_pools && (choice->n_slots < fewest || choice->n_slots > capacity)) {
        return false;
    }
    w->n        = MIN(capacity, MAX(fewest, choice->n_slots));
    w->expected = use_pools ? choice->expected_makespan_s : choice->f_only_makespan_s;
    // a change costs its fills (refill_s: reads, decodes, first touches of new slots): the planner's
    // expected gain must repay that within as many steps as the plan was made from. Four DeepSeek-V2-Lite
    // sequences at 20 GiB moved from C 59 / E 5 to F 12 / C 39 / E 12 and decoded 6% slower over 64
    // tokens, reading three times the bytes
    const double gain_s = (choice->current_makespan_s - w->expected) * s->info.n_moe_layers; // per step
    w->repaid = gain_s > 0 ? choice->refill_s / gain_s : INFINITY;                          // in steps
    w->in_use = use_pools == s->auto_active && w->n == s->n_slots && choice->inclusive == s->auto_choice.inclusive &&
                memcmp(choice->capacity, s->auto_choice.capacity, sizeof(choice->capacity)) == 0;
    w->same   = w->in_use || w->expected >= 0.9 * choice->current_makespan_s;
    // the steps it repays in: those seen, and at a prompt's re-plan (one decode step) the steps the first
    // re-plan would have waited for
    w->horizon = (double) MAX(s->routing.token_steps, (uint64_t) s->p.replan_tokens);
    return true;
}

// "routing z = 1.2 against a uniform router's, so planned for the built-in profile", for the log, with
// the discount for a prompt's repeated tokens where there was one
static void routing_z_text(const struct zipmoe_routing_profile * r, char * out, size_t size) {
    char repeats[96] = "";
    if (r->design_effect > 1) {
        snprintf(repeats, sizeof(repeats), " with the prompt's repeated tokens discounted (design effect %.2f)",
                 r->design_effect);
    }
    snprintf(out, size, "routing z = %.1f%s against a uniform router's%s", r->even_z, repeats,
             r->even ? ", so planned for the built-in profile" : "");
}

// the pools in use kept: said in the plan's reason and the log (seen: the steps the plan was made from,
// routing: how even they were, read_so_far: the bytes read until now)
static void keep_pools(struct ggml_zipmoe_serving * s, const struct ggml_zipmoe_default_pools * choice,
                       const struct replan_weighing * w, int32_t k, const char * seen, const char * routing,
                       double read_so_far) {
    const struct zipmoe_routing_profile * r = &s->routing;
    char repay[64], why[sizeof(s->plan.pools_why) + 200];
    if (w->in_use || !isfinite(w->repaid)) {
        snprintf(repay, sizeof(repay), "%s", w->in_use ? "no change: the pools in use" : "never repaid: no gain");
    } else {
        snprintf(repay, sizeof(repay), "repaid in %.0f steps", ceil(w->repaid));
    }
    snprintf(why, sizeof(why), "%s (kept after a re-plan from the %s: %.2f ms per layer expected, against %.2f "
             "ms with these; the change would take %.1f s, %s)", s->auto_choice.why,
             r->even ? "built-in profile, the routing seen being even" : "observed profile", w->expected * 1e3,
             choice->current_makespan_s * 1e3, choice->refill_s, repay);
    snprintf(s->plan.pools_why, sizeof(s->plan.pools_why), "%.*s", (int) sizeof(s->plan.pools_why) - 1, why);
    zipmoe_serving_log(s, 0, "ZipMoE pools re-planned after %s (%d experts per MoE layer a step, %.1f "
                       "MB read so far; %s): kept, the change to F %d, "
                       "C %d, S %d, E %d expecting %.2f against %.2f ms per layer and taking %.1f s to fill, "
                       "%s; planned again after %llu (%s)",
                       seen, k, read_so_far / 1e6, routing, choice->capacity[0],
                       choice->capacity[1], choice->capacity[2], choice->capacity[3], w->expected * 1e3,
                       choice->current_makespan_s * 1e3, choice->refill_s, repay,
                       (unsigned long long) MAX(r->next_replan, (uint64_t) s->p.replan_tokens), choice->why);
}

// the pools planned from the observed profile, kept unless they expect a gain of a tenth or more
// (a change keeps the store entries that still fit; the rest fill again on demand). Returns 1 if the slots changed.
static int replan(struct ggml_zipmoe_serving * s, const struct routing_halves * h) {
    struct zipmoe_routing_profile * r = &s->routing;
    struct ggml_zipmoe_default_pools choice;
    if (!plan_from_routing(s, h, &choice)) {
        return 0;
    }
    const int32_t k = h->k;
    // the reads until now, so that a log reader can tell the steady state's bytes per token from the warm-up's
    struct ggml_zipmoe_cache_stats st;
    ggml_zipmoe_cache_get_stats(s->cache, &st);
    const double read_so_far = (double) st.bytes_read;
    struct replan_weighing w;
    if (!weigh_change(s, &choice, &w)) {
        return 0;
    }
    char seen[96];
    if (r->token_steps == 0) {
        snprintf(seen, sizeof(seen), "a prompt of %.0f tokens", routed_tokens(s, h));
    } else {
        snprintf(seen, sizeof(seen), "%llu decode steps%s", (unsigned long long) r->token_steps,
                 h->counts == r->token_counts ? " and the prompt before them" : "");
    }
    if (!w.same && w.repaid > w.horizon) {
        // not yet: the steps seen would repay it once they reach `repaid` (a ski rental's break-even),
        // planned again then, not at twice these: the four Qwen1.5-MoE sequences at 20 GiB declined a
        // change at 16 steps repaid in 21 and decoded from C on the path until 32
        const uint64_t at = (uint64_t) MIN(ceil(w.repaid), 2.0 * (double) r->token_steps);
        r->next_replan = MAX(at, r->token_steps + MAX(1, r->token_steps / 8));
    }
    char routing[192];
    routing_z_text(r, routing, sizeof(routing));
    if (w.same || w.repaid > w.horizon) {
        keep_pools(s, &choice, &w, k, seen, routing, read_so_far);
        return 0;
    }
    if (!adopt_pools(s, w.n, &choice, "ZipMoE pools from the observed routing")) {
        return 0; // nothing changed
    }
    r->adopted = true;
    struct ggml_zipmoe_cache_stats moved;
    ggml_zipmoe_cache_get_stats(s->cache, &moved);
    zipmoe_serving_log(s, 0, "ZipMoE pools re-planned after %s (%d experts per MoE layer a step, %.1f MB "
                       "read so far; %s): F %d, C %d, S %d, E %d per MoE "
                       "layer, %d slots, expecting %.2f against %.2f ms per layer with the pools before, %llu experts "
                       "moved from C/S to F in %.2f s (%.1f MB of the stores' pages moved into the slots): %s",
                       seen, k, read_so_far / 1e6, routing,
                       choice.capacity[0], choice.capacity[1], choice.capacity[2], choice.capacity[3], w.n,
                       w.expected * 1e3, choice.current_makespan_s * 1e3,
                       (unsigned long long) (moved.migrate_experts - st.migrate_experts),
                       (moved.migrate_ns - st.migrate_ns) / 1e9, (moved.moved_page_bytes - st.moved_page_bytes) / 1e6,
                       choice.why);
    return 1;
}

static void forget_tokens(struct zipmoe_routing_profile * r) {
    free(r->token_ids);
    free(r->token_mult);
    r->token_ids      = NULL;
    r->token_mult     = NULL;
    r->token_cap      = 0;
    r->token_distinct = 0;
}

static size_t token_home(int32_t id, size_t cap) {
    return (size_t) ((uint32_t) id * 2654435761u) & (cap - 1);
}

// room in the table for one more id at half load; false where memory ran out
static bool token_room(struct zipmoe_routing_profile * r) {
    if (2 * (r->token_distinct + 1) <= r->token_cap) {
        return true;
    }
    const size_t cap  = r->token_cap ? 2 * r->token_cap : 256;
    int32_t *    ids  = malloc(cap * sizeof(int32_t));
    uint32_t *   mult = calloc(cap, sizeof(uint32_t));
    if (ids == NULL || mult == NULL) {
        free(ids);
        free(mult);
        return false;
    }
    memset(ids, 0xff, cap * sizeof(int32_t)); // -1: empty
    for (size_t i = 0; i < r->token_cap; ++i) {
        if (r->token_ids[i] >= 0) {
            size_t j = token_home(r->token_ids[i], cap);
            while (ids[j] >= 0) {
                j = (j + 1) & (cap - 1);
            }
            ids[j]  = r->token_ids[i];
            mult[j] = r->token_mult[i];
        }
    }
    free(r->token_ids);
    free(r->token_mult);
    r->token_ids  = ids;
    r->token_mult = mult;
    r->token_cap  = cap;
    return true;
}

void ggml_zipmoe_serving_observe_tokens(struct ggml_zipmoe_serving * s, const int32_t * tokens, int32_t n_tokens,
                                        int32_t n_seqs) {
    if (s == NULL || n_tokens < 1) {
        return;
    }
    struct zipmoe_routing_profile * r = &s->routing;
    if (!s->auto_eligible || r->replanned || r->prompt_replan || s->p.replan_tokens == 0) {
        return;
    }
    if (n_seqs != 1 || r->several_seqs) {
        forget_tokens(r); // no re-plan after a prompt then
        return;
    }
    for (int32_t i = 0; i < n_tokens; ++i) {
        double m = 1; // a token not told (embeddings), or past the memory for the table: as if it came once
        if (tokens != NULL && tokens[i] >= 0 && token_room(r)) {
            size_t j = token_home(tokens[i], r->token_cap);
            while (r->token_ids[j] >= 0 && r->token_ids[j] != tokens[i]) {
                j = (j + 1) & (r->token_cap - 1);
            }
            if (r->token_ids[j] < 0) {
                r->token_ids[j] = tokens[i];
                r->token_distinct++;
            }
            m = ++r->token_mult[j];
        }
        r->token_n += 1;
        r->token_sum_sq += 2 * m - 1; // m^2 - (m - 1)^2
    }
}

int ggml_zipmoe_serving_observe(struct ggml_zipmoe_serving * s, int32_t n_tokens, int32_t n_seqs) {
    if (s == NULL) {
        return 0;
    }
    struct zipmoe_routing_profile * r = &s->routing;
    if (!s->auto_eligible || r->replanned || s->p.replan_tokens == 0 || s->cache == NULL) {
        return 0;
    }
    if (r->n_expert == 0 && !start_profile(s)) {
        return 0;
    }
    const bool counted = count_step(s, n_tokens, n_seqs);
    struct routing_halves h = { 0 };
    // one sequence's prompt of replan_tokens tokens or more (the ubatch that reaches it, else its first
    // decode step): its tokens rank the experts, and every step decoded from C before the change is time
    // lost (the full Qwen1.5-MoE geometry at 20 GiB spent 2.5 s of its 64 tokens' 13.6 decoding from C
    // until the re-plan at 8 steps). Planned at the prompt's end, the change and its migration are the
    // prompt's time, not its first decode step's: the same model at 20 GiB decoded its first 8 steps at
    // 1.9x the steady step after a change at step 1. Later re-plans take the decode steps alone: the
    // prompt's repeated tokens made the uniform router's look uneven (z = 14-23 against 0.3) and
    // DeepSeek-V2-Lite's random one more concentrated than its steps, pools planned on that read again
    // what C dropped
    const bool prompt_ubatch = !counted && n_seqs == 1 && n_tokens > 1 && r->token_steps == 0;
    const bool after_prompt = (prompt_ubatch || (counted && r->token_steps == 1)) && !r->prompt_replan &&
                              !r->several_seqs && token_halves(s, &h) &&
                              routed_tokens(s, &h) >= s->p.replan_tokens;
    r->prompt_replan |= counted || after_prompt;
    if (r->prompt_replan) {
        forget_tokens(r); // h has their design effect
    }
    if (!after_prompt && r->token_steps < MAX(r->next_replan, (uint64_t) s->p.replan_tokens)) {
        return 0;
    }
    // a change must repay its cost within the steps seen (replan), so a serving that has run twice as
    // long may take one an earlier re-plan declined: four Qwen1.5-MoE sequences at 20 GiB kept every
    // expert compressed, decoding on the path at twice stock's step, for a change repaid in 51 steps.
    // A change declined only for its
    // cost brings the next re-plan forward to where it would repay (replan)
    r->next_replan = 2 * r->token_steps;
    if (!after_prompt) {
        h = step_halves(s);
    }
    return rank_profile(s, &h) ? replan(s, &h) : 0;
}
