// ZipMoE fork: the slot sets (llama-zipmoe.h): which device each MoE layer's slots take, by stock
// llama.cpp's own placement of that layer's experts; each set's sizing; and the public API's view of them.

#include "llama-zipmoe.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-zipmoe-options.h"

#include <algorithm>
#include <thread>
#include <cstring>
#include <regex>
#include <stdexcept>
#include <strings.h>

// where stock llama.cpp puts layer il's routed experts: a tensor override's buffer type for them (upstream
// matches overrides only for tensors the file holds, and the repacked experts are not among them), else the
// layer's. nullptr for host memory: a CPU layer's list may start with a GPU's pinned host buffer type, whose
// device is the GPU, host memory all the same
ggml_backend_dev_t llama_zipmoe::expert_device(int il, const layer_buft_fn & layer_buft,
                                               const std::vector<buft_pattern> & overrides) const {
    ggml_backend_buffer_type_t buft = layer_buft(il);
    for (const auto & [pattern, override_buft] : overrides) {
        bool match = false;
        for (int k = 0; k < 3 && !match; ++k) {
            match = std::regex_search(llama_zipmoe_expert_tensor_name(il, k), pattern);
        }
        if (match) {
            buft = override_buft;
            break;
        }
    }
    ggml_backend_dev_t dev = buft != nullptr ? ggml_backend_buft_get_device(buft) : nullptr;
    const enum ggml_backend_dev_type type = dev != nullptr ? ggml_backend_dev_type(dev) : GGML_BACKEND_DEVICE_TYPE_CPU;
    const bool on_device = dev != nullptr && !ggml_backend_buft_is_host(buft) &&
                           (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU);
    return on_device ? dev : nullptr;
}

// a GPU that ggml may run a host layer's products on (the scheduler's offload of a large batch's)
static bool gpu_registered() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return true;
        }
    }
    return false;
}

