// The expert cache's statistics and the memory sizing in Prometheus' text format, for llama-server's
// /metrics (llama_model_zipmoe_metrics joins the two; the fork's patch appends them after llama.cpp's
// own). Names and help texts are defined here once.
#include "ggml-zipmoe.h"
#include "ggml-zipmoe-serving.h"

#include <stdarg.h>
#include <stdio.h>

struct metrics_text {
    char * buf;
    size_t size;
    size_t len;  // what the whole text needs, even past size
};

static void put(struct metrics_text * t, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char * at = t->len < t->size ? t->buf + t->len : NULL;
    const int n = vsnprintf(at, at ? t->size - t->len : 0, fmt, ap);
    va_end(ap);
    if (n > 0) {
        t->len += (size_t) n;
    }
}

// an empty text in buf (which may be NULL with size 0: only the length is counted)
static struct metrics_text text_in(char * buf, size_t size) {
    struct metrics_text t = { buf, buf ? size : 0, 0 };
    if (t.size > 0) {
        t.buf[0] = '\0';
    }
    return t;
}

static void put_header(struct metrics_text * t, const char * type, const char * name, const char * help) {
    put(t, "# HELP zipmoe:%s %s\n# TYPE zipmoe:%s %s\n", name, help, name, type);
}

static void put_count(struct metrics_text * t, const char * type, const char * name, const char * help,
                      uint64_t value) {
    put_header(t, type, name, help);
    put(t, "zipmoe:%s %llu\n", name, (unsigned long long) value);
}

static void put_seconds(struct metrics_text * t, const char * name, const char * help, uint64_t ns) {
    put_header(t, "counter", name, help);
    put(t, "zipmoe:%s %llu.%09llu\n", name, (unsigned long long) (ns / 1000000000u),
        (unsigned long long) (ns % 1000000000u));
}

