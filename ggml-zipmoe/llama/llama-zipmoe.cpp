// ZipMoE fork: the model's expert cache (llama-zipmoe.h): made when the model loads, its slots placed and
// their tensors made, contexts attached and detached. How much memory it may take: llama-zipmoe-sizing.cpp.

#include "llama-zipmoe.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-alloc.h"
#include "ggml-cpp.h"
#include "ggml-backend.h"
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

std::string llama_zipmoe_gib(uint64_t bytes) {
    return format("%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
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

// the slots in a device's memory: every slot in use, plus zero slots (absent_slot)
void llama_zipmoe::place_on_device(ggml_backend_dev_t dev) {
    size_t free_bytes = 0, total_bytes = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
    zero_slots = info.max_expert;
    // the non-expert weights, KV cache and compute buffers, cuBLAS' workspace, the zero slots
    const uint64_t reserve = file_non_expert + (1ull << 30) + free_bytes / 16 + (uint64_t) zero_slots * info.expert_bytes;
    const bool    igpu     = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_IGPU; // Jetson: the host's memory
    const int32_t capacity = ggml_zipmoe_serving_fit_device(serving, ggml_backend_dev_name(dev), free_bytes, reserve, igpu);
    ggml_zipmoe_serving_get_info(serving, &info);
    zero_slot = capacity;

    const size_t align = 256;
    size_t section[3], stride[3], off = 0;
    for (int k = 0; k < 3; ++k) {
        section[k] = off;
        stride[k]  = (size_t) info.slot_bytes[k];
        off += GGML_PAD((size_t) (capacity + zero_slots) * stride[k], align);
    }
    buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), off);
    if (buf == nullptr) {
        throw std::runtime_error(format("cannot allocate %s of %s memory for %d ZipMoE expert slots (%s free): give "
                                        "a smaller zipmoe.budget or fewer GPU layers", llama_zipmoe_gib(off).c_str(),
                                        ggml_backend_dev_name(dev), capacity, llama_zipmoe_gib(free_bytes).c_str()));
    }
    ggml_backend_buffer_clear(buf, 0); // the zero slots
    if (!cuda_slots && strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0) {
        // RPC's asynchronous set copies the bytes into its queue at once (a decoding thread reuses its
        // staging); other backends' may read them later, so they set synchronously (slot_write)
        slot_backend = ggml_backend_dev_init(dev, nullptr);
    }
    char * base = (char *) ggml_backend_buffer_get_base(buf);
    void * const data[3] = { base + section[0], base + section[1], base + section[2] };
    make_slot_tensors(data, stride, {});
}

// by (kind, ggml type) of the file's expert tensors: the host buffer type stock llama.cpp gives them
static std::map<std::pair<int, int>, ggml_backend_buffer_type_t> stock_host_bufts(
        const ggml_zipmoe_file * file, const std::vector<int32_t> & layer_tensors,
        const llama_zipmoe::weight_buft_fn & weight_buft) {
    ggml_init_params params = { /*.mem_size =*/ layer_tensors.size() * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr,
                                /*.no_alloc =*/ true };
    ggml_context_ptr meta { ggml_init(params) };
    std::map<std::pair<int, int>, ggml_backend_buffer_type_t> bufts;
    for (size_t i = 0; i < layer_tensors.size(); ++i) {
        const int t = layer_tensors[i], kind = (int) (i % 3);
        const ggml_type type = t >= 0 ? (ggml_type) ggml_zipmoe_file_tensor_type(file, t) : GGML_TYPE_COUNT;
        if (type == GGML_TYPE_COUNT || bufts.count({ kind, type })) {
            continue;
        }
        int64_t ne[3];
        ggml_zipmoe_file_tensor_shape(file, t, ne);
        ggml_tensor * w = ggml_new_tensor_3d(meta.get(), type, ne[0], ne[1], ne[2]);
        ggml_set_name(w, ggml_zipmoe_file_tensor_name(file, t));
        bufts[{ kind, type }] = weight_buft ? weight_buft(w) : nullptr;
    }
    return bufts;
}

