// ZipMoE's option table and its checks (ggml-zipmoe-options.h): the single source every surface
// (the loader, Python's keyword arguments, zipmoe-chat, zipmoe-server, README.md) derives from.

#include "ggml-zipmoe-options.h"
#include "ggml-zipmoe-policy.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

// the names of the enums the options take (and the pools'): here, below the cache and the lossy
// policies whose enums they name, so that the option table needs nothing above common/
const char * ggml_zipmoe_eviction_name(int eviction) {
    static const char * names[GGML_ZIPMOE_EVICT_COUNT] = { "lru", "fifo", "marking", "lfu", "rank", "score" };
    return eviction >= 0 && eviction < GGML_ZIPMOE_EVICT_COUNT ? names[eviction] : NULL;
}

const char * ggml_zipmoe_substitution_name(int policy) {
    static const char * names[GGML_ZIPMOE_SUBST_COUNT] = { "none", "smoe", "buddy" };
    return policy >= 0 && policy < GGML_ZIPMOE_SUBST_COUNT ? names[policy] : NULL;
}

const char * ggml_zipmoe_pool_name(int pool) {
    static const char * names[GGML_ZIPMOE_POOL_COUNT] = { "F", "C", "S", "E" };
    return pool >= 0 && pool < GGML_ZIPMOE_POOL_COUNT ? names[pool] : NULL;
}

#define LOADER GGML_ZIPMOE_SURFACE_LOADER
#define PYTHON GGML_ZIPMOE_SURFACE_PYTHON
#define BOTH   (LOADER | PYTHON)
#define NONE   -1, -1  // requires nothing
#define MAX_COUNT 1048576.0 // pools, slots, rank margins: far beyond any model's experts per layer

// what a pool holds, for the pool_* options' help
#define POOL_OPTION(ID, NAME, ENV_NAME, WHAT)                                                                 \
    [ID] = { "pool_" NAME, "zipmoe.pool_" NAME, "ZIPMOE_POOL_" ENV_NAME, GGML_ZIPMOE_TYPE_INT, LOADER, 0,    \
             MAX_COUNT, NAN, 0, "experts per MoE layer", NULL, "0",                                          \
             "experts per MoE layer kept " WHAT " (what the pools option sets)",                             \
             GGML_ZIPMOE_OPTION_EVICTION, GGML_ZIPMOE_EVICT_RANK }