size_t ggml_zipmoe_cache_format_metrics(const struct ggml_zipmoe_cache * cache, char * buf, size_t size) {
    struct metrics_text t = text_in(buf, size);
    if (cache == NULL) {
        return 0;
    }
    struct ggml_zipmoe_cache_stats s;
    ggml_zipmoe_cache_get_stats(cache, &s);

    const struct { const char * name; const char * help; uint64_t value; } counters[] = {
        { "expert_hits_total",   "Routed-expert selections found whole in a slot", s.expert_hits },
        { "expert_misses_total", "Routed-expert selections read from the file", s.expert_misses },
        { "fetches_total",       "Expert fetches begun (one per MoE layer per pass)", s.fetch_calls },
        { "bytes_read_total",    "Stored chunk bytes read from the file", s.bytes_read },
        { "prefetch_hits_total", "Selections whose missing chunks a prefetch had read", s.prefetch_hits },
        { "prefetch_bytes_read_total", "Stored bytes prefetches read", s.prefetch_bytes_read },
        { "prefetch_bytes_used_total", "Prefetched bytes a fetch used", s.prefetch_bytes_used },
        { "h2d_bytes_total",     "Bytes copied host to device for slots in a device's memory", s.h2d_bytes },
        { "fetch_page_faults_total", "Page faults of the decoding threads while fetching", s.decode_faults },
        { "graphs_total",        "Graphs of the model computed (build, fetches and compute)", s.graphs },
        { "populate_bytes_total", "Store pages a helper thread faulted in ahead of their first write", s.populate_bytes },
        { "migrated_experts_total", "Experts a change of pools decoded from C into F instead of reading them again",
                                    s.migrate_experts },
        { "moved_page_bytes_total", "Store pages a change of pools moved into the slots it filled (no first write)",
                                    s.moved_page_bytes },
        { "substitutions_total", "LOSSY: selections a substitution policy replaced (0 unless a lossy mode is on)",
                                 s.substitutions },
        { "cpu_experts_total", "Experts the CPU computed where held instead of the device (zipmoe.cpu_compute: the "
                               "CPU's rounding; 0 unless it is on)", s.cpu_experts },
    };
    for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
        put_count(&t, "counter", counters[i].name, counters[i].help, counters[i].value);
    }
    put_seconds(&t, "read_seconds_total", "Time in chunk reads", s.io_ns);
    put_seconds(&t, "decode_seconds_total", "Time decoding exponent chunks, summed over threads", s.decode_ns);
    put_seconds(&t, "recover_seconds_total", "Time recovering BF16 weights, summed over threads", s.recover_ns);
    put_seconds(&t, "fetch_wait_seconds_total", "Time the graph waited in expert fetches", s.fetch_ns);
    put_seconds(&t, "populate_seconds_total", "Time a helper thread spent faulting store pages in", s.populate_ns);
    put_seconds(&t, "migrate_seconds_total", "Wall time of the changes of pools that decoded C into F", s.migrate_ns);
    put_seconds(&t, "graph_seconds_total", "Wall time of the model's graphs, fetches included", s.graph_ns);
    // the fetch wait by part (they add up to fetch_wait_seconds_total)
    put(&t, "# HELP zipmoe:fetch_wait_part_seconds_total Where the expert fetches' wait went on the graph's critical "
            "path\n# TYPE zipmoe:fetch_wait_part_seconds_total counter\n");
    const char * part_names[5] = { "lock", "plan", "decode", "reads", "threads" };
    const uint64_t part_ns[5] = { s.lock_wait_ns, s.plan_ns, s.fetch_work_ns, s.read_wait_ns, s.finish_wait_ns };
    for (int i = 0; i < 5; i++) {
        put(&t, "zipmoe:fetch_wait_part_seconds_total{part=\"%s\"} %llu.%09llu\n", part_names[i],
            (unsigned long long) (part_ns[i] / 1000000000u), (unsigned long long) (part_ns[i] % 1000000000u));
    }

    put(&t, "# HELP zipmoe:store_hits_total Selections found in a compressed-store pool (C: no read, S: exponent "
            "chunks read, E: sign-mantissa chunks read)\n# TYPE zipmoe:store_hits_total counter\n");
    const char pools[3] = { 'C', 'S', 'E' };
    const uint64_t hits[3] = { s.c_hits, s.s_hits, s.e_hits };
    for (int i = 0; i < 3; i++) {
        put(&t, "zipmoe:store_hits_total{pool=\"%c\"} %llu\n", pools[i], (unsigned long long) hits[i]);
    }

    put_count(&t, "gauge", "slots_in_use",  "Expert slots in use", (uint64_t) ggml_zipmoe_cache_n_slots(cache));
    put_count(&t, "gauge", "slot_capacity", "Expert slots reserved", (uint64_t) ggml_zipmoe_cache_slot_capacity(cache));
    return t.len;
}

size_t ggml_zipmoe_serving_format_metrics(const struct ggml_zipmoe_serving_plan * plan, char * buf, size_t size) {
    struct metrics_text t = text_in(buf, size);
    if (plan == NULL) {
        return 0;
    }
    put_header(&t, "gauge", "memory_bytes", "The last memory sizing: available - non_expert - contexts - "
               "cache_buffers - margin = fits, what is left for expert slots; budget is zipmoe.budget (0: none given)");
    const struct { const char * part; uint64_t value; } parts[] = {
        { "available", plan->available }, { "non_expert", plan->non_expert }, { "contexts", plan->contexts },
        { "cache_buffers", plan->cache_buffers }, { "margin", plan->margin }, { "fits", plan->fits },
        { "budget", plan->budget },
    };
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        put(&t, "zipmoe:memory_bytes{part=\"%s\"} %llu\n", parts[i].part, (unsigned long long) parts[i].value);
    }
    put_count(&t, "gauge", "expert_slot_bytes", "One expert's slot (gate + up + down, as served: BF16 or the file's type)", plan->expert_bytes);
    put_count(&t, "gauge", "contexts", "Live contexts the sizing counts", (uint64_t) plan->n_contexts);
    // the pools in use (the last plan or re-plan): all 0 is one F pool of every slot
    put_header(&t, "gauge", "pool_experts", "Experts per MoE layer in each pool (F full, C compressed, S sign-mantissa "
               "chunks, E exponent chunks); all 0: one F pool of every slot");
    for (int i = 0; i < 4; i++) {
        put(&t, "zipmoe:pool_experts{pool=\"%c\"} %d\n", "FCSE"[i], plan->pools[i]);
    }
    return t.len;
}
