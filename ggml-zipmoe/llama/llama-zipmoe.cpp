// ZipMoE fork: the glue between llama.cpp and ggml-zipmoe (see llama-zipmoe.h).

#include "llama-zipmoe.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-zipmoe.h"
#include "gguf.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

const char * llama_zipmoe_build_info(void) {
    return ggml_zipmoe_build_info();
}

// slot tensor -> owner; looked up once per MoE layer when a graph is built
static std::mutex                                              g_registry_mutex;
static std::unordered_map<const ggml_tensor *, llama_zipmoe *> g_registry;

// the routed experts' tensors in llama.cpp's names, by enum ggml_zipmoe_expert_kind
static const char * const k_kinds[3] = { "gate", "up", "down" };

static std::string expert_tensor_name(int layer, int kind) {
    return format("blk.%d.ffn_%s_exps.weight", layer, k_kinds[kind]);
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
static constexpr double k_gib = 1024.0 * 1024.0 * 1024.0;

//
// memory
//

// resident set of this process (VmRSS), 0 if unknown
static uint64_t resident_bytes() {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
        unsigned long long kb = 0;
        if (sscanf(line.c_str(), "VmRSS: %llu kB", &kb) == 1) {
            return (uint64_t) kb * 1024;
        }
    }
    return 0;
}

static std::string gib(uint64_t bytes) {
    return format("%.2f GiB", bytes / k_gib);
}

//
// llama_zipmoe
//

