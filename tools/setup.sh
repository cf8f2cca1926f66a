#!/usr/bin/env bash
# Install ZipMoE and everything it needs into ./.venv, from scratch or incrementally.
#
#   bash tools/setup.sh          # the fork, its bindings, the server and the Hugging Face converter (zipmoe[server,convert])
#   bash tools/setup.sh --dev    # + pytest, the OpenAI client, Selenium and chromium (web UI test),
#                                #   llama.cpp's own test programs, nvcc if absent, and the AArch64
#                                #   build with qemu-user and an arm64 Python (tools/aarch64.py)
#   bash tools/setup.sh --cuda   # with CUDA: ggml's CUDA backend, expert slots in GPU memory
#                                # (needs the CUDA toolkit; architectures: the GPU found, else 90;
#                                # CUDA_ARCHITECTURES=87 bash tools/setup.sh --cuda for Jetson Orin)
#
# Reruns are cheap: the pinned sdist is cached (~/.cache/zipmoe/sdist or
# $ZIPMOE_SDIST_CACHE) and the CMake build directory build/ is reused.
set -euo pipefail

dev=0
cuda=0
for arg in "$@"; do
    case "$arg" in
        --dev) dev=1 ;;
        --cuda) cuda=1 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
venv="$root/.venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# Debian packages: patch(1) applies the patch series; with --dev, clang and its runtimes build the
# coverage-guided libFuzzer harness (tests/test_fuzz.py; without them it uses its gcc driver)
apt_install() {  # PACKAGE... (as root; otherwise say what is missing)
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
    else echo "setup: $* missing; install with: apt-get install $*" >&2; return 1; fi
}
if ! command -v patch >/dev/null; then
    echo "setup: installing patch(1)"
    apt_install patch || exit 1
fi
# ccache: a rebuild, or a build in a fresh clone on the same machine, compiles only what changed
# (ggml's CMake uses it for every target when it is on the PATH; CCACHE_BASEDIR makes its hits
# independent of the clone's folder)
if ! command -v ccache >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: installing ccache (later builds reuse what did not change)"
    apt_install ccache || echo "setup: building without ccache" >&2
fi
export CCACHE_BASEDIR="$root"
if [ "$dev" = 1 ] && ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null; then
    echo "setup: installing chromium and its driver (the web UI test of llama-server)"
    apt_install chromium chromium-driver || echo "setup: the web UI test will fail without chromium" >&2
fi
if [ "$dev" = 1 ] && ! dpkg -s libclang-rt-14-dev >/dev/null 2>&1 && command -v apt-get >/dev/null; then
    echo "setup: installing clang and libFuzzer (for the fuzz test)"
    apt_install clang-14 libclang-rt-14-dev || echo "setup: the fuzz test will use its gcc driver" >&2
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    "$python" -m venv "$venv"
fi

# PyTorch is needed by the upstream converter; pin the CPU build so that pip does not
# resolve a multi-GB CUDA build (2.13.0 is the version checked with transformers 4.57.6)
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "setup: installing torch (CPU)"
    "${pip[@]}" install -q "torch==2.13.0"
fi

# llama-cpp-python's ctypes layer only: LLAMA_BUILD=OFF compiles nothing, our libllama is used
sdist=$("$venv/bin/python" tools/prepare_source.py --fetch-only)
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("llama_cpp_python") != "0.3.36")' 2>/dev/null; then
    echo "setup: installing the llama-cpp-python 0.3.36 bindings (no native build)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${pip[@]}" install -q "$sdist"
fi

# with --dev, nvcc for the compile check of ZipMoE's CUDA source (tests/test_build.py): the CUDA
# toolkit's if installed, else NVIDIA's PyPI packages in the venv (nvidia/cu13/bin/nvcc)
if [ "$dev" = 1 ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ] &&
   ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("nvidia-cuda-nvcc")' 2>/dev/null; then
    echo "setup: installing nvcc (NVIDIA's PyPI packages) for the CUDA compile check"
    "${pip[@]}" install -q "nvidia-cuda-nvcc==13.5.37" "nvidia-cuda-crt==13.5.37" "nvidia-nvvm==13.5.37" \
        "nvidia-cuda-runtime==13.5.37"
fi

extras="[server,convert]"   # zipmoe-server; Hugging Face checkpoints and the tiny demo model (torch, transformers)
cmake_args=()
if [ "$dev" = 1 ]; then
    extras="[server,convert,test]"
    cmake_args=(-C cmake.define.ZIPMOE_BUILD_UPSTREAM_TESTS=ON)
fi
if [ "$cuda" = 1 ]; then
    cmake_args+=(-C cmake.define.ZIPMOE_CUDA=ON)
    if [ -n "${CUDA_ARCHITECTURES:-}" ]; then
        cmake_args+=(-C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES")
    fi
else
    cmake_args+=(-C cmake.define.ZIPMOE_CUDA=OFF)
fi
echo "setup: building and installing zipmoe (first build takes several minutes)"
start=$(date +%s)
"${pip[@]}" install -q ${cmake_args[@]+"${cmake_args[@]}"} ".$extras"
echo "setup: zipmoe installed in $(( $(date +%s) - start )) s; commands are in $venv/bin"

# a plain `import llama_cpp` (llama-cpp-python's own API and tests) looks for libllama in llama_cpp/lib,
# which the bindings-only install leaves empty: point it at ours (a folder link, so $ORIGIN RPATHs hold)
(cd / && "$venv/bin/python" - <<'EOF'   # from /: the source tree's zipmoe_py holds no build
import importlib.util, os
from zipmoe_py import _paths
link = os.path.join(importlib.util.find_spec("llama_cpp").submodule_search_locations[0], "lib")
if os.path.islink(link) or not os.path.exists(link):
    if os.path.islink(link):
        os.remove(link)
    os.symlink(_paths.LIB_DIR, link, target_is_directory=True)
EOF
)

# with --dev, the AArch64 build run under qemu-user (tests/test_aarch64.py): Debian's cross compilers,
# qemu-user and an arm64 Python (as root), then the fork cross-compiled into build/aarch64
if [ "$dev" = 1 ]; then
    echo "setup: the AArch64 build (cross compilers, qemu-user, an arm64 Python; first build takes minutes)"
    start=$(date +%s)
    "$venv/bin/python" tools/aarch64.py setup && "$venv/bin/python" tools/aarch64.py build ||
        echo "setup: the AArch64 tests will fail without it (tools/aarch64.py --help)" >&2
    echo "setup: AArch64 build in $(( $(date +%s) - start )) s"
fi
