// ZipMoE fork: the loader's options (llama_zipmoe_options::parse), read from the KV overrides and the
// environment and checked against ggml-zipmoe's option table (ggml-zipmoe-options.h), the single
// source of names, ranges and defaults.

#include "llama-zipmoe.h"

#include "llama-impl.h"

#include "ggml-zipmoe-options.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>

namespace {

// one option as given, before it is checked
struct given_value {
    bool                     set = false;
    ggml_zipmoe_option_input in  = {};
    std::string              text;   // what in.text points into
    std::string              source; // "--override-kv zipmoe.budget" or "ZIPMOE_BUDGET (environment)"
    std::string              shown;  // the value as the message shows it
};

given_value from_environment(const ggml_zipmoe_option * o, const char * text) {
    given_value v;
    v.set    = true;
    v.text   = text;
    v.source = format("%s (environment)", o->env);
    v.shown  = "'" + v.text + "'";
    v.in     = { GGML_ZIPMOE_GIVEN_TEXT, nullptr, 0, 0 };
    return v;
}

given_value from_override(const std::string & key, const llama_model_kv_override & kv) {
    given_value v;
    v.set    = true;
    v.source = format("--override-kv %s", key.c_str());
    switch (kv.tag) {
        case LLAMA_KV_OVERRIDE_TYPE_INT:
            v.in    = { GGML_ZIPMOE_GIVEN_INT, nullptr, kv.val_i64, 0 };
            v.shown = std::to_string(kv.val_i64);
            break;
        case LLAMA_KV_OVERRIDE_TYPE_FLOAT:
            v.in    = { GGML_ZIPMOE_GIVEN_REAL, nullptr, 0, kv.val_f64 };
            v.shown = format("%g", kv.val_f64);
            break;
        case LLAMA_KV_OVERRIDE_TYPE_BOOL:
            v.in    = { GGML_ZIPMOE_GIVEN_BOOL, nullptr, kv.val_bool ? 1 : 0, 0 };
            v.shown = kv.val_bool ? "true" : "false";
            break;
        default:
            v.text  = kv.val_str;
            v.in    = { GGML_ZIPMOE_GIVEN_TEXT, nullptr, 0, 0 };
            v.shown = "'" + v.text + "'";
            break;
    }
    return v;
}

[[noreturn]] void unknown_option(const std::string & key) {
    std::string known;
    for (int id = 0; id < ggml_zipmoe_option_count(); ++id) {
        const char * k = ggml_zipmoe_option_at(id)->key;
        if (k != nullptr) {
            known += format("%s%s", known.empty() ? "" : ", ", k);
        }
    }
    throw std::runtime_error(format("unknown ZipMoE option '%s': known are %s", key.c_str(), known.c_str()));
}

// every option given: the environment's first, then the KV overrides' (an override replaces the
// environment); throws on an unknown "zipmoe." key
std::vector<given_value> gather_given(const std::unordered_map<std::string, llama_model_kv_override> & overrides) {
    const int n_opt = ggml_zipmoe_option_count();
    std::vector<given_value> given(n_opt);
    for (int id = 0; id < n_opt; ++id) {
        const ggml_zipmoe_option * o = ggml_zipmoe_option_at(id);
        const char * env = o->env != nullptr ? getenv(o->env) : nullptr;
        if (env != nullptr && env[0] != '\0') {
            given[id] = from_environment(o, env);
        }
    }
    for (const auto & [key, kv] : overrides) {
        if (key.rfind("zipmoe.", 0) != 0) {
            continue;
        }
        const int id = ggml_zipmoe_option_find(key.c_str());
        if (id < 0 || ggml_zipmoe_option_at(id)->key == nullptr || key != ggml_zipmoe_option_at(id)->key) {
            unknown_option(key);
        }
        given[id] = from_override(key, kv);
    }
    return given;
}

// each given value parsed against the table into values[id] (is_given[id] set), then all of them
// checked together; throws what is wrong
void check_given(std::vector<given_value> & given, std::vector<ggml_zipmoe_option_value> & values, bool * is_given) {
    for (int id = 0; id < (int) given.size(); ++id) {
        given_value & v = given[id];
        if (!v.set) {
            continue;
        }
        v.in.text = v.text.c_str();
        if (ggml_zipmoe_option_parse(id, &v.in, &values[id]) != GGML_ZIPMOE_OK) {
            char expects[256], problem[160] = "";
            ggml_zipmoe_option_expects(id, expects, sizeof(expects));
            if (ggml_zipmoe_option_at(id)->type == GGML_ZIPMOE_TYPE_DEVICE_SIZES) {
                ggml_zipmoe_device_sizes_problem(v.text.c_str(), problem, sizeof(problem));
            }
            throw std::runtime_error(format("%s must be %s; got %s%s%s", v.source.c_str(), expects, v.shown.c_str(),
                                            problem[0] ? ": " : "", problem));
        }
        is_given[id] = true;
    }
    char err[256];
    if (ggml_zipmoe_options_check(values.data(), is_given, false, "zipmoe.", err, sizeof(err)) != GGML_ZIPMOE_OK) {
        throw std::runtime_error(err);
    }
}

// the options from each option's value as given, else the table's default
llama_zipmoe_options from_values(const std::vector<given_value> & given,
                                 const std::vector<ggml_zipmoe_option_value> & values, const bool * is_given) {
    auto number = [&](int id) {
        const ggml_zipmoe_option * o = ggml_zipmoe_option_at(id);
        if (!is_given[id]) {
            return o->value;
        }
        return o->type == GGML_ZIPMOE_TYPE_REAL ? values[id].f : (double) values[id].i;
    };
    llama_zipmoe_options o;
    o.budget         = (uint64_t) number(GGML_ZIPMOE_OPTION_BUDGET);
    o.mem_limit      = (uint64_t) number(GGML_ZIPMOE_OPTION_MEM_LIMIT);
    o.direct_io      = (int) number(GGML_ZIPMOE_OPTION_DIRECT_IO);
    o.preload        = number(GGML_ZIPMOE_OPTION_PRELOAD) != 0;
    o.threads        = (int32_t) number(GGML_ZIPMOE_OPTION_THREADS);
    o.eviction       = (int32_t) number(GGML_ZIPMOE_OPTION_EVICTION);
    o.rank_delta     = (int32_t) number(GGML_ZIPMOE_OPTION_RANK_DELTA);
    for (int p = 0; p < 4; ++p) {
        o.pools[p] = (int32_t) number(GGML_ZIPMOE_OPTION_POOL_F + p);
    }
    o.work_slots     = (int32_t) number(GGML_ZIPMOE_OPTION_WORK_SLOTS);
    o.auto_pools     = number(GGML_ZIPMOE_OPTION_AUTO_POOLS) != 0;
    o.device_stores  = number(GGML_ZIPMOE_OPTION_DEVICE_STORES) != 0;
    o.cpu_compute    = number(GGML_ZIPMOE_OPTION_CPU_COMPUTE) != 0;
    o.replan_tokens  = (int32_t) number(GGML_ZIPMOE_OPTION_REPLAN_TOKENS);
    o.prefetch       = number(GGML_ZIPMOE_OPTION_PREFETCH) != 0;
    o.resident_views = number(GGML_ZIPMOE_OPTION_RESIDENT_VIEWS) != 0;
    o.substitution   = (int32_t) number(GGML_ZIPMOE_OPTION_SUBSTITUTION);
    o.smoe_alpha     = (float) number(GGML_ZIPMOE_OPTION_SMOE_ALPHA);
    o.buddy.tau         = (float) number(GGML_ZIPMOE_OPTION_BUDDY_TAU);
    o.buddy.temperature = (float) number(GGML_ZIPMOE_OPTION_BUDDY_TEMPERATURE);
    o.buddy.gamma       = (float) number(GGML_ZIPMOE_OPTION_BUDDY_GAMMA);
    o.buddy.beta        = (float) number(GGML_ZIPMOE_OPTION_BUDDY_BETA);
    o.buddy.rho         = (int32_t) number(GGML_ZIPMOE_OPTION_BUDDY_RHO);
    o.buddy.search      = (int32_t) number(GGML_ZIPMOE_OPTION_BUDDY_SEARCH);
    o.buddy.eta         = (float) number(GGML_ZIPMOE_OPTION_BUDDY_ETA);
    o.trace_routing  = number(GGML_ZIPMOE_OPTION_TRACE_ROUTING) != 0;
    if (is_given[GGML_ZIPMOE_OPTION_DEVICE_BUDGETS]) {
        o.device_budgets = given[GGML_ZIPMOE_OPTION_DEVICE_BUDGETS].text;
    }
    // a budget from the environment is named as the user set it (an override by its key, the default)
    const ggml_zipmoe_option * budget = ggml_zipmoe_option_at(GGML_ZIPMOE_OPTION_BUDGET);
    if (is_given[GGML_ZIPMOE_OPTION_BUDGET] && given[GGML_ZIPMOE_OPTION_BUDGET].source.rfind(budget->env, 0) == 0) {
        o.budget_source = budget->env;
    }
    return o;
}

} // namespace