bool llama_zipmoe::is_zipmoe(const gguf_context * meta) {
    return meta != nullptr && gguf_find_key(meta, "zipmoe.format_version") >= 0;
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

llama_zipmoe::llama_zipmoe(const std::string & fname, const gguf_context * meta,
                           const std::unordered_map<std::string, llama_model_kv_override> & overrides)
    : fname(fname), opt(llama_zipmoe_options::parse(overrides)) {
    // the model's top-k: an automatic budget never keeps fewer slots than one token's experts of a layer
    if (meta != nullptr) {
        const int64_t arch_key = gguf_find_key(meta, "general.architecture");
        if (arch_key >= 0 && gguf_get_kv_type(meta, arch_key) == GGUF_TYPE_STRING) {
            const std::string key = std::string(gguf_get_val_str(meta, arch_key)) + ".expert_used_count";
            const int64_t k = gguf_find_key(meta, key.c_str());
            if (k >= 0 && gguf_get_kv_type(meta, k) == GGUF_TYPE_UINT32) {
                n_expert_used = std::max<int32_t>(1, (int32_t) std::min<uint32_t>(gguf_get_val_u32(meta, k), 1u << 16));
            }
        }
    }

    // what this process may take, measured before the model's weights are mapped
    ggml_zipmoe_memory mem;
    ggml_zipmoe_memory_available(nullptr, &mem);
    available_at_load = mem.available;
    if (mem.cgroup_version != 0 && mem.cgroup_limit != UINT64_MAX && mem.available < mem.mem_available) {
        memory_source = format("cgroup v%d %s: limit %s, %s in use", mem.cgroup_version, mem.cgroup_path,
                               gib(mem.cgroup_limit).c_str(), gib(mem.cgroup_used).c_str());
    } else {
        memory_source = "MemAvailable";
    }
    if (opt.mem_limit != 0) {
        const uint64_t rss = resident_bytes();
        const uint64_t left = opt.mem_limit > rss ? opt.mem_limit - rss : 0;
        if (left < available_at_load) {
            available_at_load = left;
            memory_source = format("zipmoe.mem_limit %s, %s resident", gib(opt.mem_limit).c_str(), gib(rss).c_str());
        }
    }
    if (available_at_load == UINT64_MAX) {
        available_at_load = 0; // unknown: the budget then falls back to its minimum, with a warning
        memory_source = "unknown (no /proc/meminfo, no cgroup limit)";
    }

    // the non-expert weights, which a GPU's memory holds beside its slots
    if (meta != nullptr) {
        for (int64_t i = 0; i < gguf_get_n_tensors(meta); ++i) {
            if (!is_chunk_tensor(gguf_get_tensor_name(meta, i))) {
                file_non_expert += gguf_get_tensor_size(meta, i);
            }
        }
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
}

llama_zipmoe::~llama_zipmoe() {
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        for (ggml_tensor * t : slots) {
            g_registry.erase(t);
        }
    }
    ggml_zipmoe_cache_free(cache);
    ggml_zipmoe_file_close(file);
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (mapping) {
        munmap(mapping, mapping_bytes);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

int32_t llama_zipmoe::slots_for(uint64_t budget) const {
    return (int32_t) std::min<uint64_t>(budget / expert_bytes, (uint64_t) INT32_MAX);
}

ggml_tensor * llama_zipmoe::serve(const std::string & name, const std::initializer_list<int64_t> & ne,
                                  ggml_backend_buffer_type_t buft) {
    const int t = ggml_zipmoe_file_find_tensor(file, name.c_str());
    if (t < 0) {
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
    int kind = -1;
    for (int k = 0; k < 3; ++k) {
        if (name.find(std::string("ffn_") + k_kinds[k] + "_exps") != std::string::npos) {
            kind = k;
        }
    }
    if (kind < 0) {
        return nullptr;
    }
    if (cache != nullptr) {
        return slots[kind];
    }

    // every layer's experts share one slot shape per kind (ggml_zipmoe_cache_new checks it)
    int64_t kind_ne[3][3] = {};
    const int layer = ggml_zipmoe_file_tensor_layer(file, t);
    for (int k = 0; k < 3; ++k) {
        const int tk = ggml_zipmoe_file_find_tensor(file, expert_tensor_name(layer, k).c_str());
        if (tk < 0) {
            throw std::runtime_error(format("%s: %s is repacked but its layer's %s experts are not", fname.c_str(),
                                            name.c_str(), k_kinds[k]));
        }
        ggml_zipmoe_file_tensor_shape(file, tk, kind_ne[k]);
        expert_bytes += (size_t) kind_ne[k][0] * kind_ne[k][1] * sizeof(uint16_t);
    }
    int32_t most = 0; // experts of the largest MoE layer
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        int64_t s[3];
        ggml_zipmoe_file_tensor_shape(file, i, s);
        all_experts += (uint64_t) s[0] * s[1] * s[2] * sizeof(uint16_t);
        n_moe_layers += strstr(ggml_zipmoe_file_tensor_name(file, i), "ffn_gate_exps") != nullptr;
        most = std::max<int32_t>(most, (int32_t) s[2]);
    }
    const int32_t all_slots = std::max<int32_t>(1, slots_for(all_experts));
    if (opt.with_pools()) {
        // pools hold experts per MoE layer: more than a layer has is a mistake (a slot count?), and
        // would reserve memory no expert ever uses
        const int64_t held = (int64_t) opt.pools[0] + opt.pools[1] + opt.pools[2] + opt.pools[3];
        if (held > most) {
            throw std::runtime_error(format("zipmoe.pool_f/c/s/e (F %d, C %d, S %d, E %d) hold %lld experts per MoE "
                                            "layer, more than the %d a layer of %s has", opt.pools[0], opt.pools[1],
                                            opt.pools[2], opt.pools[3], (long long) held, most, fname.c_str()));
        }
    }

    // the slots the tensors hold; how many are in use is decided per context (attach)
    int32_t capacity;
    if (opt.with_pools()) {
        capacity = opt.pools[0] * n_moe_layers + opt.work_slots;
    } else if (opt.budget != 0) {
        if (opt.budget < expert_bytes) {
            throw std::runtime_error(format("zipmoe.budget of %llu bytes cannot hold one expert (%zu bytes: gate + up + down)",
                                            (unsigned long long) opt.budget, expert_bytes));
        }
        capacity = std::min(slots_for(opt.budget), all_slots); // more slots than experts would never be used
    } else {
        capacity = std::max(std::min(all_slots, slots_for(available_at_load)), std::min(all_slots, n_expert_used));
    }

    // slots in a CUDA device's memory when the layer's weights go there (a CPU layer's list starts
    // with the GPU's pinned host buffer type, whose device is the GPU: host memory all the same)
    ggml_backend_dev_t dev = buft != nullptr ? ggml_backend_buft_get_device(buft) : nullptr;
    const bool gpu_layer = dev != nullptr && !ggml_backend_buft_is_host(buft) &&
                           ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU;
    const bool cuda_layer = gpu_layer && strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "CUDA") == 0;
    on_gpu = cuda_layer && ggml_zipmoe_cuda_devices() > 0;
    if (gpu_layer && !on_gpu) {
        LLAMA_LOG_WARN("%s: the MoE layers go to %s, but this ZipMoE build puts expert slots only in CUDA memory "
                       "(built %s CUDA): the slots stay in host memory\n", __func__, ggml_backend_dev_name(dev),
                       ggml_zipmoe_cuda_devices() > 0 ? "with" : "without");
    }
    if (on_gpu) {
        size_t free_bytes = 0, total_bytes = 0;
        ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
        // zero slots beyond the cache's: the rows a pass does not compute (absent_slot)
        gpu_zero_slots = most;
        // the non-expert weights, KV cache and compute buffers, cuBLAS' workspace, the zero slots
        const uint64_t reserve = file_non_expert + (1ull << 30) + free_bytes / 16 + (uint64_t) gpu_zero_slots * expert_bytes;
        const int32_t fit = slots_for(free_bytes > reserve ? free_bytes - reserve : 0);
        const int32_t fewest = std::min(all_slots, n_expert_used);
        if (!opt.with_pools() && opt.budget == 0) {
            capacity = std::max(std::min(all_slots, fit), fewest);
        } else if (!opt.with_pools() && capacity > fit) {
            const int32_t n = std::max(fit, fewest);
            LLAMA_LOG_WARN("%s: zipmoe.budget of %s does not fit in %s's %s free beside %s of other weights and "
                           "buffers: %d slots (%s)\n", __func__, gib(opt.budget).c_str(), ggml_backend_dev_name(dev),
                           gib(free_bytes).c_str(), gib(reserve).c_str(), n, gib((uint64_t) n * expert_bytes).c_str());
            capacity = n;
        }
        gpu_zero_slot = capacity;

        const size_t align = 256;
        size_t off = 0;
        for (int k = 0; k < 3; ++k) {
            section[k] = off;
            off += GGML_PAD((size_t) (capacity + gpu_zero_slots) * kind_ne[k][0] * kind_ne[k][1] * sizeof(uint16_t), align);
        }
        buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), off);
        if (buf == nullptr) {
            throw std::runtime_error(format("cannot allocate %s of %s memory for %d ZipMoE expert slots (%s free): give "
                                            "a smaller zipmoe.budget or fewer GPU layers", gib(off).c_str(),
                                            ggml_backend_dev_name(dev), capacity, gib(free_bytes).c_str()));
        }
        ggml_backend_buffer_clear(buf, 0);
    }

    // address space for every slot, committed only where a slot is written (MAP_NORESERVE); where
    // the kernel refuses that much, fewer slots
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (; !on_gpu;) {
        size_t off = 0;
        for (int k = 0; k < 3; ++k) {
            section[k] = off;
            off += GGML_PAD((size_t) capacity * kind_ne[k][0] * kind_ne[k][1] * sizeof(uint16_t), page);
        }
        mapping_bytes = off;
        mapping = mmap(nullptr, mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (mapping != MAP_FAILED) {
            break;
        }
        mapping = nullptr;
        if (capacity <= std::min(n_expert_used, capacity) || capacity <= 1) {
            throw std::runtime_error(format("cannot reserve address space for the ZipMoE expert cache (%d slots, %.1f MiB): %s",
                                            capacity, mapping_bytes / k_mib, strerror(errno)));
        }
        capacity = std::max(1, capacity / 2);
    }

    ggml_init_params params = { /*.mem_size =*/ 3 * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    ctx = ggml_init(params);
    if (!on_gpu) {
        buf = ggml_backend_cpu_buffer_from_ptr(mapping, mapping_bytes);
    }
    if (ctx == nullptr || buf == nullptr) {
        throw std::runtime_error("cannot make the ZipMoE slot tensors");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    char * base = on_gpu ? (char *) ggml_backend_buffer_get_base(buf) : (char *) mapping;
    for (int k = 0; k < 3; ++k) {
        slots[k] = ggml_new_tensor_3d(ctx, GGML_TYPE_BF16, kind_ne[k][0], kind_ne[k][1], capacity + gpu_zero_slots);
        ggml_format_name(slots[k], "zipmoe.slots.%s", k_kinds[k]);
        if (ggml_backend_tensor_alloc(buf, slots[k], base + section[k]) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("cannot place the ZipMoE slot tensors");
        }
    }

    ggml_zipmoe_cache_params cp = {};
    cp.file       = file;
    cp.n_slots    = capacity;
    cp.n_decoders = opt.threads;
    cp.eviction   = opt.eviction;
    cp.rank_delta = opt.rank_delta;
    std::copy(opt.pools, opt.pools + 4, cp.pool_capacity);
    for (int k = 0; k < 3; ++k) {
        cp.slot_data[k]   = slots[k]->data;
        cp.slot_stride[k] = slots[k]->nb[2];
    }
    const std::vector<int32_t> layer_tensors = layer_tensor_table(file);
    cp.n_layer       = (int32_t) (layer_tensors.size() / 3);
    cp.layer_tensors = layer_tensors.data();
    // a bank of half a token's experts, the best-scored of those the cache lacks: a decode step's
    // prediction names about half of them right (bench/prefetch_recall.py), and a bank's memory is
    // taken from the slots
    cp.prefetch_experts = opt.prefetch ? (n_expert_used + 1) / 2 : 0;
    cp.slot_memory      = on_gpu ? GGML_ZIPMOE_SLOTS_CUDA : GGML_ZIPMOE_SLOTS_HOST;
    char err[1024];
    cache = ggml_zipmoe_cache_new(&cp, err, sizeof(err));
    if (cache == nullptr) {
        throw std::runtime_error(err);
    }
    if (opt.substitution != GGML_ZIPMOE_SUBST_NONE) {
        ggml_zipmoe_cache_set_substitution(cache, opt.substitution, opt.smoe_alpha);
        ggml_zipmoe_cache_set_buddy_params(cache, &opt.buddy);
        const std::string params = opt.substitution == GGML_ZIPMOE_SUBST_SMOE
            ? format("alpha %.3g", opt.smoe_alpha)
            : format("tau %s, rho %d, beta %.3g, H %d; its buddy profile is given after load (zipmoe_py)",
                     opt.buddy.tau < 0 ? "calibrated" : format("%.3g", opt.buddy.tau).c_str(), opt.buddy.rho,
                     opt.buddy.beta, opt.buddy.search);
        LLAMA_LOG_WARN("%s: ZipMoE expert substitution '%s' (%s) is LOSSY: it replaces some of the experts the "
                       "router chose with resident ones, so outputs differ from the model's\n", __func__,
                       ggml_zipmoe_substitution_name(opt.substitution), params.c_str());
    }
    if (opt.trace_routing) {
        ggml_zipmoe_cache_trace_routing(cache, 1, opt.buddy.temperature, 0);
    }
    if (opt.with_pools()) {
        uint64_t total = 0;
        std::string layout_text;
        for (int p = 0; p < 4; ++p) {
            size_t entry = 0;
            const int n = ggml_zipmoe_cache_pool_entries(cache, p, &entry);
            total += (uint64_t) n * entry;
            layout_text += format("%s%s %d x %.2f MiB", p ? ", " : "", ggml_zipmoe_pool_name(p), n, entry / k_mib);
        }
        total += (uint64_t) opt.work_slots * expert_bytes;
        layout_text += format(", %d working slots", opt.work_slots);
        if (opt.budget != 0 && total > opt.budget) {
            throw std::runtime_error(format("zipmoe.pool_* and zipmoe.work_slots need %.1f MiB (%s), more than "
                                            "zipmoe.budget's %.1f MiB", total / k_mib, layout_text.c_str(),
                                            opt.budget / k_mib));
        }
        LLAMA_LOG_INFO("%s: ZipMoE expert cache pools: %s = %.1f MiB\n", __func__, layout_text.c_str(), total / k_mib);
    }
    // until a context says how much memory is left, the fewest slots: the graphs a context
    // reserves its buffers with then have the most passes
    n_slots_used = opt.with_pools() || on_gpu ? capacity : std::min(capacity, n_expert_used);
    ggml_zipmoe_cache_set_n_slots(cache, n_slots_used);
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        for (ggml_tensor * s : slots) {
            g_registry[s] = this;
        }
    }
    if (on_gpu) {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %d slots of %.2f MiB in %s memory (all experts %.1f MiB%s); chunks "
                       "read %s, exponents decoded on the CPU (codec ghuf: on the GPU), BF16 recovered on the GPU\n", __func__, capacity,
                       expert_bytes / k_mib, ggml_backend_dev_name(dev), all_experts / k_mib,
                       opt.budget != 0 ? ", zipmoe.budget" : "",
                       ggml_zipmoe_file_is_direct(file) ? "with O_DIRECT" : "through the page cache");
    } else {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %d slots of %.2f MiB reserved (all experts %.1f MiB); sized when a "
                       "context is made; chunks read %s\n", __func__, capacity, expert_bytes / k_mib,
                       all_experts / k_mib, ggml_zipmoe_file_is_direct(file) ? "with O_DIRECT" : "through the page cache");
    }
    return slots[kind];
}

