// ZipMoE fork: the model's expert cache (llama-zipmoe.h): made when the model loads, contexts attached and
// detached. How much memory it may take: llama-zipmoe-sizing.cpp; which device each layer's slots take:
// llama-zipmoe-sets.cpp; where a set's slots lie and how bytes reach them: llama-zipmoe-slots.cpp.

#include "llama-zipmoe.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-alloc.h"
#include "ggml-cpp.h"
#include "ggml-backend.h"
#include "ggml-zipmoe-options.h"
#include "gguf.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <regex>
#include <stdexcept>

const char * llama_zipmoe_build_info(void) {
    return ggml_zipmoe_build_info();
}

// slot tensor -> owner; looked up once per MoE layer when a graph is built
static std::mutex                                              g_registry_mutex;
static std::unordered_map<const ggml_tensor *, llama_zipmoe *> g_registry;

void llama_zipmoe_register_slots(const llama_zipmoe_slot_set & set, bool add) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    for (const auto & of_kind : set.slots) {
        for (ggml_tensor * s : of_kind) {
            if (add) {
                g_registry[s] = set.zm;
            } else {
                g_registry.erase(s);
            }
        }
    }
}

std::string llama_zipmoe_expert_tensor_name(int layer, int kind) {
    return format("blk.%d.ffn_%s_exps.weight", layer, k_zipmoe_kinds[kind]);
}

// each layer's gate, up and down tensors in the file (-1 where a layer has none), for the cache
static std::vector<int32_t> layer_tensor_table(const ggml_zipmoe_file * file) {
    int n_layer = 0;
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        n_layer = std::max(n_layer, ggml_zipmoe_file_tensor_layer(file, i) + 1);
    }
    std::vector<int32_t> table(3 * (size_t) n_layer);
    for (int l = 0; l < n_layer; ++l) {
        for (int k = 0; k < 3; ++k) {
            table[3 * l + k] = ggml_zipmoe_file_find_tensor(file, llama_zipmoe_expert_tensor_name(l, k).c_str());
        }
    }
    return table;
}

std::string llama_zipmoe_size_text(uint64_t bytes) {
    char buf[32];
    return ggml_zipmoe_size_text(bytes, buf, sizeof(buf));
}

// ggml-zipmoe's messages, in llama.cpp's log; a set's (user_data) name its device
static void log_serving(int level, const char * text, void * user_data) {
    const auto * set = (const llama_zipmoe_slot_set *) user_data;
    const std::string where = set != nullptr ? format("%s: ", set->device_name()) : "";
    if (level > 0) {
        LLAMA_LOG_WARN("%s: %s%s\n", "llama_zipmoe", where.c_str(), text);
    } else {
        LLAMA_LOG_INFO("%s: %s%s\n", "llama_zipmoe", where.c_str(), text);
    }
}

bool llama_zipmoe::is_zipmoe(const gguf_context * meta) {
    return meta != nullptr && gguf_find_key(meta, "zipmoe.format_version") >= 0;
}

void llama_zipmoe::warn_options_ignored(const std::string & fname,
                                        const std::unordered_map<std::string, llama_model_kv_override> & overrides) {
    const std::vector<std::string> names = llama_zipmoe_options::given_names(overrides);
    if (names.empty()) {
        return;
    }
    std::string list;
    for (const std::string & n : names) {
        list += (list.empty() ? "" : ", ") + n;
    }
    LLAMA_LOG_WARN("%s: %s is not a ZipMoE GGUF (no zipmoe.format_version): the ZipMoE options given (%s) do "
                   "nothing; convert it with zipmoe-convert to serve its experts under a budget\n", __func__,
                   fname.c_str(), list.c_str());
}

uint64_t llama_zipmoe::expert_params() const {
    uint64_t n = 0;
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        int64_t ne[3];
        ggml_zipmoe_file_tensor_shape(file, i, ne);
        n += (uint64_t) ne[0] * (uint64_t) ne[1] * (uint64_t) ne[2];
    }
    return n;
}