llama_zipmoe_options llama_zipmoe_options::parse(
        const std::unordered_map<std::string, llama_model_kv_override> & overrides) {
    std::vector<given_value> given = gather_given(overrides);
    std::vector<ggml_zipmoe_option_value> values(given.size());
    std::unique_ptr<bool[]> is_given(new bool[given.size()]());
    check_given(given, values, is_given.get());
    return from_values(given, values, is_given.get());
}

std::vector<std::string> llama_zipmoe_options::given_names(
        const std::unordered_map<std::string, llama_model_kv_override> & overrides) {
    std::vector<std::string> names;
    for (int id = 0; id < ggml_zipmoe_option_count(); ++id) {
        const char * env = ggml_zipmoe_option_at(id)->env;
        const char * value = env != nullptr ? getenv(env) : nullptr;
        if (value != nullptr && value[0] != '\0') {
            names.push_back(env);
        }
    }
    for (const auto & [key, kv] : overrides) {
        if (key.rfind("zipmoe.", 0) == 0) {
            names.push_back(key);
        }
    }
    return names;
}

// the override type an option's value is given with (--override-kv KEY=TYPE:VALUE)
static const char * override_type(int32_t type) {
    switch (type) {
        case GGML_ZIPMOE_TYPE_BOOL: return "bool";
        case GGML_ZIPMOE_TYPE_INT:  return "int";
        case GGML_ZIPMOE_TYPE_REAL: return "float";
        default:                    return "str";
    }
}

size_t llama_zipmoe_options_usage(char * buf, size_t buf_size) {
    std::string text =
        "for ZipMoE GGUFs: --override-kv zipmoe.NAME=TYPE:VALUE (several comma-separated), or the environment\n"
        "variable; an override wins over the variable, the variable over the default\n\n";
    for (int id = 0; id < ggml_zipmoe_option_count(); ++id) {
        const ggml_zipmoe_option * o = ggml_zipmoe_option_at(id);
        if (o->key == nullptr) {
            continue; // read by the Python layer only
        }
        char expects[512];
        ggml_zipmoe_option_expects(id, expects, sizeof(expects));
        text += format("%-46s %s\n", format("--override-kv %s=%s:VALUE", o->key, override_type(o->type)).c_str(), o->env);
        text += format("        %s (default: %s)\n        VALUE: %s\n", o->help, o->default_text, expects);
    }
    if (buf != nullptr && buf_size > 0) {
        snprintf(buf, buf_size, "%s", text.c_str());
    }
    return text.size();
}