// a budget given is the slots of every set not named in zipmoe.device_budgets (named: 1): each takes its
// layers' share of them, by largest remainder (the shares sum to the budget's slots), at least one
static std::vector<uint64_t> budget_shares(uint64_t budget, uint64_t expert_bytes,
                                           const std::vector<std::unique_ptr<llama_zipmoe_slot_set>> & sets,
                                           const std::vector<bool> & named) {
    const uint64_t slots = std::min<uint64_t>(budget / std::max<uint64_t>(1, expert_bytes), 1ull << 32);
    uint64_t layers = 0;
    for (size_t i = 0; i < sets.size(); ++i) {
        layers += named[i] ? 0 : (uint64_t) sets[i]->n_layers;
    }
    std::vector<uint64_t> share(sets.size());
    std::vector<std::pair<uint64_t, size_t>> remainder;
    uint64_t given = 0;
    for (size_t i = 0; i < sets.size(); ++i) {
        if (named[i]) {
            continue;
        }
        const uint64_t exact = slots * (uint64_t) sets[i]->n_layers;
        share[i] = exact / std::max<uint64_t>(1, layers);
        given += share[i];
        remainder.push_back({ exact % std::max<uint64_t>(1, layers), i });
    }
    std::stable_sort(remainder.begin(), remainder.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    for (size_t r = 0; given < slots && r < remainder.size(); ++r, ++given) {
        share[remainder[r].second]++;
    }
    for (size_t i = 0; i < sets.size(); ++i) {
        share[i] = named[i] ? 0 : std::max<uint64_t>(1, share[i]) * expert_bytes;
    }
    return share;
}

// zipmoe.device_budgets: by set, the budget its device is given (0: not named); throws naming a device that
// holds no set
static std::vector<uint64_t> named_budgets(const std::string & text,
                                           const std::vector<std::unique_ptr<llama_zipmoe_slot_set>> & sets) {
    std::vector<uint64_t> budgets(sets.size(), 0);
    char name[64];
    uint64_t bytes = 0;
    for (int k = 0; ggml_zipmoe_device_size_at(text.c_str(), k, name, sizeof(name), &bytes) == GGML_ZIPMOE_OK; ++k) {
        bool found = false;
        std::string devices;
        for (size_t i = 0; i < sets.size(); ++i) {
            devices += format("%s%s", devices.empty() ? "" : ", ", sets[i]->device_name());
            if (strcasecmp(sets[i]->device_name(), name) == 0) {
                budgets[i] = bytes;
                found = true;
            }
        }
        if (!found) {
            throw std::runtime_error(format("zipmoe.device_budgets names %s, which computes no MoE layer's experts "
                                            "here: the devices with expert slots are %s", name, devices.c_str()));
        }
    }
    return budgets;
}

void llama_zipmoe::make_serving(llama_zipmoe_slot_set & set, size_t n_sets, bool host_set_exists, uint64_t budget,
                                bool named) {
    if (n_sets == 1 && !named) {
        set.serving = serving; // measured over every layer at load: the one set's
        ggml_zipmoe_serving_get_info(serving, &set.info);
        return;
    }
    ggml_zipmoe_serving_plan loaded;
    ggml_zipmoe_serving_get_plan(serving, &loaded);
    ggml_zipmoe_serving_params sp = serving_params(set.layer_tensors);
    // the memory measured once, at load, before any weight was mapped
    sp.available        = loaded.available;
    sp.available_source = loaded.source;
    sp.budget = budget;
    // host stores beside a device's slots take host memory, which the set in host memory sizes its slots from
    sp.device_stores = opt.device_stores && !(set.dev != nullptr && host_set_exists);
    const std::string name = named ? format("zipmoe.device_budgets (%s)", set.device_name())
                                   : format("%s (%s's share)", opt.budget_source.c_str(), set.device_name());
    sp.budget_name = name.c_str();
    sp.log_data    = &set; // its lines name the device
    char err[1024];
    set.serving = ggml_zipmoe_serving_new(&sp, err, sizeof(err));
    if (set.serving == nullptr) {
        throw std::runtime_error(format("%s's expert slots: %s", set.device_name(), err));
    }
    ggml_zipmoe_serving_get_info(set.serving, &set.info);
}

// the tensor overrides' patterns, compiled once
static std::vector<llama_zipmoe::buft_pattern> compile_overrides(const llama_model_tensor_buft_override * overrides) {
    std::vector<llama_zipmoe::buft_pattern> out;
    for (const auto * o = overrides; o && o->pattern != nullptr; ++o) {
        try {
            out.emplace_back(std::regex(o->pattern), o->buft);
        } catch (const std::regex_error & e) {
            throw std::runtime_error(format("tensor override pattern '%s' (-ot, --override-tensor): %s", o->pattern,
                                            e.what()));
        }
    }
    return out;
}

void llama_zipmoe::make_cache(const layer_buft_fn & layer_buft, const weight_buft_fn & weight_buft,
                              const llama_model_tensor_buft_override * overrides) {
    const int n_layer = (int) (layer_tensors.size() / 3);
    const std::vector<buft_pattern> patterns = compile_overrides(overrides);
    std::vector<ggml_backend_dev_t> devices; // by set, in the order of their first layers
    layer_set.assign(n_layer, -1);
    for (int il = 0; il < n_layer; ++il) {
        if (layer_tensors[3 * il] < 0) {
            continue;
        }
        ggml_backend_dev_t dev = expert_device(il, layer_buft, patterns);
        auto it = std::find(devices.begin(), devices.end(), dev);
        layer_set[il] = (int32_t) (it - devices.begin());
        if (it == devices.end()) {
            devices.push_back(dev);
        }
    }
    if (devices.empty()) {
        throw std::runtime_error(format("%s: no layer has routed experts", fname.c_str()));
    }
    const bool host_set_exists = std::find(devices.begin(), devices.end(), nullptr) != devices.end();
    for (size_t i = 0; i < devices.size(); ++i) {
        auto set = std::make_unique<llama_zipmoe_slot_set>();
        set->zm  = this;
        set->dev = devices[i];
        set->layer_tensors.assign(layer_tensors.size(), -1);
        for (int il = 0; il < n_layer; ++il) {
            if (layer_set[il] == (int32_t) i) {
                std::copy_n(layer_tensors.begin() + 3 * il, 3, set->layer_tensors.begin() + 3 * il);
                set->n_layers++;
            }
        }
        sets.push_back(std::move(set));
    }
    std::vector<uint64_t> budgets = named_budgets(opt.device_budgets, sets);
    std::vector<bool> named(sets.size());
    std::transform(budgets.begin(), budgets.end(), named.begin(), [](uint64_t b) { return b != 0; });
    if (opt.budget != 0) {
        const std::vector<uint64_t> shares = budget_shares(opt.budget, info.expert_bytes, sets, named);
        for (size_t i = 0; i < sets.size(); ++i) {
            budgets[i] = named[i] ? budgets[i] : shares[i];
        }
    }
    for (size_t i = 0; i < sets.size(); ++i) {
        llama_zipmoe_slot_set * set = sets[i].get();
        make_serving(*set, sets.size(), host_set_exists, budgets[i], named[i]);
        if (set->dev != nullptr) {
            set->on_device  = true;
            set->cuda_slots = strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(set->dev)), "CUDA") == 0 &&
                              ggml_zipmoe_cuda_devices() > 0;
            set->place_on_device(weights_on(set->dev, layer_buft));
        } else {
            set->place_in_host(weight_buft, gpu_registered() || test_offloaded_passes ? n_expert_used : 0);
        }
        set->make_cache();
        if (opt.cpu_compute && set->on_device) {
            // a pass's experts the CPU may compute: one token's (the balancer gives a batch's large ones to the device)
            set->place_cpu_slots(std::max(1, n_expert_used), (int) std::max(1u, std::thread::hardware_concurrency()));
        }
    }
    if (opt.cpu_compute && std::none_of(sets.begin(), sets.end(), [](const auto & s) { return s->on_device; })) {
        LLAMA_LOG_INFO("%s: zipmoe.cpu_compute: every expert slot is in host memory, where the CPU computes them all "
                       "already\n", __func__);
    }
    if (sets[0]->serving != serving) {
        ggml_zipmoe_serving_free(serving); // each set has its own
    }
    serving = primary()->serving;
    info    = primary()->info;
    if (opt.substitution != GGML_ZIPMOE_SUBST_NONE) {
        log_substitution();
    }
}