bool llama_zipmoe::is_chunk_tensor(const std::string & name) {
    static const std::string suffix = ".zipmoe";
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

llama_zipmoe * llama_zipmoe::of(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.find(t);
    return it == g_registry.end() ? nullptr : it->second;
}

// the model's top-k from the GGUF (1 if absent): an automatic size never keeps fewer slots
static int32_t expert_used_count(const gguf_context * meta) {
    const int64_t arch_key = meta != nullptr ? gguf_find_key(meta, "general.architecture") : -1;
    if (arch_key < 0 || gguf_get_kv_type(meta, arch_key) != GGUF_TYPE_STRING) {
        return 1;
    }
    const std::string key = std::string(gguf_get_val_str(meta, arch_key)) + ".expert_used_count";
    const int64_t k = gguf_find_key(meta, key.c_str());
    if (k < 0 || gguf_get_kv_type(meta, k) != GGUF_TYPE_UINT32) {
        return 1;
    }
    return std::max<int32_t>(1, (int32_t) std::min<uint32_t>(gguf_get_val_u32(meta, k), 1u << 16));
}

llama_zipmoe::llama_zipmoe(const std::string & fname, const gguf_context * meta,
                           const std::unordered_map<std::string, llama_model_kv_override> & overrides)
    : fname(fname), opt(llama_zipmoe_options::parse(overrides)), n_expert_used(expert_used_count(meta)) {
    // the non-expert weights, by layer: a device's memory holds its layers' beside its slots
    if (meta != nullptr) {
        for (int64_t i = 0; i < gguf_get_n_tensors(meta); ++i) {
            const char * name = gguf_get_tensor_name(meta, i);
            if (is_chunk_tensor(name)) {
                continue;
            }
            const uint64_t bytes = gguf_get_tensor_size(meta, i);
            file_non_expert += bytes;
            int il = -1;
            if (sscanf(name, "blk.%d.", &il) == 1 && il >= 0 && il < (1 << 16)) {
                layer_non_expert.resize(std::max<size_t>(layer_non_expert.size(), (size_t) il + 1), 0);
                layer_non_expert[il] += bytes;
            } else {
                other_non_expert += bytes;
            }
        }
        const int64_t tokens = gguf_find_key(meta, "tokenizer.ggml.tokens");
        n_vocab = tokens >= 0 ? (uint64_t) gguf_get_arr_n(meta, tokens) : 0;
    }

    char err[1024];
    // O_DIRECT by default: reads through the page cache would compete, under a memory limit, with the
    // mapped non-expert weights (and cost page-cache reclaim on every read)
    const unsigned flags = opt.direct_io == 1 ? (unsigned) GGML_ZIPMOE_OPEN_DIRECT :
                           opt.direct_io == 0 ? 0u : (unsigned) GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED;
    file = ggml_zipmoe_file_open(fname.c_str(), flags, err, sizeof(err));
    if (file == nullptr) {
        throw std::runtime_error(err);
    }
    layer_tensors = layer_tensor_table(file);

    // what this process may take is measured now, before the model's weights are mapped
    const ggml_zipmoe_serving_params sp = serving_params(layer_tensors);
    serving = ggml_zipmoe_serving_new(&sp, err, sizeof(err));
    if (serving == nullptr) {
        ggml_zipmoe_file_close(file);
        throw std::runtime_error(err);
    }
    ggml_zipmoe_serving_get_info(serving, &info);
    try {
        check_load_fits();
    } catch (...) {
        ggml_zipmoe_serving_free(serving);
        ggml_zipmoe_file_close(file);
        throw;
    }
}

ggml_zipmoe_serving_params llama_zipmoe::serving_params(const std::vector<int32_t> & table) const {
    ggml_zipmoe_serving_params sp = {};
    sp.file          = file;
    sp.layer_tensors = table.data();
    sp.n_layer       = (int32_t) (table.size() / 3);
    sp.n_expert_used = n_expert_used;
    sp.mem_limit     = opt.mem_limit;
    sp.budget        = opt.budget;
    sp.budget_name   = opt.budget_source.c_str();
    std::copy(opt.pools, opt.pools + 4, sp.pools);
    sp.work_slots    = opt.work_slots;
    sp.eviction      = opt.eviction;
    sp.threads       = opt.threads;
    sp.auto_pools    = opt.auto_pools;
    sp.device_stores = opt.device_stores;
    sp.replan_tokens = opt.replan_tokens;
    sp.log           = log_serving;
    return sp;
}

llama_zipmoe::~llama_zipmoe() {
    const bool serving_in_a_set = std::any_of(sets.begin(), sets.end(), [&](const auto & set) {
        return set->serving == serving;
    });
    sets.clear(); // their caches, servings and slots
    if (!serving_in_a_set) {
        ggml_zipmoe_serving_free(serving);
    }
    ggml_zipmoe_file_close(file);
    for (ggml_context * rc : resident_ctxs) {
        ggml_free(rc);
    }
}

ggml_tensor * llama_zipmoe::serve(const std::string & name, const std::initializer_list<int64_t> & ne) const {
    const int t = ggml_zipmoe_file_find_tensor(file, name.c_str());
    const llama_zipmoe_slot_set * set = t >= 0 ? set_of(ggml_zipmoe_file_tensor_layer(file, t)) : nullptr;
    if (set == nullptr || set->cache == nullptr) {
        return nullptr;
    }
    int64_t shape[3];
    ggml_zipmoe_file_tensor_shape(file, t, shape);
    std::vector<int64_t> want(ne);
    if (want.size() != 3 || want[0] != shape[0] || want[1] != shape[1] || want[2] != shape[2]) {
        throw std::runtime_error(format("%s: ZipMoE tensor %s is %lld x %lld x %lld, the model expects another shape",
                                        fname.c_str(), name.c_str(), (long long) shape[0], (long long) shape[1],
                                        (long long) shape[2]));
    }
    for (int k = 0; k < 3; ++k) {
        if (name.find(std::string("ffn_") + k_zipmoe_kinds[k] + "_exps") != std::string::npos) {
            return set->slots_of(ggml_zipmoe_file_tensor_layer(file, t), k);
        }
    }
    return nullptr;
}

void llama_zipmoe::log_substitution() const {
    const std::string params = opt.substitution == GGML_ZIPMOE_SUBST_SMOE
        ? format("alpha %.3g", opt.smoe_alpha)
        : format("tau %s, rho %d, beta %.3g, H %d; its buddy profile is given after load (zipmoe_py)",
                 opt.buddy.tau < 0 ? "calibrated" : format("%.3g", opt.buddy.tau).c_str(), opt.buddy.rho,
                 opt.buddy.beta, opt.buddy.search);
    LLAMA_LOG_WARN("%s: ZipMoE expert substitution '%s' (%s) is LOSSY: it replaces some of the experts the router "
                   "chose with resident ones, so outputs differ from the model's\n", __func__,
                   ggml_zipmoe_substitution_name(opt.substitution), params.c_str());
}

llama_zipmoe::context_state & llama_zipmoe::state_of(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto & st = contexts[lctx];
    if (!st) {
        st = std::make_unique<context_state>();
        st->zm = this;
    }
    return *st;
}

void llama_zipmoe::attach(llama_context * lctx) {
    if (sets.empty()) {
        return;
    }
    uint64_t host = 0;
    for (const auto & [buft, mb] : lctx->memory_breakdown()) {
        if (buft != nullptr && ggml_backend_buft_is_host(buft)) {
            host += mb.context + mb.compute;
        }
    }
    context_state & st = state_of(lctx);
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        st.host_bytes = host;
        st.attached   = true;
        n_threads_max = std::max({ n_threads_max, (int32_t) llama_n_threads(lctx), (int32_t) llama_n_threads_batch(lctx) });
    }
    try {
        resize(lctx);
    } catch (...) {
        std::lock_guard<std::mutex> lock(state_mutex);
        contexts.erase(lctx);
        throw;
    }
    // the first context of a model that computes (not a dry run sizing buffers) fills the slots
    if (opt.preload && !preloaded && !llama_get_model(lctx)->hparams.no_alloc) {
        preloaded = true;
        preload(lctx);
    }
}

