// ggml-zipmoe options: the one table of ZipMoE's run-time options.
//
// Every surface derives from this table: the fork's model loader (KV overrides --override-kv
// zipmoe.NAME=TYPE:VALUE, environment variables ZIPMOE_NAME) validates against it, and the Python
// layer (zipmoe_py/options.py) builds from it Llama's zipmoe_* keyword arguments and docstring,
// zipmoe-chat's and zipmoe-server's flags and docs/OPTIONS.md's options table. Ranges, defaults and help
// texts are written here and nowhere else.
//
// Precedence, for the loader: a KV override, else the environment variable, else the default.

#pragma once

#include "ggml-zipmoe.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

// the options, in the table's order (ggml_zipmoe_option_at(id))
enum ggml_zipmoe_option_id {
    GGML_ZIPMOE_OPTION_BUDGET,
    GGML_ZIPMOE_OPTION_DEVICE_BUDGETS,
    GGML_ZIPMOE_OPTION_MEM_LIMIT,
    GGML_ZIPMOE_OPTION_DIRECT_IO,
    GGML_ZIPMOE_OPTION_PRELOAD,
    GGML_ZIPMOE_OPTION_THREADS,
    GGML_ZIPMOE_OPTION_EVICTION,
    GGML_ZIPMOE_OPTION_RANK_DELTA,
    GGML_ZIPMOE_OPTION_POOLS,
    GGML_ZIPMOE_OPTION_PLAN,
    GGML_ZIPMOE_OPTION_POOL_F,
    GGML_ZIPMOE_OPTION_POOL_C,
    GGML_ZIPMOE_OPTION_POOL_S,
    GGML_ZIPMOE_OPTION_POOL_E,
    GGML_ZIPMOE_OPTION_WORK_SLOTS,
    GGML_ZIPMOE_OPTION_AUTO_POOLS,
    GGML_ZIPMOE_OPTION_DEVICE_STORES,
    GGML_ZIPMOE_OPTION_CPU_COMPUTE,
    GGML_ZIPMOE_OPTION_REPLAN_TOKENS,
    GGML_ZIPMOE_OPTION_PREFETCH,
    GGML_ZIPMOE_OPTION_RESIDENT_VIEWS,
    GGML_ZIPMOE_OPTION_SUBSTITUTION,
    GGML_ZIPMOE_OPTION_SMOE_ALPHA,
    GGML_ZIPMOE_OPTION_BUDDY_PROFILE,
    GGML_ZIPMOE_OPTION_BUDDY_TAU,
    GGML_ZIPMOE_OPTION_BUDDY_TEMPERATURE,
    GGML_ZIPMOE_OPTION_BUDDY_GAMMA,
    GGML_ZIPMOE_OPTION_BUDDY_BETA,
    GGML_ZIPMOE_OPTION_BUDDY_RHO,
    GGML_ZIPMOE_OPTION_BUDDY_SEARCH,
    GGML_ZIPMOE_OPTION_BUDDY_ETA,
    GGML_ZIPMOE_OPTION_TRACE_ROUTING,
    GGML_ZIPMOE_OPTION_COUNT,
};

enum ggml_zipmoe_option_type {
    GGML_ZIPMOE_TYPE_SIZE  = 0, // bytes: a whole number, or text like 4G, 512M, 1.5GiB (binary units)
    GGML_ZIPMOE_TYPE_BOOL  = 1, // true or false (text: 1/0, true/false, yes/no, on/off)
    GGML_ZIPMOE_TYPE_INT   = 2, // a whole number in [min, max]
    GGML_ZIPMOE_TYPE_REAL  = 3, // a number in [min, max]
    GGML_ZIPMOE_TYPE_NAME  = 4, // one of the names ggml_zipmoe_option_choice gives
    GGML_ZIPMOE_TYPE_POOLS = 5, // "F=4,C=8,E=2": the Python layer turns it into the pool_* options
    GGML_ZIPMOE_TYPE_PATH  = 6, // a file the Python layer reads (a plan, a buddy profile)
    GGML_ZIPMOE_TYPE_DEVICE_SIZES = 7, // "CUDA0=6G CPU=8G": a size per device (by ggml's device name), separated
                                       // by spaces (commas are taken too, but split llama.cpp's --override-kv)
};

// where an option is given (ggml_zipmoe_option.surfaces)
enum ggml_zipmoe_option_surface {
    GGML_ZIPMOE_SURFACE_LOADER = 1, // a KV override and an environment variable, read by the model loader
    GGML_ZIPMOE_SURFACE_PYTHON = 2, // Llama's zipmoe_NAME, zipmoe-chat's --NAME, zipmoe-server's --zipmoe_NAME
};