static const struct ggml_zipmoe_option k_options[GGML_ZIPMOE_OPTION_COUNT] = {
    [GGML_ZIPMOE_OPTION_BUDGET] = { "budget", "zipmoe.budget", "ZIPMOE_BUDGET", GGML_ZIPMOE_TYPE_SIZE, BOTH, 0, 0,
        NAN, 0, NULL, NULL, "from the memory available",
        "memory for the expert slots and pools; a budget that does not fit is reduced, with a warning; with "
        "layers on several devices, the slots of all of them, each device's set taking its layers' share", NONE },
    [GGML_ZIPMOE_OPTION_DEVICE_BUDGETS] = { "device_budgets", "zipmoe.device_budgets", "ZIPMOE_DEVICE_BUDGETS",
        GGML_ZIPMOE_TYPE_DEVICE_SIZES, BOTH, 0, 0, NAN, 0, NULL, NULL, "none",
        "the expert slots of the MoE layers on a device, by its name (CPU: host memory; CUDA0, RPC0: as "
        "llama.cpp's log names them); a device not named takes its share of the budget, or its free memory",
        NONE },
    [GGML_ZIPMOE_OPTION_MEM_LIMIT] = { "mem_limit", "zipmoe.mem_limit", "ZIPMOE_MEM_LIMIT", GGML_ZIPMOE_TYPE_SIZE,
        BOTH, 0, 0, NAN, 0, NULL, NULL, "the cgroup limits and MemAvailable",
        "memory the process may use in all, when it must share the machine below its cgroup and MemAvailable",
        NONE },
    [GGML_ZIPMOE_OPTION_DIRECT_IO] = { "direct_io", "zipmoe.direct_io", "ZIPMOE_DIRECT_IO", GGML_ZIPMOE_TYPE_BOOL,
        BOTH, 0, 1, NAN, -1, NULL, NULL, "on where the filesystem supports it",
        "read expert chunks with O_DIRECT, bypassing the page cache (on: an error where the filesystem cannot)",
        NONE },
    [GGML_ZIPMOE_OPTION_PRELOAD] = { "preload", "zipmoe.preload", "ZIPMOE_PRELOAD", GGML_ZIPMOE_TYPE_BOOL, BOTH, 0,
        1, NAN, 1, NULL, NULL, "on",
        "fill the expert slots when the first context is made, as a memory-mapped model's populate does, where "
        "they hold every expert (else a prompt reads those it needs)", NONE },
    [GGML_ZIPMOE_OPTION_THREADS] = { "threads", "zipmoe.threads", "ZIPMOE_THREADS", GGML_ZIPMOE_TYPE_INT, BOTH, 0,
        4096, NAN, 0, "threads", "0: all of the graph's threads", "0",
        "graph threads that decode fetched experts (reads run on the cache's own I/O thread)", NONE },
    [GGML_ZIPMOE_OPTION_EVICTION] = { "eviction", "zipmoe.eviction", "ZIPMOE_EVICTION", GGML_ZIPMOE_TYPE_NAME,
        BOTH, 0, 0, NAN, GGML_ZIPMOE_EVICT_RANK, NULL, NULL, "rank",
        "which cached expert a miss replaces: rank (ZipMoE's rank dispatch), lru, fifo, marking, lfu, score "
        "(SMoE's lowest mean router score; lossless)", NONE },
    [GGML_ZIPMOE_OPTION_RANK_DELTA] = { "rank_delta", "zipmoe.rank_delta", "ZIPMOE_RANK_DELTA",
        GGML_ZIPMOE_TYPE_INT, BOTH, 0, MAX_COUNT, NAN, 0, NULL, NULL, "0, or the plan's",
        "the rank dispatch's tolerance margin delta", NONE },
    [GGML_ZIPMOE_OPTION_POOLS] = { "pools", NULL, NULL, GGML_ZIPMOE_TYPE_POOLS, PYTHON, 0, 0, NAN, 0, NULL, NULL,
        "the default pools (auto_pools)",
        "cache pools by hand, experts per MoE layer kept full (F), compressed (C), as SM-chunks (S) or E-chunks "
        "(E), like F=4,C=8,E=2", GGML_ZIPMOE_OPTION_EVICTION, GGML_ZIPMOE_EVICT_RANK },
    [GGML_ZIPMOE_OPTION_PLAN] = { "plan", NULL, NULL, GGML_ZIPMOE_TYPE_PATH, PYTHON, 0, 0, NAN, 0, NULL, NULL,
        "none", "a zipmoe-plan file: its pools and rank delta (instead of pools)", NONE },
    POOL_OPTION(GGML_ZIPMOE_OPTION_POOL_F, "f", "F", "full (BF16)"),
    POOL_OPTION(GGML_ZIPMOE_OPTION_POOL_C, "c", "C", "compressed (SM- and E-chunks)"),
    POOL_OPTION(GGML_ZIPMOE_OPTION_POOL_S, "s", "S", "as SM-chunks"),
    POOL_OPTION(GGML_ZIPMOE_OPTION_POOL_E, "e", "E", "as E-chunks"),
    [GGML_ZIPMOE_OPTION_WORK_SLOTS] = { "work_slots", "zipmoe.work_slots", "ZIPMOE_WORK_SLOTS", GGML_ZIPMOE_TYPE_INT,
        BOTH, 1, MAX_COUNT, NAN, 8, "slots", NULL, "8",
        "with pools, the slots beyond F's where other experts are made full for a pass", NONE },
    [GGML_ZIPMOE_OPTION_AUTO_POOLS] = { "auto_pools", "zipmoe.auto_pools", "ZIPMOE_AUTO_POOLS",
        GGML_ZIPMOE_TYPE_BOOL, BOTH, 0, 1, NAN, 1, NULL, NULL, "on",
        "with no pools given (host slots, rank eviction): the pools for the memory left; off: one F pool", NONE },
    [GGML_ZIPMOE_OPTION_DEVICE_STORES] = { "device_stores", "zipmoe.device_stores", "ZIPMOE_DEVICE_STORES",
        GGML_ZIPMOE_TYPE_BOOL, BOTH, 0, 1, NAN, 0, NULL, NULL, "off",
        "with the slots in a device's memory (a GPU, an rpc-server) and no pools given: host memory keeps the "
        "other experts compressed beside them, from the prompt's reads on (lossless)", NONE },
    [GGML_ZIPMOE_OPTION_CPU_COMPUTE] = { "cpu_compute", "zipmoe.cpu_compute", "ZIPMOE_CPU_COMPUTE",
        GGML_ZIPMOE_TYPE_BOOL, BOTH, 0, 1, NAN, 0, NULL, "exact weights, the CPU's rounding", "off",
        "with the slots in a device's memory: the CPU computes a missing expert in host memory instead of copying it "
        "to the device, where SMoE's CPU-load balancer finds that faster; exact weights, the CPU's rounding (not "
        "bit-identical to stock with the device computing)", NONE },
    [GGML_ZIPMOE_OPTION_REPLAN_TOKENS] = { "replan_tokens", "zipmoe.replan_tokens", "ZIPMOE_REPLAN_TOKENS",
        GGML_ZIPMOE_TYPE_INT, BOTH, 0, 1073741824.0, NAN, 8, "decode steps", "0: never", "8",
        "after this many decode steps (one token of each sequence), the default pools are planned again from the routing seen, "
        "and again each time the steps counted double; one sequence's prompt counts token by token: a prompt this long plans them "
        "as it ends", NONE },
    [GGML_ZIPMOE_OPTION_PREFETCH] = { "prefetch", "zipmoe.prefetch", "ZIPMOE_PREFETCH", GGML_ZIPMOE_TYPE_BOOL, BOTH,
        0, 1, NAN, 0, NULL, NULL, "off",
        "while a layer computes, read the experts the next layer is predicted to choose (lossless)", NONE },
    [GGML_ZIPMOE_OPTION_RESIDENT_VIEWS] = { "resident_views", "zipmoe.resident_views", "ZIPMOE_RESIDENT_VIEWS",
        GGML_ZIPMOE_TYPE_BOOL, BOTH, 0, 1, NAN, 1, NULL, NULL, "on",
        "once a preload left every expert in a slot, in order, the products use the slots in place (no fetch op)",
        NONE },
    [GGML_ZIPMOE_OPTION_SUBSTITUTION] = { "substitution", "zipmoe.substitution", "ZIPMOE_SUBSTITUTION",
        GGML_ZIPMOE_TYPE_NAME, BOTH, 0, 0, NAN, GGML_ZIPMOE_SUBST_NONE, NULL, "smoe and buddy are lossy",
        "none (lossless)",
        "expert substitution, LOSSY unless none: smoe (SMoE's expert-cache router) or buddy (BuddyMoE)", NONE },
    [GGML_ZIPMOE_OPTION_SMOE_ALPHA] = { "smoe_alpha", "zipmoe.smoe_alpha", "ZIPMOE_SMOE_ALPHA", GGML_ZIPMOE_TYPE_REAL,
        BOTH, 0, 1, NAN, 0.1, NULL, NULL, "0.1",
        "SMoE's alpha: a chosen expert scoring below (1+alpha) beta may give way to one scoring in "
        "[(1-alpha) beta, beta); 0 replaces nothing", GGML_ZIPMOE_OPTION_SUBSTITUTION, GGML_ZIPMOE_SUBST_SMOE },
    [GGML_ZIPMOE_OPTION_BUDDY_PROFILE] = { "buddy_profile", NULL, NULL, GGML_ZIPMOE_TYPE_PATH, PYTHON, 0, 0, NAN, 0,
        NULL, NULL, "none", "BuddyMoE's buddy lists: the zipmoe-buddies profile of this model",
        GGML_ZIPMOE_OPTION_SUBSTITUTION, GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_TAU] = { "buddy_tau", "zipmoe.buddy_tau", "ZIPMOE_BUDDY_TAU", GGML_ZIPMOE_TYPE_REAL,
        BOTH, 0, 1, -1, -1, NULL, "-1: each layer's calibrated tau from the profile", "-1",
        "BuddyMoE's TAE gate: replace only for tokens whose routing entropy exceeds it",
        GGML_ZIPMOE_OPTION_SUBSTITUTION, GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_TEMPERATURE] = { "buddy_temperature", "zipmoe.buddy_temperature",
        "ZIPMOE_BUDDY_TEMPERATURE", GGML_ZIPMOE_TYPE_REAL, BOTH, 0.05, 20, NAN, 1, NULL, NULL, "1",
        "BuddyMoE's temperature T of the routing entropy (use the profile's)", NONE },
    [GGML_ZIPMOE_OPTION_BUDDY_GAMMA] = { "buddy_gamma", "zipmoe.buddy_gamma", "ZIPMOE_BUDDY_GAMMA",
        GGML_ZIPMOE_TYPE_REAL, BOTH, 0, 1, NAN, 1, NULL, "1: no margin gate", "1",
        "BuddyMoE's margin gate: no replacement when the top-1 minus top-2 renormalized score is at least it",
        GGML_ZIPMOE_OPTION_SUBSTITUTION, GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_BETA] = { "buddy_beta", "zipmoe.buddy_beta", "ZIPMOE_BUDDY_BETA", GGML_ZIPMOE_TYPE_REAL,
        BOTH, 0, 1, NAN, 1, NULL, NULL, "1",
        "BuddyMoE's distribution gate: no replacement in a batch whose share of missing experts is at least it",
        GGML_ZIPMOE_OPTION_SUBSTITUTION, GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_RHO] = { "buddy_rho", "zipmoe.buddy_rho", "ZIPMOE_BUDDY_RHO", GGML_ZIPMOE_TYPE_INT,
        BOTH, 0, 64, NAN, 3, "replacements per token", "0 replaces nothing", "3",
        "BuddyMoE's budget: replacements per token at most", GGML_ZIPMOE_OPTION_SUBSTITUTION,
        GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_SEARCH] = { "buddy_search", "zipmoe.buddy_search", "ZIPMOE_BUDDY_SEARCH",
        GGML_ZIPMOE_TYPE_INT, BOTH, 0, 1024, NAN, 16, "buddies", NULL, "16",
        "BuddyMoE's H: buddies searched per missing expert", GGML_ZIPMOE_OPTION_SUBSTITUTION,
        GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_BUDDY_ETA] = { "buddy_eta", "zipmoe.buddy_eta", "ZIPMOE_BUDDY_ETA", GGML_ZIPMOE_TYPE_REAL,
        BOTH, 0, 10, NAN, 0, NULL, "0: the list's order", "0",
        "BuddyMoE's priority q (1 + eta z) by the token's own router scores", GGML_ZIPMOE_OPTION_SUBSTITUTION,
        GGML_ZIPMOE_SUBST_BUDDY },
    [GGML_ZIPMOE_OPTION_TRACE_ROUTING] = { "trace_routing", "zipmoe.trace_routing", "ZIPMOE_TRACE_ROUTING",
        GGML_ZIPMOE_TYPE_BOOL, LOADER, 0, 1, NAN, 0, NULL, NULL, "off",
        "record the routing's co-activations (zipmoe-buddies)", NONE },
};

