// ZipMoE fork: the model's expert cache (llama-zipmoe.h): made when the model loads, contexts attached and
// detached. How much memory it may take: llama-zipmoe-sizing.cpp; where its slots lie and how bytes reach
// them: llama-zipmoe-slots.cpp.

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

static std::string expert_tensor_name(int layer, int kind) {
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
            table[3 * l + k] = ggml_zipmoe_file_find_tensor(file, expert_tensor_name(l, k).c_str());
        }
    }
    return table;
}

static constexpr double k_mib = 1024.0 * 1024.0;

std::string llama_zipmoe_size_text(uint64_t bytes) {
    char buf[32];
    return ggml_zipmoe_size_text(bytes, buf, sizeof(buf));
}

// ggml-zipmoe's messages, in llama.cpp's log
static void log_serving(int level, const char * text, void * /*user_data*/) {
    if (level > 0) {
        LLAMA_LOG_WARN("%s: %s\n", "llama_zipmoe", text);
    } else {
        LLAMA_LOG_INFO("%s: %s\n", "llama_zipmoe", text);
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
    // the non-expert weights, which a GPU's memory holds beside its slots
    if (meta != nullptr) {
        for (int64_t i = 0; i < gguf_get_n_tensors(meta); ++i) {
            if (!is_chunk_tensor(gguf_get_tensor_name(meta, i))) {
                file_non_expert += gguf_get_tensor_size(meta, i);
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
    ggml_zipmoe_serving_params sp = {};
    sp.file          = file;
    sp.layer_tensors = layer_tensors.data();
    sp.n_layer       = (int32_t) (layer_tensors.size() / 3);
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

llama_zipmoe::~llama_zipmoe() {
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        for (const auto & of_kind : slots) {
            for (ggml_tensor * t : of_kind) {
                g_registry.erase(t);
            }
        }
    }
    ggml_zipmoe_cache_free(cache);
    ggml_zipmoe_serving_free(serving); // and the host slots it reserved
    ggml_zipmoe_file_close(file);
    if (plain_buf) {
        ggml_backend_buffer_free(plain_buf); // a view of buf's memory: frees nothing of it
    }
    if (slot_backend) {
        ggml_backend_free(slot_backend);
    }
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
    for (ggml_context * rc : resident_ctxs) {
        ggml_free(rc);
    }
}

ggml_tensor * llama_zipmoe::serve(const std::string & name, const std::initializer_list<int64_t> & ne) const {
    const int t = ggml_zipmoe_file_find_tensor(file, name.c_str());
    if (t < 0 || cache == nullptr) {
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
            return slots_of(ggml_zipmoe_file_tensor_layer(file, t), k);
        }
    }
    return nullptr;
}

ggml_tensor * llama_zipmoe::slots_of(int il, int kind) const {
    const int t = il >= 0 && 3 * il + kind < (int) layer_tensors.size() ? layer_tensors[3 * il + kind] : -1;
    const ggml_type type = t >= 0 ? (ggml_type) ggml_zipmoe_file_tensor_type(file, t) : GGML_TYPE_BF16;
    for (ggml_tensor * s : slots[kind]) {
        if (s->type == type) {
            return s;
        }
    }
    return slots[kind].empty() ? nullptr : slots[kind][0];
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

// the device whose memory holds the slots, or nullptr for host memory (sets on_device): the first served
// layer's placement, or a tensor override's for its experts (upstream matches overrides only for
// tensors the file holds, and the repacked experts are not among them)
ggml_backend_dev_t llama_zipmoe::slot_device(const layer_buft_fn & layer_buft,
                                             const llama_model_tensor_buft_override * overrides) {
    int first = 0;
    while (first < (int) layer_tensors.size() / 3 && layer_tensors[3 * first] < 0) {
        ++first;
    }
    ggml_backend_buffer_type_t buft = layer_buft(first);
    for (const auto * o = overrides; o && o->pattern != nullptr; ++o) {
        const std::regex pattern(o->pattern);
        if (std::regex_search(expert_tensor_name(first, 0), pattern) || std::regex_search(expert_tensor_name(first, 1), pattern) ||
            std::regex_search(expert_tensor_name(first, 2), pattern)) {
            buft = o->buft;
            break;
        }
    }
    // slots in a device's memory when the layer's weights go there (a CPU layer's list starts with the
    // GPU's pinned host buffer type, whose device is the GPU: host memory all the same); CUDA's are
    // recovered by ZipMoE's kernels where the build has them, any other device's through slot_write
    ggml_backend_dev_t dev = buft != nullptr ? ggml_backend_buft_get_device(buft) : nullptr;
    const enum ggml_backend_dev_type type = dev != nullptr ? ggml_backend_dev_type(dev) : GGML_BACKEND_DEVICE_TYPE_CPU;
    on_device  = dev != nullptr && !ggml_backend_buft_is_host(buft) &&
                 (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU);
    cuda_slots = on_device && strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "CUDA") == 0 &&
                 ggml_zipmoe_cuda_devices() > 0;
    return on_device ? dev : nullptr;
}

void llama_zipmoe::make_cache(const layer_buft_fn & layer_buft, const weight_buft_fn & weight_buft,
                              const llama_model_tensor_buft_override * overrides) {
    ggml_backend_dev_t dev = slot_device(layer_buft, overrides);
    if (on_device) {
        place_on_device(dev);
    } else {
        place_in_host(weight_buft);
    }

    ggml_zipmoe_cache_params cp = {};
    cp.file       = file;
    cp.n_slots    = info.capacity;
    cp.n_decoders = opt.threads;
    cp.eviction   = opt.eviction;
    cp.rank_delta = opt.rank_delta;
    std::copy(opt.pools, opt.pools + 4, cp.pool_capacity);
    for (int k = 0; k < 3; ++k) {
        cp.slot_data[k]   = slots[k][0]->data; // every type's slots of a kind lie over the same memory
        cp.slot_stride[k] = slots[k][0]->nb[2];
    }
    if (!fill_views.empty()) {
        cp.slot_fill = slot_fill;
    }
    cp.slot_fill_data = this;
    if (on_device && !cuda_slots) {
        cp.slot_write = slot_write;
        cp.slot_sync  = slot_backend != nullptr ? slot_sync : nullptr;
    }
    cp.n_layer       = (int32_t) (layer_tensors.size() / 3);
    cp.layer_tensors = layer_tensors.data();
    // a bank of half a token's experts, the best-scored of those the cache lacks: a decode step's
    // prediction names about half of them right (bench/prefetch_recall.py), and a bank's memory is
    // taken from the slots
    cp.prefetch_experts = opt.prefetch ? (n_expert_used + 1) / 2 : 0;
    // a ubatch whose experts take several passes (a prompt, several sequences) reads a bank of the next
    // pass's experts as this one decodes and computes: one token's worth, of the working slots' pass
    cp.lookahead_experts = n_expert_used;
    cp.slot_memory      = cuda_slots ? GGML_ZIPMOE_SLOTS_CUDA : on_device ? GGML_ZIPMOE_SLOTS_DEVICE : GGML_ZIPMOE_SLOTS_HOST;
    cp.slot_pages_movable = slots_in_own_mapping;
    char err[1024];
    cache = ggml_zipmoe_cache_new(&cp, err, sizeof(err));
    if (cache == nullptr) {
        throw std::runtime_error(err);
    }
    if (opt.substitution != GGML_ZIPMOE_SUBST_NONE) {
        ggml_zipmoe_cache_set_substitution(cache, opt.substitution, opt.smoe_alpha);
        ggml_zipmoe_cache_set_buddy_params(cache, &opt.buddy);
        log_substitution();
    }
    if (opt.trace_routing) {
        ggml_zipmoe_cache_trace_routing(cache, 1, opt.buddy.temperature, 0);
    }
    if (ggml_zipmoe_serving_set_cache(serving, cache, on_device, err, sizeof(err)) != GGML_ZIPMOE_OK) {
        throw std::runtime_error(err);
    }
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        for (const auto & of_kind : slots) {
            for (ggml_tensor * s : of_kind) {
                g_registry[s] = this;
            }
        }
    }
    const char * reads = ggml_zipmoe_file_is_direct(file) ? "with O_DIRECT" : "through the page cache";
    if (on_device) {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %d slots of %.2f MiB in %s memory (%s; all experts %.1f MiB%s); "
                       "chunks read %s, %s\n", __func__, info.capacity, info.expert_bytes / k_mib,
                       ggml_backend_dev_name(dev), ggml_backend_dev_description(dev), info.all_experts / k_mib,
                       opt.budget != 0 ? ", zipmoe.budget" : "", reads,
                       cuda_slots ? "exponents decoded on the CPU (codec ghuf: on the GPU), BF16 recovered on the GPU"
                                  : "decoded and recovered on the CPU, the BF16 experts sent to the device");
    } else {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %d slots of %.2f MiB reserved (all experts %.1f MiB%s%s%s); sized when "
                       "a context is made; chunks read %s\n", __func__, info.capacity, info.expert_bytes / k_mib,
                       info.all_experts / k_mib, info.raw ? ", stored raw" : "",
                       fill_views.empty() ? "" : ", laid out for ", fill_views.empty() ? "" : ggml_backend_buffer_name(buf),
                       reads);
    }
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
    if (cache == nullptr) {
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

void llama_zipmoe::preload(llama_context * lctx) {
    std::lock_guard<std::mutex> compute(compute_mutex);
    const int64_t t0 = ggml_time_us();
    int32_t n_loaded = 0;
    const int status = ggml_zipmoe_cache_preload(cache, std::max(1, (int) llama_n_threads_batch(lctx)), &n_loaded);
    const double seconds = (ggml_time_us() - t0) / 1e6;
    if (status != GGML_ZIPMOE_OK) {
        // the expert at fault fails again, with its name, if a token ever needs it
        LLAMA_LOG_WARN("%s: ZipMoE preload stopped after %d experts: %s\n", __func__, n_loaded,
                       ggml_zipmoe_cache_error(cache));
        return;
    }
    if (n_loaded == 0) { // a prompt reads the experts it needs
        LLAMA_LOG_INFO("%s: ZipMoE preload: nothing loaded: the slots in use do not hold every expert\n", __func__);
        return;
    }
    LLAMA_LOG_INFO("%s: ZipMoE preloaded %d experts (%.1f MiB of slots) in %.2f s\n", __func__, n_loaded,
                   (double) n_loaded * info.expert_bytes / k_mib, seconds);
    // every expert resident: the graphs may use the slots in place (rebuilt for it)
    const bool views = opt.resident_views == 1 || (opt.resident_views == -1 && on_device);
    if (views && !opt.with_pools() && !ggml_zipmoe_serving_auto_pools_active(serving)) {
        std::vector<int32_t> base;
        if (resident_bases(base)) {
            std::lock_guard<std::mutex> lock(state_mutex);
            views_wanted = true;
            layout++;
            LLAMA_LOG_INFO("%s: ZipMoE: every expert is resident: products use the slots in place, no fetch\n", __func__);
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
        if (!was_attached || cache == nullptr) {
            return;
        }
    }
    // where the time went, for programs that print no statistics of their own (llama-completion)
    ggml_zipmoe_cache_stats s;
    ggml_zipmoe_cache_get_stats(cache, &s);
    uint64_t predicted = 0, actual = 0, correct = 0;
    ggml_zipmoe_cache_get_prefetch_recall(cache, -1, &predicted, &actual, &correct);
    // a batch's own reads ahead predict nothing: "recall 0.00" would read as a predictor that never hits
    char recall[32] = "no prediction scored";
    if (actual > 0) {
        snprintf(recall, sizeof(recall), "recall %.2f", (double) correct / actual);
    }
    LLAMA_LOG_INFO("%s: ZipMoE expert cache so far: %llu fetches, %llu hits, %llu misses (%llu from C/S/E), %.1f MB "
                   "read (prefetch %.1f MB read, %.1f MB used, %llu experts served, %s); io %.1f ms, decode "
                   "%.1f ms, recover %.1f ms, fetch wall %.1f ms (fetch lock %.1f, plan %.1f, thread 0 decoding %.1f, "
                   "waiting for reads %.1f, waiting for the other threads %.1f; %llu page faults); %llu graphs, %.1f ms; %.1f MB to the slots' device; "
                   "preloaded %llu experts, %.1f MB read; stores' pages faulted in ahead %.1f MB in %.1f ms; moved from C/S to F "
                   "%llu experts in %.1f ms, %.1f MB of the stores' pages into their slots\n",
                   __func__,
                   (unsigned long long) s.fetch_calls, (unsigned long long) s.expert_hits,
                   (unsigned long long) s.expert_misses, (unsigned long long) (s.c_hits + s.s_hits + s.e_hits),
                   s.bytes_read / 1e6, s.prefetch_bytes_read / 1e6, s.prefetch_bytes_used / 1e6,
                   (unsigned long long) s.prefetch_hits, recall, s.io_ns / 1e6,
                   s.decode_ns / 1e6, s.recover_ns / 1e6, s.fetch_ns / 1e6, s.lock_wait_ns / 1e6, s.plan_ns / 1e6,
                   s.fetch_work_ns / 1e6, s.read_wait_ns / 1e6, s.finish_wait_ns / 1e6,
                   (unsigned long long) s.decode_faults, (unsigned long long) s.graphs, s.graph_ns / 1e6,
                   s.h2d_bytes / 1e6, (unsigned long long) s.preload_experts, s.preload_bytes_read / 1e6,
                   s.populate_bytes / 1e6, s.populate_ns / 1e6, (unsigned long long) s.migrate_experts,
                   s.migrate_ns / 1e6, s.moved_page_bytes / 1e6);
    try {
        resize(nullptr);
    } catch (const std::exception & e) {
        LLAMA_LOG_WARN("%s: %s\n", __func__, e.what());
    }
}

struct ggml_zipmoe_cache * llama_model_zipmoe_cache(const struct llama_model * model) {
    return model != nullptr && model->zipmoe ? model->zipmoe->cache : nullptr;
}

const char * llama_zipmoe_last_error(const struct llama_context * lctx) {
    const llama_model * model = lctx != nullptr ? llama_get_model(lctx) : nullptr;
    return model != nullptr && model->zipmoe ? model->zipmoe->last_error(lctx) : "";
}