void llama_zipmoe::check_model(const llama_model & model) {
    gate_inp.assign(model.layers.size(), nullptr);
    ffn_norm.assign(model.layers.size(), nullptr);
    for (size_t il = 0; il < model.layers.size(); ++il) {
        const llama_layer & l = model.layers[il];
        if (l.ffn_down_exps == nullptr || of(l.ffn_down_exps) != this) {
            continue;
        }
        gate_inp[il] = l.ffn_gate_inp;
        ffn_norm[il] = l.ffn_norm;
        const bool unsupported = l.ffn_gate_exps_b || l.ffn_up_exps_b || l.ffn_down_exps_b || l.ffn_gate_up_exps ||
                                 l.ffn_gate_up_exps_b || l.ffn_gate_exps_s || l.ffn_up_exps_s || l.ffn_down_exps_s;
        if (unsupported) {
            throw std::runtime_error(format("%s: layer %zu's routed experts have biases, per-expert scales or a merged "
                                            "gate_up tensor, which ZipMoE's expert slots do not serve", fname.c_str(), il));
        }
    }
    // the weights a decode step reads from host memory: all but the token embedding, of which it
    // reads a row per token (unless the output matrix is the embedding itself)
    non_expert_bytes = 0;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t == model.tok_embd && model.output != nullptr && model.output != model.tok_embd) {
            continue;
        }
        if (t->buffer != nullptr && !ggml_backend_buffer_is_host(t->buffer)) {
            continue;
        }
        non_expert_bytes += ggml_nbytes(t);
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
        std::lock_guard<std::mutex> compute(compute_mutex);
        const int64_t t0 = ggml_time_us();
        int32_t n_loaded = 0;
        const int status = ggml_zipmoe_cache_preload(cache, std::max(1, (int) llama_n_threads_batch(lctx)), &n_loaded);
        const double seconds = (ggml_time_us() - t0) / 1e6;
        if (status != GGML_ZIPMOE_OK) {
            // the expert at fault fails again, with its name, if a token ever needs it
            LLAMA_LOG_WARN("%s: ZipMoE preload stopped after %d experts: %s\n", __func__, n_loaded,
                           ggml_zipmoe_cache_error(cache));
        } else {
            LLAMA_LOG_INFO("%s: ZipMoE preloaded %d experts (%.1f MiB of slots) in %.2f s\n", __func__, n_loaded,
                           (double) n_loaded * expert_bytes / k_mib, seconds);
        }
        // every expert resident: the graphs may use the slots in place (rebuilt for it)
        const bool views = opt.resident_views == 1 || (opt.resident_views == -1 && on_gpu);
        if (status == GGML_ZIPMOE_OK && views && !opt.with_pools() && !auto_active) {
            std::vector<int32_t> base;
            if (resident_bases(base)) {
                std::lock_guard<std::mutex> lock(state_mutex);
                views_wanted = true;
                layout++;
                LLAMA_LOG_INFO("%s: ZipMoE: every expert is resident: products use the slots in place, no fetch\n",
                               __func__);
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
        if (!was_attached || cache == nullptr) {
            return;
        }
    }
    // where the time went, for programs that print no statistics of their own (llama-completion)
    ggml_zipmoe_cache_stats s;
    ggml_zipmoe_cache_get_stats(cache, &s);
    uint64_t predicted = 0, actual = 0, correct = 0;
    ggml_zipmoe_cache_get_prefetch_recall(cache, -1, &predicted, &actual, &correct);
    LLAMA_LOG_INFO("%s: ZipMoE expert cache so far: %llu fetches, %llu hits, %llu misses (%llu from C/S/E), %.1f MB "
                   "read (prefetch %.1f MB read, %.1f MB used, %llu experts served, recall %.2f); io %.1f ms, decode "
                   "%.1f ms, recover %.1f ms, fetch wall %.1f ms; %.1f MB to the GPU\n", __func__,
                   (unsigned long long) s.fetch_calls, (unsigned long long) s.expert_hits,
                   (unsigned long long) s.expert_misses, (unsigned long long) (s.c_hits + s.s_hits + s.e_hits),
                   s.bytes_read / 1e6, s.prefetch_bytes_read / 1e6, s.prefetch_bytes_used / 1e6,
                   (unsigned long long) s.prefetch_hits, actual ? (double) correct / actual : 0.0, s.io_ns / 1e6,
                   s.decode_ns / 1e6, s.recover_ns / 1e6, s.fetch_ns / 1e6, s.h2d_bytes / 1e6);
    try {
        resize(nullptr);
    } catch (const std::exception & e) {
        LLAMA_LOG_WARN("%s: %s\n", __func__, e.what());
    }
}