int ggml_zipmoe_option_count(void) {
    return GGML_ZIPMOE_OPTION_COUNT;
}

const struct ggml_zipmoe_option * ggml_zipmoe_option_at(int id) {
    return id >= 0 && id < GGML_ZIPMOE_OPTION_COUNT ? &k_options[id] : NULL;
}

int ggml_zipmoe_option_find(const char * name) {
    for (int id = 0; name != NULL && id < GGML_ZIPMOE_OPTION_COUNT; id++) {
        const struct ggml_zipmoe_option * o = &k_options[id];
        if (strcmp(name, o->name) == 0 || (o->key && strcmp(name, o->key) == 0) ||
            (o->env && strcmp(name, o->env) == 0)) {
            return id;
        }
    }
    return -1;
}

const char * ggml_zipmoe_option_choice(int id, int k) {
    switch (id) {
        case GGML_ZIPMOE_OPTION_EVICTION:     return ggml_zipmoe_eviction_name(k);
        case GGML_ZIPMOE_OPTION_SUBSTITUTION: return ggml_zipmoe_substitution_name(k);
        default:                              return NULL;
    }
}

// appends to buf (size bytes, NUL-terminated) at *len; *len counts what was wanted
static void append(char * buf, size_t size, int * len, const char * fmt, ...) __attribute__((format(printf, 4, 5)));