// the model's weights other than routed experts that go to dev's memory: its layers' (by the layers'
// placement, which the experts' overrides do not change) and, taken to be there too, the rest (embeddings,
// output, final norm): a device's slots leave room for them
uint64_t llama_zipmoe::weights_on(ggml_backend_dev_t dev, const layer_buft_fn & layer_buft) const {
    uint64_t bytes = other_non_expert;
    for (int il = 0; il < (int) layer_non_expert.size(); ++il) {
        ggml_backend_buffer_type_t buft = layer_buft(il);
        if (buft != nullptr && !ggml_backend_buft_is_host(buft) && ggml_backend_buft_get_device(buft) == dev) {
            bytes += layer_non_expert[il];
        }
    }
    return bytes;
}

const llama_zipmoe_slot_set * llama_zipmoe::primary() const {
    for (const auto & set : sets) {
        if (!set->on_device) {
            return set.get();
        }
    }
    return sets.empty() ? nullptr : sets[0].get();
}

ggml_zipmoe_cache * llama_zipmoe::first_cache() const {
    return sets.empty() ? nullptr : sets[0]->cache;
}

struct ggml_zipmoe_cache * llama_model_zipmoe_cache(const struct llama_model * model) {
    return model != nullptr && model->zipmoe ? model->zipmoe->first_cache() : nullptr;
}

int32_t llama_model_zipmoe_n_caches(const struct llama_model * model) {
    return model != nullptr && model->zipmoe ? (int32_t) model->zipmoe->slot_sets().size() : 0;
}

static const llama_zipmoe_slot_set * slot_set_at(const struct llama_model * model, int32_t i) {
    if (model == nullptr || !model->zipmoe || i < 0 || i >= (int32_t) model->zipmoe->slot_sets().size()) {
        return nullptr;
    }
    return model->zipmoe->slot_sets()[i].get();
}

struct ggml_zipmoe_cache * llama_model_zipmoe_cache_at(const struct llama_model * model, int32_t i) {
    const llama_zipmoe_slot_set * set = slot_set_at(model, i);
    return set != nullptr ? set->cache : nullptr;
}

const char * llama_model_zipmoe_cache_device(const struct llama_model * model, int32_t i) {
    const llama_zipmoe_slot_set * set = slot_set_at(model, i);
    return set != nullptr ? set->device_name() : nullptr;
}
