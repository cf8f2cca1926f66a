// ZipMoE fork: experts computed where they are held (SMoE Algorithm 2, zipmoe.cpu_compute). Beside slots
// in a device's memory, host slots that a fetch recovers the experts the cache's CPU-load balancer gives
// to the CPU into, and the measured cost of the CPU's products that the balancer weighs against a copy to
// the device. Opt-in: the weights are exact, the rounding is the CPU's, not the device's.

#include "llama-zipmoe.h"

#include "llama-impl.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>

ggml_tensor * llama_zipmoe_slot_set::cpu_slots_of(int il, int kind) const {
    return of_layers_type(cpu_slots[kind], il, kind);
}

// seconds the CPU takes for one expert's products of one token on n_threads threads: gate, up and down over
// each CPU slot in turn, the mean of two rounds after one (the slots' contents do not change the time). In
// turn, so that an expert is read from memory as a fetch's just recovered one mostly is, not from the
// cache of the previous run; 0 if it cannot run
static double measure_cpu_token(const llama_zipmoe_slot_set & set, int il, int n_threads) {
    ggml_backend_ptr cpu { ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr) };
    if (!cpu) {
        return 0;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(cpu.get()));
    auto set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set_n_threads) {
        set_n_threads(cpu.get(), n_threads);
    }
    ggml_init_params params = { /*.mem_size =*/ 16 * ggml_tensor_overhead() + ggml_graph_overhead(),
                                /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    ggml_context_ptr ctx { ggml_init(params) };
    ggml_tensor * gate = set.cpu_slots_of(il, 0), * up = set.cpu_slots_of(il, 1), * down = set.cpu_slots_of(il, 2);
    ggml_tensor * x    = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, gate->ne[0], 1, 1);
    ggml_tensor * ids  = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, 1);
    ggml_tensor * h    = ggml_mul(ctx.get(), ggml_mul_mat_id(ctx.get(), gate, x, ids), ggml_mul_mat_id(ctx.get(), up, x, ids));
    ggml_tensor * out  = ggml_mul_mat_id(ctx.get(), down, h, ids);
    ggml_cgraph * gf   = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, out);
    ggml_backend_buffer_ptr buf { ggml_backend_alloc_ctx_tensors(ctx.get(), cpu.get()) };
    if (!buf) {
        return 0;
    }
    ggml_backend_buffer_clear(buf.get(), 0);
    const int32_t n = (int32_t) gate->ne[2];
    double timed = 0;
    for (int32_t run = 0; run < 3 * n; ++run) {
        const int32_t slot = run % n;
        ggml_backend_tensor_set(ids, &slot, 0, sizeof(slot));
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(cpu.get(), gf) != GGML_STATUS_SUCCESS) {
            return 0;
        }
        timed += run >= n ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() : 0.0;
    }
    return timed / (2 * n);
}

