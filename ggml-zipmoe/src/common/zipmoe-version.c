// Version and build information of ggml-zipmoe.

#include "ggml-zipmoe.h"

#define ZIPMOE_STR_(x) #x
#define ZIPMOE_STR(x)  ZIPMOE_STR_(x)

#define ZIPMOE_VERSION_STRING                         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MAJOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MINOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_PATCH)

// the recovery paths zipmoe-recover.c compiles in (it picks among them at run time)
#if defined(__x86_64__) || defined(__i386__)
#    define ZIPMOE_RECOVERY_PATHS "avx512bw avx2 scalar"
#else
#    define ZIPMOE_RECOVERY_PATHS "scalar"
#endif

#if defined(__clang__)
#    define ZIPMOE_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#    define ZIPMOE_COMPILER "gcc " __VERSION__
#else
#    define ZIPMOE_COMPILER "unknown compiler"
#endif

const char * ggml_zipmoe_version(void) {
    return ZIPMOE_VERSION_STRING;
}

int ggml_zipmoe_version_number(void) {
    return GGML_ZIPMOE_VERSION_MAJOR * 10000 + GGML_ZIPMOE_VERSION_MINOR * 100 + GGML_ZIPMOE_VERSION_PATCH;
}

const char * ggml_zipmoe_build_info(void) {
    return "ggml-zipmoe " ZIPMOE_VERSION_STRING " (" ZIPMOE_COMPILER "; recovery: " ZIPMOE_RECOVERY_PATHS ")";
}