bool llama_zipmoe_is_cpu_extra_buft(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = buft != nullptr ? ggml_backend_buft_get_device(buft) : nullptr;
    return dev != nullptr && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU &&
           buft != ggml_backend_cpu_buffer_type();
}

// the slots in host memory: address space reserved by ggml-zipmoe, committed where a slot is written;
// or, where stock llama.cpp puts the experts in one of ggml-cpu's repacking buffer types (quantized
// experts), a buffer of that type, so that the products run stock's kernels on stock's layout
void llama_zipmoe::place_in_host(const weight_buft_fn & weight_buft) {
    const auto bufts = stock_host_bufts(file, layer_tensors, weight_buft);
    ggml_backend_buffer_type_t extra = nullptr;
    std::map<std::pair<int, int>, bool> expected_extra;
    for (const auto & [key, buft] : bufts) {
        expected_extra[key] = llama_zipmoe_is_cpu_extra_buft(buft);
        if (!expected_extra[key]) {
            continue;
        }
        if (extra != nullptr && extra != buft) {
            throw std::runtime_error(format("%s: stock llama.cpp puts the routed experts in two buffer types (%s and %s), "
                                            "which one set of ZipMoE slots cannot follow", fname.c_str(),
                                            ggml_backend_buft_name(extra), ggml_backend_buft_name(buft)));
        }
        extra = buft;
    }
    void * data[3];
    size_t stride[3];
    char err[512];
    if (extra == nullptr) {
        if (ggml_zipmoe_serving_reserve_host(serving, data, stride, err, sizeof(err)) != GGML_ZIPMOE_OK) {
            throw std::runtime_error(err);
        }
        ggml_zipmoe_serving_get_info(serving, &info);
        const size_t bytes = (size_t) ((char *) data[2] - (char *) data[0]) + (size_t) info.capacity * stride[2];
        buf = ggml_backend_cpu_buffer_from_ptr(data[0], bytes);
    } else {
        // memory of the buffer type itself (committed where a slot is written, as malloc's large blocks are)
        const size_t page = 4096;
        size_t section[3], off = 0;
        for (int k = 0; k < 3; ++k) {
            section[k] = off;
            stride[k]  = (size_t) info.slot_bytes[k];
            off += GGML_PAD((size_t) info.capacity * stride[k], page);
        }
        buf = ggml_backend_buft_alloc_buffer(extra, off);
        if (buf == nullptr) {
            throw std::runtime_error(format("%s: cannot allocate %s of %s memory for %d ZipMoE expert slots: give a "
                                            "smaller zipmoe.budget", fname.c_str(), llama_zipmoe_gib(off).c_str(),
                                            ggml_backend_buft_name(extra), info.capacity));
        }
        char * base = (char *) ggml_backend_buffer_get_base(buf);
        for (int k = 0; k < 3; ++k) {
            data[k] = base + section[k];
        }
        // the types stock keeps in the plain CPU buffer (Q6_K beside Q4_K in a Q4_K_M file) alias the memory
        // through a plain buffer: a tensor in the repacking buffer without its layout would run on no backend
        plain_buf = ggml_backend_cpu_buffer_from_ptr(base, off);
        ggml_zipmoe_serving_adopt_host(serving, data);
        ggml_zipmoe_serving_get_info(serving, &info);
    }
    make_slot_tensors(data, stride, expected_extra);
}

