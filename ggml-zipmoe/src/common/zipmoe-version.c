// The version of ggml-zipmoe (its build info, which names the recovery paths, is made in codec/zipmoe-recover.c).

#include "ggml-zipmoe.h"

#define ZIPMOE_STR_(x) #x
#define ZIPMOE_STR(x)  ZIPMOE_STR_(x)

#define ZIPMOE_VERSION_STRING                         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MAJOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_MINOR) "."         \
    ZIPMOE_STR(GGML_ZIPMOE_VERSION_PATCH)

const char * ggml_zipmoe_version(void) {
    return ZIPMOE_VERSION_STRING;
}

int ggml_zipmoe_version_number(void) {
    return GGML_ZIPMOE_VERSION_MAJOR * 10000 + GGML_ZIPMOE_VERSION_MINOR * 100 + GGML_ZIPMOE_VERSION_PATCH;
}