void llama_zipmoe_slot_set::place_cpu_slots(int32_t n, int n_threads) {
    std::vector<ggml_type> types[3];
    for (size_t i = 0; i < layer_tensors.size(); ++i) {
        const int t = layer_tensors[i];
        if (t >= 0) {
            const ggml_type type = (ggml_type) ggml_zipmoe_file_tensor_type(zm->file, t);
            if (std::find(types[i % 3].begin(), types[i % 3].end(), type) == types[i % 3].end()) {
                types[i % 3].push_back(type);
            }
        }
    }
    size_t section[3], stride[3], size = 0;
    for (int k = 0; k < 3; ++k) {
        section[k] = size;
        stride[k]  = (size_t) info.slot_bytes[k];
        size += GGML_PAD((size_t) n * stride[k], 64);
    }
    cpu_buf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    ggml_init_params params = { /*.mem_size =*/ (types[0].size() + types[1].size() + types[2].size()) * ggml_tensor_overhead(),
                                /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    cpu_ctx = cpu_buf != nullptr ? ggml_init(params) : nullptr;
    if (cpu_ctx == nullptr) {
        throw std::runtime_error(format("zipmoe.cpu_compute: cannot allocate %s of host memory for the %d experts the "
                                        "CPU computes beside %s's slots: turn it off, or free memory",
                                        llama_zipmoe_size_text(size).c_str(), n, device_name()));
    }
    ggml_backend_buffer_set_usage(cpu_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    // pages of their own before the products are timed: untouched, they would all read the one zero page
    ggml_backend_buffer_clear(cpu_buf, 0);
    char * base = (char *) ggml_backend_buffer_get_base(cpu_buf);
    void * data[3];
    for (int k = 0; k < 3; ++k) {
        data[k] = base + section[k];
        for (ggml_type type : types[k]) {
            ggml_tensor * t = ggml_new_tensor_3d(cpu_ctx, type, info.slot_ne[k][0], info.slot_ne[k][1], n);
            t->nb[2] = stride[k];
            t->nb[3] = stride[k] * (size_t) n;
            ggml_format_name(t, "zipmoe.cpu_slots.%s.%s", k_zipmoe_kinds[k], ggml_type_name(type));
            if (ggml_backend_tensor_alloc(cpu_buf, t, data[k]) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("zipmoe.cpu_compute: cannot place the CPU's slot tensors");
            }
            cpu_slots[k].push_back(t);
        }
    }
    n_cpu_slots = n;
    if (!time_cpu_products(n_threads)) {
        LLAMA_LOG_WARN("%s: zipmoe.cpu_compute: the CPU's products could not be measured (%s): every expert is copied "
                       "to %s\n", __func__, ggml_zipmoe_cache_error(cache), device_name());
        n_cpu_slots = 0;
        return;
    }
    LLAMA_LOG_INFO("%s: ZipMoE: experts computed where they are held (zipmoe.cpu_compute; exact weights, the CPU's "
                   "rounding, not bit-identical to stock): %d slots of %.2f MiB in host memory beside %s's; one "
                   "expert's products of a token take %.2f ms on %d CPU threads (measured again on a context's "
                   "threads), against the measured copy to %s\n",
                   __func__, n, info.expert_bytes / k_zipmoe_mib, device_name(), cpu_token_s * 1e3, n_threads,
                   device_name());
}

bool llama_zipmoe_slot_set::time_cpu_products(int n_threads) {
    if (n_cpu_slots == 0 || n_threads == cpu_token_threads) {
        return n_cpu_slots > 0;
    }
    auto it = cpu_token_s_by_threads.find(n_threads);
    if (it == cpu_token_s_by_threads.end()) {
        int il = 0;
        while (3 * il < (int) layer_tensors.size() && layer_tensors[3 * il] < 0) {
            ++il;
        }
        it = cpu_token_s_by_threads.emplace(n_threads, measure_cpu_token(*this, il, n_threads)).first;
        if (cpu_token_threads != 0 && it->second > 0) { // a context's threads, not the load's first measure
            LLAMA_LOG_INFO("%s: zipmoe.cpu_compute: one expert's products of a token take %.2f ms on %d CPU threads "
                           "(a graph's)\n", __func__, it->second * 1e3, n_threads);
        }
    }
    void * data[3];
    size_t stride[3];
    for (int k = 0; k < 3; ++k) {
        data[k]   = cpu_slots[k].empty() ? nullptr : cpu_slots[k][0]->data;
        stride[k] = cpu_slots[k].empty() ? 0 : cpu_slots[k][0]->nb[2];
    }
    const bool taken = it->second > 0 &&
                       ggml_zipmoe_cache_set_cpu_slots(cache, data, stride, n_cpu_slots, it->second) == GGML_ZIPMOE_OK;
    cpu_token_s       = taken ? it->second : cpu_token_s;
    cpu_token_threads = n_threads; // tried once: a failure is not measured (nor reported) again each graph
    return taken;
}