static void append(char * buf, size_t size, int * len, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const size_t at = (size_t) *len < size ? (size_t) *len : size;
    const int n = vsnprintf(buf ? buf + at : NULL, buf && at < size ? size - at : 0, fmt, ap);
    va_end(ap);
    *len += n > 0 ? n : 0;
}

int ggml_zipmoe_option_expects(int id, char * buf, size_t size) {
    const struct ggml_zipmoe_option * o = ggml_zipmoe_option_at(id);
    if (o == NULL) {
        return -1;
    }
    if (buf != NULL && size > 0) {
        buf[0] = '\0';
    }
    int len = 0;
    switch (o->type) {
        case GGML_ZIPMOE_TYPE_SIZE:
            append(buf, size, &len, "a size in bytes, or like 4G, 512M, 1.5GiB");
            break;
        case GGML_ZIPMOE_TYPE_BOOL:
            append(buf, size, &len, "true or false (1/0, yes/no, on/off)");
            break;
        case GGML_ZIPMOE_TYPE_INT:
            append(buf, size, &len, "a whole number%s%s from %.0f to %.0f", o->unit ? " of " : "", o->unit ? o->unit : "",
                   o->min, o->max);
            break;
        case GGML_ZIPMOE_TYPE_REAL:
            append(buf, size, &len, "a number from %g to %g", o->min, o->max);
            if (!isnan(o->also)) {
                append(buf, size, &len, ", or %g", o->also);
            }
            break;
        case GGML_ZIPMOE_TYPE_NAME:
            append(buf, size, &len, "one of");
            for (int k = 0; ggml_zipmoe_option_choice(id, k) != NULL; k++) {
                append(buf, size, &len, "%s %s", k ? "," : "", ggml_zipmoe_option_choice(id, k));
            }
            break;
        case GGML_ZIPMOE_TYPE_POOLS:
            append(buf, size, &len, "like F=4,C=8,E=2 (experts per MoE layer of the pools F, C, S, E)");
            break;
        case GGML_ZIPMOE_TYPE_DEVICE_SIZES:
            append(buf, size, &len, "like 'CUDA0=6G CPU=8G' (a device's name and a size for each, separated by "
                   "spaces, each device once)");
            break;
        default:
            append(buf, size, &len, "a file's path");
            break;
    }
    if (o->note != NULL) {
        append(buf, size, &len, " (%s)", o->note);
    }
    return len;
}