int llama_zipmoe::use_slots(int32_t n, ggml_zipmoe_default_pools * pools) {
    const int32_t old = n_slots_used;
    const int status = pools != nullptr ? ggml_zipmoe_cache_set_pools(cache, pools->capacity, n, pools->inclusive)
                                        : ggml_zipmoe_cache_set_n_slots(cache, n);
    if (status != GGML_ZIPMOE_OK && status != GGML_ZIPMOE_ERR_NOMEM) {
        return status; // refused before anything changed
    }
    if (status == GGML_ZIPMOE_ERR_NOMEM) {
        // the stores could not be allocated: the cache fell back to one F pool of n slots
        LLAMA_LOG_WARN("%s: ZipMoE pools could not be made (%s): one F pool\n", __func__, ggml_zipmoe_cache_error(cache));
        snprintf(pools->why, sizeof(pools->why), "one F pool: the planned stores could not be allocated");
        memset(pools->capacity, 0, sizeof(pools->capacity));
    }
    n_slots_used = n;
    if (n < old) {
        // give the memory of the slots given up back to the system
        const size_t page = (size_t) sysconf(_SC_PAGESIZE);
        for (int k = 0; k < 3; ++k) {
            const size_t stride = slots[k]->nb[2];
            const size_t lo = GGML_PAD(section[k] + (size_t) n * stride, page);
            const size_t hi = (section[k] + (size_t) old * stride) / page * page;
            if (hi > lo) {
                madvise((char *) mapping + lo, hi - lo, MADV_DONTNEED);
            }
        }
    }
    return GGML_ZIPMOE_OK;
}

void llama_zipmoe::resize(const llama_context * making) {
    std::lock_guard<std::mutex> compute(compute_mutex);
    uint64_t contexts_bytes = 0;
    int      n_contexts     = 0;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        for (const auto & [c, st] : contexts) {
            if (st->attached) {
                contexts_bytes += st->host_bytes;
                n_contexts++;
            }
        }
    }
    // the stores of C, S and E are sized with the slots, from what is left beside the cache's other buffers
    uint64_t stores = 0;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; ++p) {
        size_t entry = 0;
        stores += (uint64_t) std::max(0, ggml_zipmoe_cache_pool_entries(cache, p, &entry)) * entry;
    }
    const uint64_t extra  = ggml_zipmoe_cache_extra_bytes(cache, n_threads_max);
    const uint64_t own    = opt.with_pools() || extra < stores ? extra : extra - stores;
    const uint64_t margin = (64ull << 20) + available_at_load / 32; // heap growth, readahead, allocator slack
    const uint64_t fixed  = non_expert_bytes + contexts_bytes + own + margin;
    const uint64_t fits   = available_at_load > fixed ? available_at_load - fixed : 0;
    const int32_t  capacity = ggml_zipmoe_cache_slot_capacity(cache);
    const std::string sums = format("available %s (%s) - non-expert weights %s - %d context(s) %s - ZipMoE buffers %s "
                                    "- margin %s = %s", gib(available_at_load).c_str(), memory_source.c_str(),
                                    gib(non_expert_bytes).c_str(), n_contexts, gib(contexts_bytes).c_str(),
                                    gib(own).c_str(), gib(margin).c_str(), gib(fits).c_str());
    int32_t n = capacity;
    const int32_t fewest = opt.with_pools() || on_gpu ? capacity : std::min(capacity, n_expert_used);
    if (on_gpu) {
        // the slots take device memory, allocated when the model loaded; the stores' host memory
        // is the cache's own buffers above
    } else if (opt.with_pools()) {
        const uint64_t need = (uint64_t) capacity * expert_bytes;
        if (need > fits && making != nullptr) {
            throw std::runtime_error(format("the ZipMoE pools need %s of slots (%d F experts per layer x %d layers + %d "
                                            "working slots) beside %s of stores, but only %s is left: %s. Give smaller "
                                            "zipmoe.pool_* / zipmoe.work_slots, a smaller context, or more memory",
                                            gib(need).c_str(), opt.pools[0], n_moe_layers, opt.work_slots,
                                            gib(own).c_str(), gib(fits).c_str(), sums.c_str()));
        }
    } else {
        const int32_t fit = slots_for(fits);
        if (opt.budget != 0) {
            if (capacity > fit) {
                n = std::max(std::min(capacity, fewest), fit);
                LLAMA_LOG_WARN("%s: zipmoe.budget of %s does not fit: %s; using %d slots (%s)\n", __func__,
                               gib(opt.budget).c_str(), sums.c_str(), n, gib((uint64_t) n * expert_bytes).c_str());
            }
        } else {
            n = std::min(capacity, std::max(fewest, fit));
            if (fit < fewest) {
                LLAMA_LOG_WARN("%s: memory is short for the ZipMoE expert cache: %s; keeping the minimum of %d slots "
                               "(one token's experts of a layer); weights will be paged from disk\n", __func__,
                               sums.c_str(), n);
            }
        }
    }

    // the pools for that memory: compressed experts kept where full ones no longer fit
    ggml_zipmoe_default_pools choice = {};
    bool use_pools = false;
    if (opt.with_pools()) {
        snprintf(choice.why, sizeof(choice.why), "the pools given (zipmoe.pool_* or a zipmoe-plan file)");
    } else if (on_gpu) {
        snprintf(choice.why, sizeof(choice.why), "one F pool: the slots are in GPU memory");
    } else if (!opt.auto_pools) {
        snprintf(choice.why, sizeof(choice.why), "one F pool: zipmoe.auto_pools is off");
    } else if (opt.eviction != GGML_ZIPMOE_EVICT_RANK) {
        snprintf(choice.why, sizeof(choice.why), "one F pool: pools dispatch by rank, and zipmoe.eviction is %s",
                 ggml_zipmoe_eviction_name(opt.eviction));
    } else {
        auto_eligible = true;
        const uint64_t budget  = opt.budget != 0 ? std::min(opt.budget, fits) : fits;
        const int32_t  threads = opt.threads > 0 ? opt.threads : std::max<int32_t>(1, n_threads_max);
        // the rates of the first plan (the defaults, or those given): the pools change with the memory
        // left, not with each measurement of the disk
        if (plan_rates[0] == 0) {
            plan_rates[0] = ggml_zipmoe_cache_rate(cache, GGML_ZIPMOE_RATE_READ);
            plan_rates[1] = ggml_zipmoe_cache_rate(cache, GGML_ZIPMOE_RATE_DECODE);
        }
        auto_budget  = budget;
        auto_threads = threads;
        if (ggml_zipmoe_cache_default_pools(cache, budget, n_expert_used, threads, opt.work_slots, plan_rates[0],
                                            plan_rates[1], replanned ? observed_profile.data() : nullptr, &choice) ==
                GGML_ZIPMOE_OK &&
            choice.capacity[1] + choice.capacity[2] + choice.capacity[3] > 0) {
            if (choice.n_slots <= capacity && choice.n_slots >= fewest) {
                use_pools = true;
                n = choice.n_slots;
            } else {
                snprintf(choice.why, sizeof(choice.why), "one F pool: the planned %d slots are outside the %d to %d "
                         "reserved", choice.n_slots, fewest, capacity);
                memset(choice.capacity, 0, sizeof(choice.capacity));
            }
        }
    }
    const bool pools_changed = use_pools != auto_active ||
                               (use_pools && memcmp(choice.capacity, auto_choice.capacity, sizeof(choice.capacity)) != 0);
    const bool changed = n != n_slots_used || pools_changed;
    if (changed) {
        if (!use_pools) {
            memset(choice.capacity, 0, sizeof(choice.capacity)); // one F pool
        }
        if (use_slots(n, pools_changed ? &choice : nullptr) != GGML_ZIPMOE_OK) {
            throw std::runtime_error(ggml_zipmoe_cache_error(cache));
        }
        use_pools = choice.capacity[1] + choice.capacity[2] + choice.capacity[3] > 0;
    }
    if (use_pools && (changed || making != nullptr)) {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache pools per MoE layer: F %d, C %d, S %d, E %d, %d working slots: %s\n",
                       __func__, choice.capacity[0], choice.capacity[1], choice.capacity[2], choice.capacity[3],
                       n - choice.capacity[0] * n_moe_layers, choice.why);
    }
    auto_active = use_pools;
    auto_choice = choice;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        layout += changed; // graphs built for another slot count must be rebuilt
        plan = {};
        plan.available     = available_at_load;
        plan.non_expert    = non_expert_bytes;
        plan.contexts      = contexts_bytes;
        plan.cache_buffers = own;
        plan.margin        = margin;
        plan.fits          = fits;
        plan.budget        = opt.budget;
        plan.expert_bytes  = expert_bytes;
        plan.n_contexts    = n_contexts;
        plan.n_slots       = n;
        plan.slot_capacity = capacity;
        plan.min_slots     = fewest;
        snprintf(plan.source, sizeof(plan.source), "%s", memory_source.c_str());
        std::copy(opt.with_pools() ? opt.pools : choice.capacity, (opt.with_pools() ? opt.pools : choice.capacity) + 4,
                  plan.pools);
        snprintf(plan.pools_why, sizeof(plan.pools_why), "%s", choice.why);
    }
    LLAMA_LOG_INFO("%s: ZipMoE expert cache: %d of %d slots in use, %.1f MiB (%s%s)\n", __func__, n, capacity,
                   (double) n * expert_bytes / k_mib, opt.budget != 0 ? "zipmoe.budget; " : "", sums.c_str());
}

