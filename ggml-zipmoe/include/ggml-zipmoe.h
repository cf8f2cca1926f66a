// ggml-zipmoe: lossless on-demand expert serving for BF16 Mixture-of-Experts models.
//
// This is the one public header of ZipMoE's C library. llama.cpp (through our patch
// series) and the Python bindings (zipmoe_py/_lib.py, one ctypes declaration per
// function here) use nothing else. All functions are thread-safe; the library keeps
// no global mutable state.

#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && !defined(__MINGW32__)
#    ifdef GGML_ZIPMOE_BUILD
#        define GGML_ZIPMOE_API __declspec(dllexport)
#    else
#        define GGML_ZIPMOE_API __declspec(dllimport)
#    endif
#else
#    define GGML_ZIPMOE_API __attribute__((visibility("default")))
#endif

#define GGML_ZIPMOE_VERSION_MAJOR 0
#define GGML_ZIPMOE_VERSION_MINOR 1
#define GGML_ZIPMOE_VERSION_PATCH 0

// library version as "MAJOR.MINOR.PATCH" (static storage, never freed)
GGML_ZIPMOE_API const char * ggml_zipmoe_version(void);

// library version as MAJOR*10000 + MINOR*100 + PATCH, for compile/run-time checks
GGML_ZIPMOE_API int          ggml_zipmoe_version_number(void);

// short, human-readable build description: version, compiler, SIMD paths compiled in
GGML_ZIPMOE_API const char * ggml_zipmoe_build_info(void);

#ifdef __cplusplus
}
#endif