// text without surrounding blanks, lower-cased, into out (false if it does not fit)
static bool trimmed_lower(const char * text, char * out, size_t size) {
    while (*text == ' ' || *text == '\t') {
        text++;
    }
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == ' ' || text[n - 1] == '\t')) {
        n--;
    }
    if (n >= size) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        out[i] = (char) tolower((unsigned char) text[i]);
    }
    out[n] = '\0';
    return true;
}

const char * ggml_zipmoe_size_text(uint64_t bytes, char * buf, size_t size) {
    if (buf == NULL || size == 0) {
        return buf;
    }
    if (bytes < 1024) {
        snprintf(buf, size, "%llu byte%s", (unsigned long long) bytes, bytes == 1 ? "" : "s");
    } else if (bytes < (1u << 20)) {
        snprintf(buf, size, "%.1f KiB", ldexp((double) bytes, -10));
    } else if (bytes < (1u << 30)) {
        snprintf(buf, size, "%.1f MiB", ldexp((double) bytes, -20));
    } else {
        snprintf(buf, size, "%.2f GiB", ldexp((double) bytes, -30));
    }
    return buf;
}

// "4G", "512M", "1.5GiB", "123" (binary units); false if malformed or beyond int64
static bool parse_size(const char * s, int64_t * out) {
    if (s[0] == '\0' || s[0] == '-' || s[0] == '+') {
        return false;
    }
    char * end = NULL;
    errno = 0;
    const double v = strtod(s, &end);
    if (end == s || errno != 0 || !isfinite(v) || v <= 0) {
        return false;
    }
    char unit[8] = { 0 };
    size_t n = strlen(end);
    if (n >= sizeof(unit)) {
        return false;
    }
    memcpy(unit, end, n);
    if (n >= 2 && strcmp(unit + n - 2, "ib") == 0) {
        unit[n - 2] = '\0';
    } else if (n >= 1 && unit[n - 1] == 'b') {
        unit[n - 1] = '\0';
    }
    static const char units[] = "kmgt";
    double scale = 1;
    if (unit[0] != '\0') {
        const char * at = unit[1] == '\0' ? strchr(units, unit[0]) : NULL;
        if (at == NULL || *at == '\0') {
            return false;
        }
        scale = ldexp(1.0, 10 * (int) (at - units + 1));
    }
    const double bytes = v * scale;
    if (bytes < 1 || bytes > 9.0e18) {
        return false;
    }
    *out = (int64_t) bytes;
    return true;
}