llama_zipmoe::op_args * llama_zipmoe::args_for(int il, int pass) {
    std::lock_guard<std::mutex> lock(state_mutex);
    const int64_t key = (int64_t) il << 32 | (uint32_t) pass;
    auto it = args_index.find(key);
    if (it != args_index.end()) {
        return it->second;
    }
    args.push_back({ this, il, pass });
    args_index[key] = &args.back();
    return &args.back();
}

void llama_zipmoe::fail(const char * message) {
    if (!failed.exchange(true)) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        failure = message;
    }
}

// no correct output is possible without the expert: the graph stops (abort_callback) and the
// message, which names the chunk at fault, reaches the caller
static void zipmoe_check(const llama_zipmoe::op_args * a, int status) {
    if (status != GGML_ZIPMOE_OK) {
        a->zm->fail(ggml_zipmoe_cache_error(a->zm->cache));
    }
}

static void zipmoe_fetch_begin_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a   = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids = dst->src[0];
    int32_t *           out = (int32_t *) dst->data;
    // whatever happens, the products never see an out-of-range id: a failed fetch computes nothing
    for (int64_t i = 0; i < ggml_nelements(dst); ++i) {
        out[i] = GGML_ZIPMOE_NO_SLOT;
    }
    const ggml_tensor * scores = a->pass == 0 ? dst->src[1] : nullptr; // zipmoe.eviction=score
    if (scores != nullptr) {
        ggml_zipmoe_cache_observe_scores(a->zm->cache, a->il, (const float *) scores->data, scores->ne[0], scores->ne[1],
                                         scores->nb[1] / sizeof(float));
    }
    zipmoe_check(a, ggml_zipmoe_cache_fetch_begin(a->zm->cache, a->il, a->pass, (const int32_t *) ids->data,
                                                  ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t), out));
}

// passes the slot ids on once the slots are filled, so that the products depend on it
static void zipmoe_fetch_end_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * a = (const llama_zipmoe::op_args *) userdata;
    zipmoe_check(a, ggml_zipmoe_cache_fetch_end(a->zm->cache, ith, nth));
    if (ith == 0) {
        memcpy(dst->data, dst->src[0]->data, ggml_nbytes(dst));
        if (a->zm->absent_slot(0, 1) != GGML_ZIPMOE_NO_SLOT) { // slots in GPU memory only
            int32_t * ids = (int32_t *) dst->data;
            for (int64_t i = 0; i < ggml_nelements(dst); ++i) {
                ids[i] = ids[i] == GGML_ZIPMOE_NO_SLOT ? a->zm->absent_slot(i, dst->ne[0]) : ids[i];
            }
        }
    }
}