void llama_zipmoe::make_slot_tensors(void * const data[3], const size_t stride[3],
                                     const std::map<std::pair<int, int>, bool> & expected_extra) {
    // the types of each kind, in file order
    std::vector<ggml_type> types[3];
    for (size_t i = 0; i < layer_tensors.size(); ++i) {
        const int t = layer_tensors[i];
        const ggml_type type = t >= 0 ? (ggml_type) ggml_zipmoe_file_tensor_type(file, t) : GGML_TYPE_COUNT;
        auto & of_kind = types[i % 3];
        if (type != GGML_TYPE_COUNT && std::find(of_kind.begin(), of_kind.end(), type) == of_kind.end()) {
            of_kind.push_back(type);
        }
    }
    const int32_t n_slots = info.capacity + zero_slots;
    size_t n_tensors = 0;
    for (int k = 0; k < 3; ++k) {
        n_tensors += types[k].size() * (1 + (size_t) n_slots); // a per-slot view where the layout is the buffer's own
    }
    ggml_init_params params = { /*.mem_size =*/ n_tensors * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr,
                                /*.no_alloc =*/ true };
    ctx = ggml_init(params);
    if (ctx == nullptr || buf == nullptr) {
        throw std::runtime_error("cannot make the ZipMoE slot tensors");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (plain_buf != nullptr) {
        ggml_backend_buffer_set_usage(plain_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    for (int k = 0; k < 3; ++k) {
        for (ggml_type type : types[k]) {
            const auto want  = expected_extra.find({ k, (int) type });
            const bool extra = want != expected_extra.end() && want->second;
            ggml_backend_buffer_t in = !extra && plain_buf != nullptr ? plain_buf : buf;
            // every type's slots over the same memory: slot s of any type starts at data[k] + s * stride[k]
            ggml_tensor * t = ggml_new_tensor_3d(ctx, type, info.slot_ne[k][0], info.slot_ne[k][1], n_slots);
            t->nb[2] = stride[k];
            t->nb[3] = stride[k] * (size_t) n_slots;
            ggml_format_name(t, "zipmoe.slots.%s.%s", k_zipmoe_kinds[k], ggml_type_name(type));
            if (ggml_backend_tensor_alloc(in, t, data[k]) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("cannot place the ZipMoE slot tensors");
            }
            slots[k].push_back(t);
            if (!extra) {
                if (t->extra != nullptr) { // the buffer would run other kernels than stock's plain buffer does
                    throw std::runtime_error(format("%s: %s experts: the slots' buffer type %s would lay them out its own "
                                                    "way, stock llama.cpp does not", fname.c_str(), ggml_type_name(type),
                                                    ggml_backend_buffer_name(buf)));
                }
                continue;
            }
            if (t->extra == nullptr) {
                throw std::runtime_error(format("%s: %s experts: stock llama.cpp lays them out for %s's kernels, and the "
                                                "slots cannot be", fname.c_str(), ggml_type_name(type),
                                                ggml_backend_buffer_name(buf)));
            }
            auto & views = fill_views[{ k, (int) type }];
            for (int32_t s = 0; s < n_slots; ++s) {
                ggml_tensor * v = ggml_new_tensor_2d(ctx, type, info.slot_ne[k][0], info.slot_ne[k][1]);
                ggml_format_name(v, "zipmoe.slot.%s.%s.%d", k_zipmoe_kinds[k], ggml_type_name(type), s);
                if (ggml_backend_tensor_alloc(buf, v, (char *) data[k] + (size_t) s * stride[k]) != GGML_STATUS_SUCCESS ||
                    v->extra == nullptr) {
                    throw std::runtime_error("cannot place the ZipMoE slot views");
                }
                views.push_back(v);
            }
        }
    }
}

int llama_zipmoe::slot_fill(void * data, int kind, int tensor, int32_t slot, const void * src, size_t size, char * err,
                            size_t err_size) {
    const llama_zipmoe * zm = (const llama_zipmoe *) data;
    const int type = ggml_zipmoe_file_tensor_type(zm->file, tensor);
    const auto it = zm->fill_views.find({ kind, type });
    if (it == zm->fill_views.end()) {
        ggml_tensor * s = zm->slots[kind][0];
        memcpy((char *) s->data + (size_t) slot * s->nb[2], src, size);
        return 0;
    }
    if (slot < 0 || slot >= (int32_t) it->second.size() || size != ggml_nbytes(it->second[slot])) {
        snprintf(err, err_size, "slot %d of %zu bytes for %zu bytes", slot,
                 slot >= 0 && slot < (int32_t) it->second.size() ? ggml_nbytes(it->second[slot]) : 0, size);
        return 1;
    }
    ggml_backend_tensor_set(it->second[slot], src, 0, size); // laid out for the buffer type's kernels
    return 0;
}

int llama_zipmoe::slot_write(void * data, int kind, int tensor, int32_t slot, size_t offset, const void * src,
                             size_t size, char * err, size_t err_size) {
    llama_zipmoe * zm = (llama_zipmoe *) data;
    const int il = ggml_zipmoe_file_tensor_layer(zm->file, tensor);
    ggml_tensor * slots = zm->slots_of(il, kind);
    const size_t at = (size_t) slot * slots->nb[2] + offset;
    if (slot < 0 || slot >= zm->info.capacity || offset + size > slots->nb[2] || at + size > ggml_nbytes(slots)) {
        snprintf(err, err_size, "%zu bytes at %zu of slot %d of %d (%zu bytes each)", size, offset, slot,
                 zm->info.capacity, slots->nb[2]);
        return 1;
    }
    if (zm->slot_backend != nullptr) {
        // an rpc-server's: queued and copied at once; in pieces below RPC's hash threshold (10 MiB), above
        // which it would ask the server for a cached copy first (one round trip each, and `rpc-server -c`
        // would write every expert to its disk cache)
        const size_t piece = 8u << 20;
        for (size_t done = 0; done < size; done += piece) {
            ggml_backend_tensor_set_async(zm->slot_backend, slots, (const char *) src + done, at + done,
                                          std::min(piece, size - done));
        }
        return 0;
    }
    std::lock_guard<std::mutex> lock(zm->slot_mutex); // a backend's buffer is not known to take concurrent sets
    ggml_backend_tensor_set(slots, src, at, size);
    return 0;
}

int llama_zipmoe::slot_sync(void * data, char * err, size_t err_size) {
    (void) err;
    (void) err_size;
    ggml_backend_synchronize(((llama_zipmoe *) data)->slot_backend);
    return 0;
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
    cp.slot_memory      = cuda_slots ? GGML_ZIPMOE_SLOTS_CUDA : on_device ? GGML_ZIPMOE_SLOTS_DEVICE : GGML_ZIPMOE_SLOTS_HOST;
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
    LLAMA_LOG_INFO("%s: ZipMoE expert cache so far: %llu fetches, %llu hits, %llu misses (%llu from C/S/E), %.1f MB "
                   "read (prefetch %.1f MB read, %.1f MB used, %llu experts served, recall %.2f); io %.1f ms, decode "
                   "%.1f ms, recover %.1f ms, fetch wall %.1f ms (fetch lock %.1f, plan %.1f, thread 0 decoding %.1f, "
                   "waiting for reads %.1f, waiting for the other threads %.1f; %llu page faults); %llu graphs, %.1f ms; %.1f MB to the slots' device; "
                   "preloaded %llu experts, %.1f MB read\n",
                   __func__,
                   (unsigned long long) s.fetch_calls, (unsigned long long) s.expert_hits,
                   (unsigned long long) s.expert_misses, (unsigned long long) (s.c_hits + s.s_hits + s.e_hits),
                   s.bytes_read / 1e6, s.prefetch_bytes_read / 1e6, s.prefetch_bytes_used / 1e6,
                   (unsigned long long) s.prefetch_hits, actual ? (double) correct / actual : 0.0, s.io_ns / 1e6,
                   s.decode_ns / 1e6, s.recover_ns / 1e6, s.fetch_ns / 1e6, s.lock_wait_ns / 1e6, s.plan_ns / 1e6,
                   s.fetch_work_ns / 1e6, s.read_wait_ns / 1e6, s.finish_wait_ns / 1e6,
                   (unsigned long long) s.decode_faults, (unsigned long long) s.graphs, s.graph_ns / 1e6,
                   s.h2d_bytes / 1e6, (unsigned long long) s.preload_experts, s.preload_bytes_read / 1e6);
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