// each set's slots filled, where they hold every expert of its layers
void llama_zipmoe::preload(llama_context * lctx) {
    std::lock_guard<std::mutex> compute(compute_mutex);
    for (const auto & set : sets) {
        const std::string where = sets.size() > 1 ? format(" (%s)", set->device_name()) : "";
        const int64_t t0 = ggml_time_us();
        int32_t n_loaded = 0;
        const int status = ggml_zipmoe_cache_preload(set->cache, std::max(1, (int) llama_n_threads_batch(lctx)), &n_loaded);
        const double seconds = (ggml_time_us() - t0) / 1e6;
        if (status != GGML_ZIPMOE_OK) {
            // the expert at fault fails again, with its name, if a token ever needs it
            LLAMA_LOG_WARN("%s: ZipMoE preload%s stopped after %d experts: %s\n", __func__, where.c_str(), n_loaded,
                           ggml_zipmoe_cache_error(set->cache));
            continue;
        }
        if (n_loaded == 0) { // a prompt reads the experts it needs
            LLAMA_LOG_INFO("%s: ZipMoE preload%s: nothing loaded: the slots in use do not hold every expert\n", __func__,
                           where.c_str());
            continue;
        }
        LLAMA_LOG_INFO("%s: ZipMoE preloaded%s %d experts (%.1f MiB of slots) in %.2f s\n", __func__, where.c_str(),
                       n_loaded, (double) n_loaded * set->info.expert_bytes / k_zipmoe_mib, seconds);
        // every expert resident: the graphs may use the slots in place (rebuilt for it)
        if (opt.resident_views && !opt.with_pools() && !ggml_zipmoe_serving_auto_pools_active(set->serving)) {
            std::vector<int32_t> base;
            if (resident_bases(*set, base)) {
                std::lock_guard<std::mutex> lock(state_mutex);
                set->views_wanted = true;
                layout++;
                LLAMA_LOG_INFO("%s: ZipMoE: every expert%s is resident: products use the slots in place, no fetch\n",
                               __func__, sets.size() > 1 ? format(" in %s", set->device_name()).c_str() : "");
            }
        }
    }
}