static void zipmoe_merge_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a    = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids  = dst->src[0];
    const ggml_tensor * cur  = dst->src[1];
    const ggml_tensor * acc  = dst->src[2];
    // build_experts made these tensors alike; a graph that breaks that stops with an error
    if (!ggml_are_same_shape(cur, dst) || !ggml_are_same_stride(cur, dst) ||
        (acc != nullptr && (!ggml_are_same_shape(acc, dst) || !ggml_are_same_stride(acc, dst)))) {
        a->zm->fail(format("layer %d, pass %d: the merged products differ in shape", a->il, a->pass).c_str());
        return;
    }
    const int status = ggml_zipmoe_cache_merge_pass(a->zm->cache, a->il, a->pass, (const int32_t *) ids->data,
                                                    ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t),
                                                    acc ? acc->data : nullptr, cur->data, dst->data,
                                                    ggml_row_size(dst->type, dst->ne[0]), dst->nb[1], dst->nb[2]);
    if (status != GGML_ZIPMOE_OK) {
        a->zm->fail(format("layer %d, pass %d: merging the passes' products failed: %s", a->il, a->pass,
                           ggml_zipmoe_status_string(status)).c_str());
    }
}

static void zipmoe_prefetch_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const auto *        a   = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids = dst->src[0];
    if (ith == 0) {
        // advisory: a prediction that cannot be read ahead (ERR_ARG) costs the fetch nothing
        ggml_zipmoe_cache_prefetch(a->zm->cache, a->il, (const int32_t *) ids->data, ids->ne[0], ids->ne[1],
                                   ids->nb[1] / sizeof(int32_t));
    }
}

// the substitution hook (lossy, opt-in): the router's ids with the cache's policy applied
static void zipmoe_substitute_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a      = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids    = dst->src[0];
    const ggml_tensor * scores = dst->src[1];
    const int status = ggml_zipmoe_cache_substitute(a->zm->cache, a->il, (const float *) scores->data, scores->ne[0],
                                                    scores->nb[1] / sizeof(float), (const int32_t *) ids->data,
                                                    ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t),
                                                    (int32_t *) dst->data);
    if (status != GGML_ZIPMOE_OK) {
        for (int64_t i = 0; i < ggml_nelements(dst); ++i) { // in range: the graph stops (fail) before the products
            ((int32_t *) dst->data)[i] = 0;
        }
        a->zm->fail(format("layer %d: expert substitution failed: %s", a->il, ggml_zipmoe_status_string(status)).c_str());
    }
}

ggml_tensor * llama_zipmoe::substitute(ggml_context * ctx0, int il, ggml_tensor * probs, ggml_tensor * selected,
                                      ggml_tensor ** weight_ids) {
    if ((opt.substitution == GGML_ZIPMOE_SUBST_NONE && !opt.trace_routing) || cache == nullptr || !ggml_zipmoe_cache_has_layer(cache, il) ||
        probs == nullptr || probs->type != GGML_TYPE_F32 || selected->type != GGML_TYPE_I32 ||
        ggml_n_dims(probs) > 2 || probs->ne[0] != ggml_zipmoe_cache_n_expert(cache, il) ||
        probs->ne[1] != selected->ne[1] || probs->nb[0] != sizeof(float) || selected->nb[0] != sizeof(int32_t)) {
        return selected;
    }
    ggml_tensor * srcs[2] = { selected, probs };
    ggml_tensor * out = ggml_custom_4d(ctx0, GGML_TYPE_I32, selected->ne[0], selected->ne[1], 1, 1, srcs, 2,
                                       zipmoe_substitute_op, 1, args_for(il, 0));
    ggml_format_name(out, "zipmoe_substitute-%d", il);
    // BuddyMoE's Alg. 1 rewrites the expert indices only: a buddy computes with the weight the router
    // gave the expert it stands in for. SMoE's router chooses its alternatives: they weigh their own scores
    if (weight_ids != nullptr && opt.substitution == GGML_ZIPMOE_SUBST_BUDDY) {
        *weight_ids = selected;
    }
    return out;
}

// SMoE's top-score prediction: the next MoE layer's router applied to this layer's FFN input, taken
// to the next layer's FFN norm (RMS norm is per-token scale-invariant and top-k ignores a positive
// scale, so the ratio of the two norms' weights is all that differs). The residual stream changes
// little from one layer to the next, so the top-k of these scores mostly names the experts the next
// router will choose. The op runs after this layer's fetch began: its reads go after the fetch's.
void llama_zipmoe::build_prefetch(ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                  ggml_tensor * after, int64_t n_used) {
    int next = il + 1;
    while (next < (int) gate_inp.size() && gate_inp[next] == nullptr) {
        ++next;
    }
    if (!opt.prefetch || next >= (int) gate_inp.size() || ffn_inp == nullptr || ffn_inp->ne[1] != 1 ||
        !ggml_is_contiguous(ffn_inp) || gate_inp[next]->ne[0] != ffn_inp->ne[0]) {
        return;
    }
    ggml_tensor * x = ggml_reshape_2d(ctx0, ffn_inp, ffn_inp->ne[0], ffn_inp->ne[2]);
    if (ffn_norm[il] != nullptr && ffn_norm[next] != nullptr && ggml_are_same_shape(ffn_norm[il], ffn_norm[next]) &&
        ffn_norm[il]->ne[0] == x->ne[0] && ffn_norm[il]->type == GGML_TYPE_F32 && ffn_norm[next]->type == GGML_TYPE_F32) {
        x = ggml_mul(ctx0, x, ggml_div(ctx0, ffn_norm[next], ffn_norm[il]));
    }
    ggml_tensor * scores = ggml_mul_mat(ctx0, gate_inp[next], x); // [n_expert, n_tokens]
    const int64_t k = std::min<int64_t>(n_used, scores->ne[0]);
    ggml_tensor * predicted = ggml_argsort_top_k(ctx0, scores, (int) k);
    ggml_tensor * srcs[2] = { predicted, after };
    ggml_tensor * op = ggml_custom_4d(ctx0, GGML_TYPE_I32, 1, 1, 1, 1, srcs, 2, zipmoe_prefetch_op, 1, args_for(next, 0));
    ggml_format_name(op, "zipmoe_prefetch-%d", next);
    ggml_build_forward_expand(gf, op);
}

bool llama_zipmoe::resident_bases(std::vector<int32_t> & base) {
    base.assign(gate_inp.size(), -1);
    bool any = false;
    for (int il = 0; il < (int) base.size(); ++il) {
        if (!ggml_zipmoe_cache_has_layer(cache, il)) {
            continue;
        }
        base[il] = ggml_zipmoe_cache_resident_base(cache, il);
        if (base[il] < 0) {
            return false; // one layer fetching could evict another's experts from under its views
        }
        any = true;
    }
    return any;
}