struct ggml_zipmoe_option {
    const char * name;     // "budget": zipmoe_budget in Python, --budget in zipmoe-chat
    const char * key;      // "zipmoe.budget" (KV override), NULL if the loader does not read it
    const char * env;      // "ZIPMOE_BUDGET", NULL if the loader does not read it
    int32_t      type;     // enum ggml_zipmoe_option_type
    int32_t      surfaces; // enum ggml_zipmoe_option_surface, or'ed
    double       min;      // INT and REAL: the range
    double       max;
    double       also;     // INT and REAL: one more value allowed outside the range (NAN: none)
    double       value;    // the default as a value (NAME: its choice's index); see default_text
    const char * unit;     // INT: what is counted ("threads"), NULL if nothing in particular
    const char * note;     // what special values mean ("0: all of the graph's threads"), or NULL
    const char * default_text; // the default in words ("from the memory available", "16")
    const char * help;     // one line: what the option does
    int32_t      requires;     // this option needs option `requires` ...
    int32_t      requires_value; // ... to have this value (a NAME's index), or -1 for none
};

// the number of options, and option id (enum ggml_zipmoe_option_id); NULL if out of range
GGML_ZIPMOE_API int                               ggml_zipmoe_option_count(void);
GGML_ZIPMOE_API const struct ggml_zipmoe_option * ggml_zipmoe_option_at(int id);

// the option named `name` ("budget"), keyed `name` ("zipmoe.budget") or with that environment
// variable ("ZIPMOE_BUDGET"); -1 if none
GGML_ZIPMOE_API int          ggml_zipmoe_option_find(const char * name);

// a NAME option's k-th choice ("lru"), NULL past the last; NULL for other types
GGML_ZIPMOE_API const char * ggml_zipmoe_option_choice(int id, int k);

// what a value of option id must be, in words ("a whole number of threads from 0 to 4096 (0: all
// of the graph's threads)"), into buf (always NUL-terminated); the length it needs, or -1
GGML_ZIPMOE_API int          ggml_zipmoe_option_expects(int id, char * buf, size_t size);

// a size in words for a message, the inverse of a SIZE option's text: "1.25 GiB", "18.0 KiB", "512
// bytes", in the unit that keeps the number at 1 or more, so that no size reads 0.00 GiB. Into buf
// (always NUL-terminated, truncated to size); returns buf
GGML_ZIPMOE_API const char * ggml_zipmoe_size_text(uint64_t bytes, char * buf, size_t size);

// how a value was given: as text (an environment variable, a string override, Python's str()) or
// typed (a KV override's int, float or bool)
enum ggml_zipmoe_option_given {
    GGML_ZIPMOE_GIVEN_TEXT = 0,
    GGML_ZIPMOE_GIVEN_INT  = 1,
    GGML_ZIPMOE_GIVEN_REAL = 2,
    GGML_ZIPMOE_GIVEN_BOOL = 3,
};

struct ggml_zipmoe_option_input {
    int32_t      given; // enum ggml_zipmoe_option_given
    const char * text;  // GIVEN_TEXT
    int64_t      i;     // GIVEN_INT, GIVEN_BOOL (0 or 1)
    double       f;     // GIVEN_REAL
};

// a checked value: SIZE, INT, BOOL (0/1) and NAME (the choice's index) in i; REAL in f
struct ggml_zipmoe_option_value {
    int64_t i;
    double  f;
};

// checks the input against option id's type and range: OK with *out set, or GGML_ZIPMOE_ERR_ARG
// (ggml_zipmoe_option_expects says what was wanted). A size is taken from text or an int, a whole
// number from text or an int, a number from text, an int or a float, a bool from text or a bool,
// a name from text only; POOLS and PATH are not the library's to check.
GGML_ZIPMOE_API int ggml_zipmoe_option_parse(int id, const struct ggml_zipmoe_option_input * in,
                                             struct ggml_zipmoe_option_value * out);

// entry k of a DEVICE_SIZES value: the device's name into name (always NUL-terminated) and its size into
// *bytes. OK; GGML_ZIPMOE_ERR_ARG past the last entry or where the text is malformed.
GGML_ZIPMOE_API int ggml_zipmoe_device_size_at(const char * text, int k, char * name, size_t name_size,
                                               uint64_t * bytes);

// what is wrong with a DEVICE_SIZES value, in words naming the entry ("CPU's size 0 is not more than 0",
// "device CUDA0 is named twice") into buf; buf empty where the text is well formed. OK, or
// GGML_ZIPMOE_ERR_ARG for a NULL argument.
GGML_ZIPMOE_API int ggml_zipmoe_device_sizes_problem(const char * text, char * buf, size_t size);

// the rules between options (SMoE's alpha needs substitution smoe, pools need rank eviction):
// values[id] holds option id's value where given[id] is true. only_given: a rule applies only when
// both options are given (the Python layer, which cannot see the environment); otherwise an option
// not given counts with its default (the loader). OK, or GGML_ZIPMOE_ERR_ARG with a message into
// err naming the options as prefix + name ("zipmoe." or "zipmoe_").
GGML_ZIPMOE_API int ggml_zipmoe_options_check(const struct ggml_zipmoe_option_value * values, const bool * given,
                                              bool only_given, const char * prefix, char * err, size_t size);

#ifdef __cplusplus
}
#endif