static bool parse_whole(const char * s, int64_t * out) {
    char * end = NULL;
    errno = 0;
    const long long v = strtoll(s, &end, 10);
    if (s[0] == '\0' || *end != '\0' || errno != 0) {
        return false;
    }
    *out = v;
    return true;
}

static bool parse_real(const char * s, double * out) {
    char * end = NULL;
    *out = strtod(s, &end);
    return s[0] != '\0' && *end == '\0';
}

static bool parse_bool(const char * s, int64_t * out) {
    static const char * const yes[] = { "1", "true", "yes", "on" }, * const no[] = { "0", "false", "no", "off" };
    for (int k = 0; k < 4; k++) {
        if (strcmp(s, yes[k]) == 0 || strcmp(s, no[k]) == 0) {
            *out = strcmp(s, yes[k]) == 0;
            return true;
        }
    }
    return false;
}

// DEVICE_SIZES: entry k of text ("CUDA0=6G CPU=8G") into name and *bytes; false past the last or malformed
static bool device_size_at(const char * text, int k, char * name, size_t name_size, int64_t * bytes) {
    const char * at = text;
    for (int i = 0;; i++) {
        at += strspn(at, " \t,");
        if (*at == '\0') {
            return false;
        }
        const size_t n = strcspn(at, " \t,");
        const char * eq = memchr(at, '=', n);
        if (eq == NULL || eq == at || eq == at + n - 1) {
            return false; // every entry is NAME=SIZE, whichever is asked for
        }
        if (i == k) {
            char size_text[64];
            const size_t name_len = (size_t) (eq - at), size_len = n - name_len - 1;
            if (name_len >= name_size || size_len >= sizeof(size_text)) {
                return false;
            }
            memcpy(name, at, name_len);
            name[name_len] = '\0';
            memcpy(size_text, eq + 1, size_len);
            size_text[size_len] = '\0';
            for (char * c = size_text; *c; c++) {
                *c = (char) tolower((unsigned char) *c);
            }
            return parse_size(size_text, bytes);
        }
        at += n;
    }
}