ggml_tensor * llama_zipmoe::build_experts(ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                          ggml_tensor * selected_experts, ggml_tensor * probs,
                                          const experts_fn & build) {
    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];
    int32_t view_base = -1;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        built[gf] = layout;
        if (views_wanted && views_layout != layout) {
            // once per slot layout: every layer in place, or none used in place
            if (!resident_bases(views_base)) {
                views_base.assign(gate_inp.size(), -1);
            }
            views_layout = layout;
        }
        if (views_wanted && il < (int) views_base.size()) {
            view_base = views_base[il];
        }
    }
    if (view_base >= 0) {
        // every expert resident, in order: stock's products on views of the slots, no fetch op (nothing
        // is read or evicted while every layer is in place; a resize changes the layout and rebuilds)
        const int64_t n_expert = ggml_zipmoe_cache_n_expert(cache, il);
        ggml_tensor * v[3];
        for (int k = 0; k < 3; ++k) {
            v[k] = ggml_view_3d(ctx0, slots[k], slots[k]->ne[0], slots[k]->ne[1], n_expert, slots[k]->nb[1],
                                slots[k]->nb[2], (size_t) view_base * slots[k]->nb[2]);
            ggml_format_name(v[k], "zipmoe.resident.%s-%d", k_kinds[k], il);
        }
        return build(selected_experts, v[0], v[1], v[2]);
    }
    const int n_passes = ggml_zipmoe_cache_n_passes(cache, il, n_used * n_tokens);
    if (probs != nullptr && probs->ne[0] == 1 && ggml_is_contiguous(probs)) {
        probs = ggml_reshape_2d(ctx0, probs, probs->ne[1], probs->ne[2]); // build_moe_ffn's [1, n_expert, n_tokens]
    }
    ggml_tensor * scores = opt.eviction == GGML_ZIPMOE_EVICT_SCORE && probs != nullptr && probs->type == GGML_TYPE_F32 &&
                           probs->ne[1] == n_tokens && probs->ne[0] == ggml_zipmoe_cache_n_expert(cache, il) ? probs : nullptr;

    ggml_tensor * merged = nullptr;
    for (int pass = 0; pass < n_passes; ++pass) {
        // a pass's fetch must wait for the previous pass's products: they share the slots; the first
        // takes the router's scores when the eviction policy is score's
        ggml_tensor * second = pass > 0 ? merged : scores;
        ggml_tensor * srcs[2] = { selected_experts, second };
        ggml_tensor * begin = ggml_custom_4d(ctx0, GGML_TYPE_I32, n_used, n_tokens, 1, 1, srcs, second ? 2 : 1,
                                             zipmoe_fetch_begin_op, 1, args_for(il, pass));
        ggml_format_name(begin, "zipmoe_fetch_begin-%d.%d", il, pass);
        if (pass == 0) {
            ggml_build_forward_expand(gf, begin);
            build_prefetch(ctx0, gf, il, ffn_inp, begin, n_used);
        }
        ggml_tensor * slot_ids = ggml_custom_4d(ctx0, GGML_TYPE_I32, n_used, n_tokens, 1, 1, &begin, 1,
                                                zipmoe_fetch_end_op, GGML_N_TASKS_MAX, args_for(il, pass));
        ggml_format_name(slot_ids, "zipmoe_slot_ids-%d.%d", il, pass);
        ggml_tensor * out = build(slot_ids, slots[0], slots[1], slots[2]);
        if (n_passes == 1) {
            return out;
        }
        ggml_tensor * msrcs[3] = { selected_experts, out, merged };
        merged = ggml_custom_4d(ctx0, out->type, out->ne[0], out->ne[1], out->ne[2], out->ne[3], msrcs, merged ? 3 : 2,
                                zipmoe_merge_op, 1, args_for(il, pass));
        ggml_format_name(merged, "zipmoe_merged-%d.%d", il, pass);
    }
    return merged;
}

uint32_t llama_zipmoe::graph_extra_nodes(uint32_t n_tokens, uint32_t n_expert_used_max) const {
    if (cache == nullptr) {
        return 0;
    }
    // the narrowest pass resize ever makes (the fewest slots in use with one F pool, the working
    // slots with pools): a graph reserved now stays big enough after it
    const int32_t capacity = ggml_zipmoe_cache_slot_capacity(cache);
    const int64_t fewest   = std::min<int64_t>(opt.with_pools() ? capacity : std::min(capacity, n_expert_used),
                                               std::max(1, opt.work_slots));
    uint32_t total = 0;
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        if (strstr(ggml_zipmoe_file_tensor_name(file, i), "ffn_down_exps") == nullptr) {
            continue;
        }
        const int     il       = ggml_zipmoe_file_tensor_layer(file, i);
        const int64_t n_ids    = (int64_t) n_tokens * n_expert_used_max;
        const int64_t distinct = std::min<int64_t>(n_ids, ggml_zipmoe_cache_n_expert(cache, il));
        const int64_t passes   = std::max<int64_t>(1, (distinct + fewest - 1) / fewest);
        // fetch begin and end + merge + the ~16 nodes of one experts block, per pass; the prefetch's
        // reshape, norm ratio (div, mul), scores, argsort, top-k view and op
        total += 19u * (uint32_t) passes + (opt.prefetch ? 8u : 0u) +
                 (opt.substitution != GGML_ZIPMOE_SUBST_NONE || opt.trace_routing ? 1u : 0u);
    }
    return total;
}

std::unique_lock<std::mutex> llama_zipmoe::lock_compute() {
    return std::unique_lock<std::mutex>(compute_mutex);
}

bool llama_zipmoe::graph_is_current(const ggml_cgraph * gf) const {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto it = built.find(gf);
    return it != built.end() && it->second == layout;
}

ggml_status llama_zipmoe::finish_compute(llama_context * lctx, ggml_status status) {
    // a graph stopped between a fetch's begin and end (by the user's abort callback, or a failed
    // begin) left the fetch open: its reads stop and its slots are forgotten
    ggml_zipmoe_cache_cancel(cache);
    context_state & st = state_of(lctx);
    st.error.clear();
    if (failed.load()) {
        {
            std::lock_guard<std::mutex> lock(failure_mutex);
            st.error = "ZipMoE: " + failure;
            failure.clear();
        }
        failed.store(false);
        LLAMA_LOG_ERROR("%s: %s\n", __func__, st.error.c_str());
        return GGML_STATUS_FAILED;
    }
    if (status == GGML_STATUS_SUCCESS) {
        observe_routing();
    }
    return status;
}

