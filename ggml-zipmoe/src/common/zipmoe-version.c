// Version and build information of ggml-zipmoe.

#include "ggml-zipmoe.h"

#include <pthread.h>
#include <stdio.h>

#define ZIPMOE_STR_(x) #x
#define ZIPMOE_STR(x)  ZIPMOE_STR_(x)

#define ZIPMOE_VERSION_STRING                         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MAJOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MINOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_PATCH)

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

static char           build_info[256];
static pthread_once_t build_info_once = PTHREAD_ONCE_INIT;

static void format_build_info(void) {
    // the recovery paths compiled in (zipmoe-recover.c picks among them at run time)
    snprintf(build_info, sizeof(build_info), "ggml-zipmoe %s (%s; recovery: %s)", ZIPMOE_VERSION_STRING,
             ZIPMOE_COMPILER, ggml_zipmoe_recover_paths());
}

const char * ggml_zipmoe_build_info(void) {
    pthread_once(&build_info_once, format_build_info);
    return build_info;
}
