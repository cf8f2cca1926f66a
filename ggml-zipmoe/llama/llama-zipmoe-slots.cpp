// ZipMoE fork: where a slot set's expert slots lie and how bytes reach them (llama-zipmoe.h): in a device's
// memory (place_on_device) or in host memory (place_in_host, a repacking buffer type where stock uses one),
// their tensors (make_slot_tensors), the cache over them (make_cache), and the cache's callbacks that write a
// slot through a buffer (slot_fill, slot_write, slot_sync). Which device: llama-zipmoe-sets.cpp.

#include "llama-zipmoe.h"

#include "llama-impl.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "gguf.h"

#include <cstring>
#include <map>
#include <stdexcept>

llama_zipmoe_slot_set::~llama_zipmoe_slot_set() {
    llama_zipmoe_register_slots(*this, false);
    ggml_zipmoe_cache_free(cache);
    ggml_zipmoe_serving_free(serving); // and the host slots it reserved
    if (plain_buf) {
        ggml_backend_buffer_free(plain_buf); // a view of buf's memory: frees nothing of it
    }
    if (slot_backend) {
        ggml_backend_free(slot_backend);
    }
    if (cpu_buf) {
        ggml_backend_buffer_free(cpu_buf);
    }
    if (cpu_ctx) {
        ggml_free(cpu_ctx);
    }
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

const char * llama_zipmoe_slot_set::device_name() const {
    return dev != nullptr ? ggml_backend_dev_name(dev) : "CPU";
}

ggml_tensor * llama_zipmoe_slot_set::of_layers_type(const std::vector<ggml_tensor *> & of_kind, int il, int kind) const {
    const int t = il >= 0 && 3 * il + kind < (int) layer_tensors.size() ? layer_tensors[3 * il + kind] : -1;
    const ggml_type type = t >= 0 ? (ggml_type) ggml_zipmoe_file_tensor_type(zm->file, t) : GGML_TYPE_BF16;
    for (ggml_tensor * s : of_kind) {
        if (s->type == type) {
            return s;
        }
    }
    return of_kind.empty() ? nullptr : of_kind[0];
}

ggml_tensor * llama_zipmoe_slot_set::slots_of(int il, int kind) const {
    return of_layers_type(slots[kind], il, kind);
}

// the slots in a device's memory: every slot in use, plus zero slots (absent_slot)
void llama_zipmoe_slot_set::place_on_device(uint64_t weights_bytes) {
    size_t free_bytes = 0, total_bytes = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
    zero_slots = info.max_expert;
    // the model's weights there, KV cache and compute buffers, cuBLAS' workspace, the zero slots
    const uint64_t reserve = weights_bytes + (1ull << 30) + free_bytes / 16 + (uint64_t) zero_slots * info.expert_bytes;
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
                                        "a smaller zipmoe.budget or fewer GPU layers", llama_zipmoe_size_text(off).c_str(),
                                        ggml_backend_dev_name(dev), capacity, llama_zipmoe_size_text(free_bytes).c_str()));
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
void llama_zipmoe_slot_set::place_in_host(const llama_zipmoe::weight_buft_fn & weight_buft, int32_t n_zero) {
    const ggml_zipmoe_file * file = zm->file;
    const std::string & fname = zm->fname;
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
        ggml_zipmoe_serving_set_host_zero_slots(serving, n_zero);
        if (ggml_zipmoe_serving_reserve_host(serving, data, stride, err, sizeof(err)) != GGML_ZIPMOE_OK) {
            throw std::runtime_error(err);
        }
        ggml_zipmoe_serving_get_info(serving, &info);
        zero_slots = n_zero;
        zero_slot  = info.capacity;
        if (zero_slots > 0) {
            LLAMA_LOG_INFO("%s: %d zero slots after the %d host slots, for the passes of products a GPU runs\n",
                           __func__, zero_slots, info.capacity);
        }
        const size_t bytes = (size_t) ((char *) data[2] - (char *) data[0]) + (size_t) (info.capacity + zero_slots) * stride[2];
        buf = ggml_backend_cpu_buffer_from_ptr(data[0], bytes);
        slots_in_own_mapping = true; // the serving's mmap: a change of pools may move pages into it
    } else {
        // memory of the buffer type itself (committed where a slot is written, as malloc's large blocks are)
        const size_t page = 4096;
        size_t section[3], off = 0;
        spare_slots = info.capacity + zero_slots < 2 ? 2 - (info.capacity + zero_slots) : 0;
        for (int k = 0; k < 3; ++k) {
            section[k] = off;
            stride[k]  = (size_t) info.slot_bytes[k];
            off += GGML_PAD((size_t) (info.capacity + spare_slots) * stride[k], page);
        }
        buf = ggml_backend_buft_alloc_buffer(extra, off);
        if (buf == nullptr) {
            throw std::runtime_error(format("%s: cannot allocate %s of %s memory for %d ZipMoE expert slots: give a "
                                            "smaller zipmoe.budget", fname.c_str(), llama_zipmoe_size_text(off).c_str(),
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

void llama_zipmoe_slot_set::make_slot_tensors(void * const data[3], const size_t stride[3],
                                              const std::map<std::pair<int, int>, bool> & expected_extra) {
    const ggml_zipmoe_file * file = zm->file;
    const std::string & fname = zm->fname;
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
    const int32_t n_slots = info.capacity + zero_slots + spare_slots;
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
            ggml_format_name(t, "zipmoe.slots.%s.%s.%s", device_name(), k_zipmoe_kinds[k], ggml_type_name(type));
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

int llama_zipmoe_slot_set::slot_fill(void * data, int kind, int tensor, int32_t slot, const void * src, size_t size,
                                     char * err, size_t err_size) {
    const llama_zipmoe_slot_set * set = (const llama_zipmoe_slot_set *) data;
    const int type = ggml_zipmoe_file_tensor_type(set->zm->file, tensor);
    const auto it = set->fill_views.find({ kind, type });
    if (it == set->fill_views.end()) {
        ggml_tensor * s = set->slots[kind][0];
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

int llama_zipmoe_slot_set::slot_write(void * data, int kind, int tensor, int32_t slot, size_t offset, const void * src,
                                      size_t size, char * err, size_t err_size) {
    llama_zipmoe_slot_set * zm = (llama_zipmoe_slot_set *) data;
    const int il = ggml_zipmoe_file_tensor_layer(zm->zm->file, tensor);
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

int llama_zipmoe_slot_set::slot_sync(void * data, char * err, size_t err_size) {
    (void) err;
    (void) err_size;
    ggml_backend_synchronize(((llama_zipmoe_slot_set *) data)->slot_backend);
    return 0;
}

void llama_zipmoe_slot_set::make_cache() {
    const llama_zipmoe_options & opt = zm->opt;
    ggml_zipmoe_cache_params cp = {};
    cp.file       = zm->file;
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
    cp.prefetch_experts = opt.prefetch ? (zm->n_expert_used + 1) / 2 : 0;
    // a ubatch whose experts take several passes (a prompt, several sequences) reads a bank of the next
    // pass's experts as this one decodes and computes: one token's worth, of the working slots' pass
    cp.lookahead_experts = zm->n_expert_used;
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
    }
    if (opt.trace_routing) {
        ggml_zipmoe_cache_trace_routing(cache, 1, opt.buddy.temperature, 0);
    }
    if (ggml_zipmoe_serving_set_cache(serving, cache, on_device, err, sizeof(err)) != GGML_ZIPMOE_OK) {
        throw std::runtime_error(err);
    }
    llama_zipmoe_register_slots(*this, true);
    const char * reads = ggml_zipmoe_file_is_direct(zm->file) ? "with O_DIRECT" : "through the page cache";
    const std::string layers = n_layers == info.n_moe_layers && (int) zm->slot_sets().size() == 1 ? "" :
        n_layers == 1 ? "the MoE layer whose experts are computed there: " :
        format("the %d MoE layers whose experts are computed there: ", n_layers);
    if (on_device) {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %s%d slots of %.2f MiB in %s memory (%s; all experts %.1f MiB%s); "
                       "chunks read %s, %s\n", __func__, layers.c_str(), info.capacity, info.expert_bytes / k_zipmoe_mib,
                       ggml_backend_dev_name(dev), ggml_backend_dev_description(dev), info.all_experts / k_zipmoe_mib,
                       opt.budget != 0 ? ", zipmoe.budget" : "", reads,
                       cuda_slots ? "exponents decoded on the CPU (codec ghuf: on the GPU), BF16 recovered on the GPU"
                                  : "decoded and recovered on the CPU, the BF16 experts sent to the device");
    } else {
        LLAMA_LOG_INFO("%s: ZipMoE expert cache: %s%d slots of %.2f MiB reserved in host memory (all experts %.1f MiB%s%s%s); "
                       "sized when a context is made; chunks read %s\n", __func__, layers.c_str(), info.capacity,
                       info.expert_bytes / k_zipmoe_mib, info.all_experts / k_zipmoe_mib, info.raw ? ", stored raw" : "",
                       fill_views.empty() ? "" : ", laid out for ", fill_views.empty() ? "" : ggml_backend_buffer_name(buf),
                       reads);
    }
}