// the default pools, planned once more from the routing seen: after zipmoe.replan_tokens decode
// steps (ubatches of one token) the rank-based inclusion probabilities of those steps replace the
// built-in uniform profile. Called after a graph, under compute_mutex: no fetch is open.
void llama_zipmoe::observe_routing() {
    if (!auto_eligible || replanned || opt.replan_tokens == 0 || cache == nullptr) {
        return;
    }
    const int n_layer = (int) gate_inp.size();
    if (seen_counts.empty()) {
        for (int il = 0; il < n_layer; ++il) {
            n_exp_seen = std::max(n_exp_seen, ggml_zipmoe_cache_n_expert(cache, il));
        }
        seen_counts.assign((size_t) n_layer * n_exp_seen, 0);
        seen_ubatches.assign(n_layer, 0);
        token_counts.assign((size_t) n_layer * n_exp_seen, 0);
        counts.assign((size_t) n_layer * n_exp_seen, 0);
        ubatches.assign(n_layer, 0);
    }
    const int32_t n_exp = n_exp_seen;
    if (n_exp == 0) {
        return;
    }
    // this graph's selections per layer: a decode step of one token selects n_expert_used in each
    bool one_token = true, any = false;
    for (int il = 0; il < n_layer; ++il) {
        if (!ggml_zipmoe_cache_has_layer(cache, il)) {
            continue;
        }
        ggml_zipmoe_cache_get_activations(cache, il, counts.data() + (size_t) il * n_exp, &ubatches[il]);
        uint64_t selected = 0;
        for (int32_t e = 0; e < n_exp; ++e) {
            selected += counts[(size_t) il * n_exp + e] - seen_counts[(size_t) il * n_exp + e];
        }
        const uint64_t steps = ubatches[il] - seen_ubatches[il];
        any |= steps > 0;
        one_token &= steps == 1 && selected <= (uint64_t) n_expert_used;
    }
    if (one_token && any) {
        for (size_t i = 0; i < counts.size(); ++i) {
            token_counts[i] += (double) (counts[i] - seen_counts[i]);
        }
        token_steps++;
    }
    seen_counts.swap(counts);
    seen_ubatches.swap(ubatches);
    if (token_steps < (uint64_t) opt.replan_tokens) {
        return;
    }
    // rank-based inclusion probabilities, averaged over the served layers (zipmoe_py.planner)
    observed_profile.assign(n_exp, 0.0);
    int n_served = 0;
    for (int il = 0; il < n_layer; ++il) {
        if (!ggml_zipmoe_cache_has_layer(cache, il)) {
            continue;
        }
        std::vector<double> ranked(token_counts.begin() + (size_t) il * n_exp, token_counts.begin() + (size_t) (il + 1) * n_exp);
        std::sort(ranked.begin(), ranked.end(), std::greater<double>());
        for (int32_t r = 0; r < n_exp; ++r) {
            observed_profile[r] += ranked[r] / (double) token_steps;
        }
        n_served++;
    }
    for (double & f : observed_profile) {
        f /= std::max(1, n_served);
    }
    replanned = true;
    ggml_zipmoe_default_pools choice = {};
    if (ggml_zipmoe_cache_default_pools(cache, auto_budget, n_expert_used, auto_threads, opt.work_slots, plan_rates[0],
                                        plan_rates[1], observed_profile.data(), &choice) != GGML_ZIPMOE_OK) {
        return;
    }
    const bool use_pools = choice.capacity[1] + choice.capacity[2] + choice.capacity[3] > 0;
    const int32_t capacity = ggml_zipmoe_cache_slot_capacity(cache);
    const int32_t fewest   = std::min(capacity, n_expert_used);
    if (use_pools && (choice.n_slots < fewest || choice.n_slots > capacity)) {
        return;
    }
    const int32_t n = std::min(capacity, std::max(fewest, choice.n_slots));
    // a change empties the stores (they fill again on demand): only for a gain of a tenth or more
    const double expected = use_pools ? choice.expected_makespan_s : choice.f_only_makespan_s;
    const bool   same     = (use_pools == auto_active && n == n_slots_used &&
                             memcmp(choice.capacity, auto_choice.capacity, sizeof(choice.capacity)) == 0 &&
                             choice.inclusive == auto_choice.inclusive) ||
                            expected >= 0.9 * choice.current_makespan_s;
    if (same) {
        std::lock_guard<std::mutex> lock(state_mutex);
        const std::string why = format("%s (kept after a re-plan from the observed profile: %.2f ms per layer "
                                       "expected, against %.2f ms with these)", auto_choice.why, expected * 1e3,
                                       choice.current_makespan_s * 1e3);
        snprintf(plan.pools_why, sizeof(plan.pools_why), "%s", why.c_str()); // cut to the field's size
        LLAMA_LOG_INFO("%s: ZipMoE pools re-planned after %llu decode steps: kept (%s)\n", __func__,
                       (unsigned long long) token_steps, choice.why);
        return;
    }
    if (use_slots(n, &choice) != GGML_ZIPMOE_OK) {
        LLAMA_LOG_WARN("%s: ZipMoE pools from the observed routing not made (%s): %s\n", __func__, choice.why,
                       ggml_zipmoe_cache_error(cache));
        return; // nothing changed
    }
    auto_active = choice.capacity[1] + choice.capacity[2] + choice.capacity[3] > 0;
    auto_choice = choice;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        layout++; // graphs built for the old slots are rebuilt
        std::copy(choice.capacity, choice.capacity + 4, plan.pools);
        plan.n_slots = n_slots_used;
        snprintf(plan.pools_why, sizeof(plan.pools_why), "%s", choice.why);
    }
    LLAMA_LOG_INFO("%s: ZipMoE pools re-planned after %llu decode steps: F %d, C %d, S %d, E %d per MoE layer, %d "
                   "slots: %s\n", __func__, (unsigned long long) token_steps, choice.capacity[0], choice.capacity[1],
                   choice.capacity[2], choice.capacity[3], n, choice.why);
}

bool llama_zipmoe::abort_callback(void * data) {
    const auto * st = (const context_state *) data;
    return st->zm->failed.load(std::memory_order_relaxed) || (st->user_callback && st->user_callback(st->user_data));
}

void * llama_zipmoe::wrap_abort_callback(llama_context * lctx, ggml_abort_callback user_callback, void * user_data) {
    context_state & st = state_of(lctx);
    st.user_callback = user_callback;
    st.user_data     = user_data;
    return &st;
}

const char * llama_zipmoe::last_error(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto it = contexts.find(lctx);
    return it == contexts.end() ? "" : it->second->error.c_str();
}

llama_zipmoe_memory_plan llama_zipmoe::memory_plan() const {
    std::lock_guard<std::mutex> lock(state_mutex);
    llama_zipmoe_memory_plan out = plan;
    if (out.slot_capacity == 0 && cache != nullptr) { // no context made yet
        out.available     = available_at_load;
        out.non_expert    = non_expert_bytes;
        out.budget        = opt.budget;
        out.expert_bytes  = expert_bytes;
        out.n_slots       = n_slots_used;
        out.slot_capacity = ggml_zipmoe_cache_slot_capacity(cache);
        out.min_slots     = n_slots_used;
        snprintf(out.source, sizeof(out.source), "%s", memory_source.c_str());
    }
    return out;
}

bool llama_model_zipmoe_memory_plan(const struct llama_model * model, struct llama_zipmoe_memory_plan * plan) {
    if (model == nullptr || !model->zipmoe || model->zipmoe->cache == nullptr || plan == nullptr) {
        return false;
    }
    *plan = model->zipmoe->memory_plan();
    return true;
}

struct ggml_zipmoe_cache * llama_model_zipmoe_cache(const struct llama_model * model) {
    return model != nullptr && model->zipmoe ? model->zipmoe->cache : nullptr;
}

const char * llama_zipmoe_last_error(const struct llama_context * lctx) {
    const llama_model * model = lctx != nullptr ? llama_get_model(lctx) : nullptr;
    return model != nullptr && model->zipmoe ? model->zipmoe->last_error(lctx) : "";
}