void llama_zipmoe::detach(llama_context * lctx) {
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        auto it = contexts.find(lctx);
        if (it == contexts.end()) {
            return;
        }
        const bool was_attached = it->second->attached;
        contexts.erase(it);
        if (!was_attached || sets.empty()) {
            return;
        }
    }
    for (const auto & set : sets) {
        log_statistics(*set, sets.size() > 1);
    }
    try {
        resize(nullptr);
    } catch (const std::exception & e) {
        LLAMA_LOG_WARN("%s: %s\n", __func__, e.what());
    }
}

// where the time went, for programs that print no statistics of their own (llama-completion)
void llama_zipmoe::log_statistics(const llama_zipmoe_slot_set & set, bool name_the_device) {
    ggml_zipmoe_cache * cache = set.cache;
    ggml_zipmoe_cache_stats s;
    ggml_zipmoe_cache_get_stats(cache, &s);
    uint64_t predicted = 0, actual = 0, correct = 0;
    ggml_zipmoe_cache_get_prefetch_recall(cache, -1, &predicted, &actual, &correct);
    // a batch's own reads ahead predict nothing: "recall 0.00" would read as a predictor that never hits
    char recall[32] = "no prediction scored";
    if (actual > 0) {
        snprintf(recall, sizeof(recall), "recall %.2f", (double) correct / actual);
    }
    const std::string where = name_the_device ? format(" of %s", set.device_name()) : "";
    // zipmoe.cpu_compute: what the balancer gave the CPU, and the measured cost of a copy it weighed
    const std::string cpu_text = set.n_cpu_slots == 0 ? "" :
        format("; %llu experts computed on the CPU (zipmoe.cpu_compute, the CPU's rounding; %.2f ms each a token, "
               "a copy to the device %.2f ms)", (unsigned long long) s.cpu_experts, set.cpu_token_s * 1e3,
               s.device_experts > 0 ? s.device_ns / 1e6 / s.device_experts : 0.0);
    LLAMA_LOG_INFO("%s: ZipMoE expert cache%s so far: %llu fetches, %llu hits, %llu misses (%llu from C/S/E), %.1f MB "
                   "read (prefetch %.1f MB read, %.1f MB used, %llu experts served, %s); io %.1f ms, decode "
                   "%.1f ms, recover %.1f ms, fetch wall %.1f ms (fetch lock %.1f, plan %.1f, thread 0 decoding %.1f, "
                   "waiting for reads %.1f, waiting for the other threads %.1f; %llu page faults); %llu graphs, %.1f ms; %.1f MB to the slots' device; "
                   "preloaded %llu experts, %.1f MB read; stores' pages faulted in ahead %.1f MB in %.1f ms; moved from C/S to F "
                   "%llu experts in %.1f ms, %.1f MB of the stores' pages into their slots%s\n",
                   "detach", where.c_str(),
                   (unsigned long long) s.fetch_calls, (unsigned long long) s.expert_hits,
                   (unsigned long long) s.expert_misses, (unsigned long long) (s.c_hits + s.s_hits + s.e_hits),
                   s.bytes_read / 1e6, s.prefetch_bytes_read / 1e6, s.prefetch_bytes_used / 1e6,
                   (unsigned long long) s.prefetch_hits, recall, s.io_ns / 1e6,
                   s.decode_ns / 1e6, s.recover_ns / 1e6, s.fetch_ns / 1e6, s.lock_wait_ns / 1e6, s.plan_ns / 1e6,
                   s.fetch_work_ns / 1e6, s.read_wait_ns / 1e6, s.finish_wait_ns / 1e6,
                   (unsigned long long) s.decode_faults, (unsigned long long) s.graphs, s.graph_ns / 1e6,
                   s.h2d_bytes / 1e6, (unsigned long long) s.preload_experts, s.preload_bytes_read / 1e6,
                   s.populate_bytes / 1e6, s.populate_ns / 1e6, (unsigned long long) s.migrate_experts,
                   s.migrate_ns / 1e6, s.moved_page_bytes / 1e6, cpu_text.c_str());
}

const char * llama_zipmoe_last_error(const struct llama_context * lctx) {
    const llama_model * model = lctx != nullptr ? llama_get_model(lctx) : nullptr;
    return model != nullptr && model->zipmoe ? model->zipmoe->last_error(lctx) : "";
}
