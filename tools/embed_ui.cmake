# Embeds a prebuilt web UI into ui.cpp / ui.h for the fork's llama-server, with upstream's templates
# (tools/ui/ui.h.in, ui.cpp.in) and the same table and gzip encoding as upstream's
# scripts/ui-assets.cmake. Upstream's script takes the UI only from an npm build of tools/ui or a
# download, and checks for the files of that build; the UI embedded here is the prebuilt one pinned in
# vendor/llama-ui/pin.json.
#
#   cmake -DUI_DIST_DIR=... -DUI_TEMPLATE_DIR=... -DUI_BINARY_DIR=... -P embed_ui.cmake
cmake_minimum_required(VERSION 3.21)

foreach(var UI_DIST_DIR UI_TEMPLATE_DIR UI_BINARY_DIR)
    if (NOT ${var})
        message(FATAL_ERROR "embed_ui.cmake: ${var} is not set")
    endif()
endforeach()
if (NOT EXISTS "${UI_DIST_DIR}/index.html")
    message(FATAL_ERROR "embed_ui.cmake: no index.html in ${UI_DIST_DIR}")
endif()

set(ENV{SOURCE_DATE_EPOCH} 0)   # gzip headers without a timestamp: the same bytes, the same ETags
file(GLOB assets LIST_DIRECTORIES false RELATIVE "${UI_DIST_DIR}" "${UI_DIST_DIR}/*")
list(SORT assets)

set(gzip_dir "${UI_BINARY_DIR}/ui-gzip")
file(REMOVE_RECURSE "${gzip_dir}")
file(MAKE_DIRECTORY "${gzip_dir}")
set(ASSET_ARRAYS "")
set(ASSET_TABLE "")
set(idx 0)
foreach(name IN LISTS assets)
    file(ARCHIVE_CREATE OUTPUT "${gzip_dir}/${name}" PATHS "${UI_DIST_DIR}/${name}" FORMAT raw COMPRESSION GZip)
    file(READ "${gzip_dir}/${name}" hex HEX)
    string(REGEX REPLACE "(..)" "0x\\1," bytes "${hex}")
    file(SHA256 "${gzip_dir}/${name}" etag)
    if (name MATCHES "\\.html$")
        set(mime "text/html; charset=utf-8")
    elseif (name MATCHES "\\.js$")
        set(mime "application/javascript")
    elseif (name MATCHES "\\.css$")
        set(mime "text/css")
    else()
        set(mime "application/octet-stream")
    endif()
    string(APPEND ASSET_ARRAYS "static const unsigned char asset_${idx}[] = {${bytes}};\n")
    string(APPEND ASSET_TABLE
        "    { \"${name}\", asset_${idx}, sizeof(asset_${idx}), \"\\\"${etag}\\\"\", \"${mime}\" },\n")
    math(EXPR idx "${idx} + 1")
endforeach()

set(LLAMA_UI_HAS_ASSETS 1)
set(N_ASSETS ${idx})
set(USE_GZIP true)
configure_file("${UI_TEMPLATE_DIR}/ui.h.in"   "${UI_BINARY_DIR}/ui.h"   @ONLY)
configure_file("${UI_TEMPLATE_DIR}/ui.cpp.in" "${UI_BINARY_DIR}/ui.cpp" @ONLY)
message(STATUS "ZipMoE: llama-server's web UI embedded (${N_ASSETS} files)")