int ggml_zipmoe_device_size_at(const char * text, int k, char * name, size_t name_size, uint64_t * bytes) {
    int64_t b = 0;
    if (text == NULL || name == NULL || name_size == 0 || bytes == NULL || k < 0 ||
        !device_size_at(text, k, name, name_size, &b)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    *bytes = (uint64_t) b;
    return GGML_ZIPMOE_OK;
}

// every entry of a DEVICE_SIZES text well formed, at least one, no device twice: the entries' count, or -1
static int64_t device_sizes_count(const char * text) {
    int64_t entries = 0;
    for (const char * at = text + strspn(text, " \t,"); *at; at += strspn(at, " \t,")) {
        entries++;
        at += strcspn(at, " \t,");
    }
    char name[64], other[64];
    int64_t bytes = 0;
    for (int64_t k = 0; k < entries; k++) {
        if (!device_size_at(text, (int) k, name, sizeof(name), &bytes)) {
            return -1;
        }
        for (int64_t j = 0; j < k; j++) {
            device_size_at(text, (int) j, other, sizeof(other), &bytes);
            if (strcasecmp(other, name) == 0) {
                return -1;
            }
        }
    }
    return entries > 0 ? entries : -1;
}

// what is wrong with one entry of a DEVICE_SIZES text (at, n bytes long) into buf; false if nothing
static bool device_entry_problem(const char * at, size_t n, char * buf, size_t size) {
    const char * eq = memchr(at, '=', n);
    if (eq == NULL || eq == at || eq == at + n - 1) {
        snprintf(buf, size, "'%.*s' is not DEVICE=SIZE", (int) (n < 64 ? n : 64), at);
        return true;
    }
    const int name_len = (int) (eq - at), size_len = (int) (n - (size_t) name_len - 1);
    char size_text[64];
    if (name_len >= 64) {
        snprintf(buf, size, "the device name '%.*s...' is longer than 63 characters", 32, at);
        return true;
    }
    snprintf(size_text, sizeof(size_text), "%.*s", size_len < 63 ? size_len : 63, eq + 1);
    for (char * c = size_text; *c; c++) {
        *c = (char) tolower((unsigned char) *c);
    }
    int64_t bytes = 0;
    if (size_len >= 63 || !parse_size(size_text, &bytes)) {
        char * end = NULL, unit_alone[72];
        const double v = strtod(size_text, &end);
        snprintf(unit_alone, sizeof(unit_alone), "1%s", end); // a known unit: the number is what is wrong
        const bool number = end != size_text && size_len < 63 && isfinite(v);
        const bool unit   = number && parse_size(unit_alone, &bytes); // then bytes: the unit's
        snprintf(buf, size, "%.*s's size %.*s %s", name_len, at, size_len < 32 ? size_len : 32, eq + 1,
                 number && v <= 0               ? "is not more than 0"
                 : unit && v * (double) bytes < 1 ? "is less than a byte"
                 : unit                           ? "is too large" : "is not a size like 20G or 512M");
        return true;
    }
    return false;
}

int ggml_zipmoe_device_sizes_problem(const char * text, char * buf, size_t size) {
    if (text == NULL || buf == NULL || size == 0) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    buf[0] = '\0';
    int entries = 0;
    for (const char * at = text + strspn(text, " \t,"); *at; at += strspn(at, " \t,")) {
        const size_t n = strcspn(at, " \t,");
        if (device_entry_problem(at, n, buf, size)) {
            return GGML_ZIPMOE_OK;
        }
        char name[64], other[64];
        int64_t bytes = 0;
        device_size_at(text, entries, name, sizeof(name), &bytes);
        for (int j = 0; j < entries; j++) {
            device_size_at(text, j, other, sizeof(other), &bytes);
            if (strcasecmp(other, name) == 0) {
                snprintf(buf, size, "device %s is named twice", name);
                return GGML_ZIPMOE_OK;
            }
        }
        entries++;
        at += n;
    }
    if (entries == 0) {
        snprintf(buf, size, "no device is named");
    }
    return GGML_ZIPMOE_OK;
}

static bool in_range(const struct ggml_zipmoe_option * o, double v) {
    return (v >= o->min && v <= o->max) || v == o->also;
}

int ggml_zipmoe_option_parse(int id, const struct ggml_zipmoe_option_input * in, struct ggml_zipmoe_option_value * out) {
    const struct ggml_zipmoe_option * o = ggml_zipmoe_option_at(id);
    if (o == NULL || in == NULL || out == NULL || (in->given == GGML_ZIPMOE_GIVEN_TEXT && in->text == NULL)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    char text[256] = "";
    if (in->given == GGML_ZIPMOE_GIVEN_TEXT && !trimmed_lower(in->text, text, sizeof(text))) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const bool as_text = in->given == GGML_ZIPMOE_GIVEN_TEXT;
    struct ggml_zipmoe_option_value v = { 0, 0 };
    bool ok = false;
    switch (o->type) {
        case GGML_ZIPMOE_TYPE_SIZE:
            ok = as_text ? parse_size(text, &v.i) : in->given == GGML_ZIPMOE_GIVEN_INT && in->i > 0;
            v.i = as_text ? v.i : in->i;
            break;
        case GGML_ZIPMOE_TYPE_BOOL:
            ok = as_text ? parse_bool(text, &v.i) : in->given == GGML_ZIPMOE_GIVEN_BOOL;
            v.i = as_text ? v.i : in->i != 0;
            break;
        case GGML_ZIPMOE_TYPE_INT:
            ok = as_text ? parse_whole(text, &v.i) : in->given == GGML_ZIPMOE_GIVEN_INT;
            v.i = as_text ? v.i : in->i;
            ok = ok && in_range(o, (double) v.i);
            break;
        case GGML_ZIPMOE_TYPE_REAL:
            ok = as_text ? parse_real(text, &v.f) : in->given != GGML_ZIPMOE_GIVEN_BOOL;
            v.f = as_text ? v.f : in->given == GGML_ZIPMOE_GIVEN_INT ? (double) in->i : in->f;
            ok = ok && in_range(o, v.f);
            break;
        case GGML_ZIPMOE_TYPE_DEVICE_SIZES:
            v.i = as_text ? device_sizes_count(text) : -1;
            ok  = v.i > 0;
            break;
        case GGML_ZIPMOE_TYPE_NAME:
            for (int k = 0; as_text && ggml_zipmoe_option_choice(id, k) != NULL; k++) {
                if (strcmp(text, ggml_zipmoe_option_choice(id, k)) == 0) {
                    v.i = k;
                    ok  = true;
                }
            }
            break;
        default:
            break;
    }
    if (!ok) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    *out = v;
    return GGML_ZIPMOE_OK;
}

// option id's value as given, else its default
static double effective(int id, const struct ggml_zipmoe_option_value * values, const bool * given) {
    const struct ggml_zipmoe_option * o = &k_options[id];
    if (!given[id]) {
        return o->value;
    }
    return o->type == GGML_ZIPMOE_TYPE_REAL ? values[id].f : (double) values[id].i;
}

int ggml_zipmoe_options_check(const struct ggml_zipmoe_option_value * values, const bool * given, bool only_given,
                              const char * prefix, char * err, size_t size) {
    if (values == NULL || given == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    prefix = prefix ? prefix : "";
    for (int id = 0; id < GGML_ZIPMOE_OPTION_COUNT; id++) {
        const struct ggml_zipmoe_option * o = &k_options[id];
        const int need = o->requires;
        // a pool of 0 experts (an option left at 0) asks for nothing
        const bool asks = given[id] && !(o->type == GGML_ZIPMOE_TYPE_INT && values[id].i == 0 &&
                                         need == GGML_ZIPMOE_OPTION_EVICTION);
        if (need < 0 || !asks || (only_given && !given[need])) {
            continue;
        }
        if (effective(need, values, given) != o->requires_value) {
            const char * wanted = ggml_zipmoe_option_choice(need, o->requires_value);
            if (err != NULL && size > 0) {
                snprintf(err, size, "%s%s needs %s%s=%s", prefix, o->name, prefix, k_options[need].name, wanted);
            }
            return GGML_ZIPMOE_ERR_ARG;
        }
    }
    return GGML_ZIPMOE_OK;
}
