#!/usr/bin/env bash
# ZipMoE's CUDA build, tests and bench on a GPU machine that reaches no package registry and takes a
# small working tree (docs/CUDA.md). Made here, carried there in .gpucarry/ (git-ignored):
#   devsrc.tar.xz   the prepared (patched) llama.cpp source without its docs and models, + zstd, lz4
#   pylibs.tar.gz   llama-cpp-python's Python package and diskcache (pure Python)
#   *.skel.gguf     model headers (tools/gguf_skeleton.py strip), filled with random weights there
#   site.tar.xz     optional (prebuild): the CUDA build installed, made here, so that the GPU's time
#                   goes to tests and benches rather than to 4 minutes of nvcc
#   capped-run      ../shared/tools/capped-run, for cuda_bench.py --host-cap
# Usage: bash tools/cuda_device.sh prepare        (here, after tools/setup.sh: writes .gpucarry/)
#        bash tools/cuda_device.sh prebuild       (here, optional: needs nvcc, cuBLAS and libcuda's stub;
#                                                   docs/CUDA.md "Building here for the GPU machine")
#        bash tools/cuda_device.sh check [DEADLINE] [bench options] (there: build, test and bench in one call)
#        bash tools/cuda_device.sh check-ds27 [DEADLINE] [UNCAPPED] (there: the same on the DeepSeek-V2-Lite geometry,
#                                                   host memory uncapped, then capped at 12 GiB)
#        bash tools/cuda_device.sh check-stores-ds27 [DEADLINE] (there, after check-ds27 on the same machine: half
#                                                   the experts in VRAM with and without zipmoe.device_stores,
#                                                   and with zipmoe.cpu_compute too)
#        bash tools/cuda_device.sh build|test|bench (there; each resumes what an earlier call began;
#                                                   build takes site.tar.xz when it runs there;
#                                                   bench: phase 1 and phase 2 (codec ghuf) against stock)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$REPO/.gpucarry
B=/tmp/zipmoe-cuda-build
SITE=/tmp/zipmoe-site
MODELS=/tmp/zipmoe-models
OUT=${OUT:-/tmp/zipmoe-out}
PY=${PYTHON:-python3}
export PYTHONPATH=$SITE:/tmp/zipmoe-pylibs PYTHONUNBUFFERED=1
# a prebuilt site's libraries carry $ORIGIN alone: cudart and cuBLAS come from the machine's toolkit
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
export ZIPMOE_CAPPED_RUN=${ZIPMOE_CAPPED_RUN:-$CARRY/capped-run}

fill() { # skeleton name -> filled BF16 GGUF and its ZipMoE GGUF in $MODELS
    mkdir -p $MODELS
    [ -f $MODELS/$2-bf16.gguf ] || $PY $REPO/tools/gguf_skeleton.py fill $CARRY/$1.skel.gguf $MODELS/$2-bf16.gguf
    [ -f $MODELS/$2.zipmoe.gguf ] || (cd /tmp && $PY -c "from zipmoe_py import format as z; z.repack('$MODELS/$2-bf16.gguf', '$MODELS/$2.zipmoe.gguf')")
}

case ${1:-} in
prepare)
    VENV=$REPO/.venv/lib/python3.11/site-packages
    mkdir -p $CARRY /tmp/zipmoe-devsrc
    rm -rf /tmp/zipmoe-devsrc/*
    $REPO/.venv/bin/python $REPO/tools/prepare_source.py --dest /tmp/zipmoe-devsrc/llama.cpp-src
    for dep in zstd lz4 llama-ui; do
        $REPO/.venv/bin/python $REPO/tools/prepare_source.py --pin $REPO/vendor/$dep/pin.json --no-patches \
            --dest /tmp/zipmoe-devsrc/$dep-src
    done
    (cd /tmp/zipmoe-devsrc/llama.cpp-src && rm -rf docs benches media examples app .github .devops &&
     find models -mindepth 1 -not -name 'ggml-vocab-qwen2.gguf*' -not -name 'ggml-vocab-deepseek-llm.gguf*' -not -name 'ggml-vocab-llama-spm.gguf*' -delete)
    tar -C /tmp/zipmoe-devsrc -cJf $CARRY/devsrc.tar.xz llama.cpp-src zstd-src lz4-src llama-ui-src
    tar -C $VENV -czf $CARRY/pylibs.tar.gz llama_cpp diskcache
    cp $REPO/../shared/tools/capped-run $CARRY/capped-run
    # the tests' tiny models (as tests/conftest.py makes them) and the bench model, as headers
    tiny=$(mktemp -d)
    for a in deepseek2 qwen2moe; do
        (cd /tmp && $REPO/.venv/bin/python -c "from zipmoe_py.devtools.tiny import make_tiny; make_tiny('$a', '$tiny/hf-$a', seed=1234)")
        $REPO/.venv/bin/zipmoe-convert $tiny/hf-$a -o $tiny/$a-bf16.gguf --bf16 --quiet
        (cd /tmp && $REPO/.venv/bin/python $REPO/tools/gguf_skeleton.py strip $tiny/$a-bf16.gguf $CARRY/$a.skel.gguf)
    done
    rm -rf $tiny
    # the bench models: bench/make_bench_model.py qwen2moe --layers 6 -o bench/work/qwen6.gguf, and the full
    # DeepSeek-V2-Lite geometry's header grown from deepseek2 --layers 2 -o bench/work/ds2.gguf
    [ -f $REPO/bench/work/ds2.gguf ] && (cd /tmp && $REPO/.venv/bin/python $REPO/tools/gguf_skeleton.py strip \
        $REPO/bench/work/ds2.gguf $CARRY/ds27.skel.gguf --layers 27)
    for m in qwen6; do
        if [ -f $REPO/bench/work/$m.gguf ]; then
            (cd /tmp && $REPO/.venv/bin/python $REPO/tools/gguf_skeleton.py strip $REPO/bench/work/$m.gguf $CARRY/$m.skel.gguf)
        fi
    done
    du -sh $CARRY/*
    ;;
prebuild)
    PB=/tmp/zipmoe-cuda-prebuild
    [ -f $PB/build.ninja ] || cmake -S $REPO -B $PB -G Ninja -DCMAKE_BUILD_TYPE=Release -DZIPMOE_CUDA=ON \
        -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90} \
        -DPython3_EXECUTABLE=$REPO/.venv/bin/python
    cmake --build $PB -j $(nproc)
    # linked against a stub, libggml-cuda must still name the driver: else dlopen fails there
    readelf -d $PB/bin/libggml-cuda.so | grep -q 'libcuda.so.1' ||
        { echo "libggml-cuda.so does not need libcuda.so.1: rebuild with a stub that defines the cu* symbols" >&2; exit 1; }
    rm -rf /tmp/zipmoe-prebuilt && cmake --install $PB --component zipmoe --prefix /tmp/zipmoe-prebuilt >/dev/null
    XZ_OPT=-T0 tar -C /tmp/zipmoe-prebuilt -cJf $CARRY/site.tar.xz .  # xz: the working tree that travels is 64 MiB at most
    du -sh $CARRY/site.tar.xz
    ;;
build)
    mkdir -p $B /tmp/zipmoe-pylibs
    [ -d /tmp/zipmoe-pylibs/llama_cpp ] || tar -xzf $CARRY/pylibs.tar.gz -C /tmp/zipmoe-pylibs
    if [ -f $CARRY/site.tar.xz ] && [ ! -f $B/build.ninja ]; then
        rm -rf $SITE && mkdir -p $SITE && tar -xf $CARRY/site.tar.xz -C $SITE
        cp $REPO/zipmoe_py/*.py $SITE/zipmoe_py/
        if (cd /tmp && $PY -c "from zipmoe_py import _lib; n = _lib.lib().ggml_zipmoe_cuda_devices(); print('CUDA devices (prebuilt):', n); assert n > 0"); then
            exit 0
        fi
        echo "the prebuilt site.tar.xz does not run here: building" >&2
        ldd $SITE/zipmoe_py/lib/libggml-cuda.so | grep 'not found' >&2 || true
    fi
    [ -d $B/llama-ui-src ] || tar -xJf $CARRY/devsrc.tar.xz -C $B
    [ -f $B/build.ninja ] || cmake -S $REPO -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DZIPMOE_CUDA=ON \
        -DGGML_CUDA_FA=OFF -DPython3_EXECUTABLE=$(command -v $PY)
    cmake --build $B -j $(nproc)
    rm -rf $SITE && cmake --install $B --component zipmoe --prefix $SITE >/dev/null
    cp $REPO/zipmoe_py/*.py $SITE/zipmoe_py/
    (cd /tmp && $PY -c "from zipmoe_py import _lib; print('CUDA devices:', _lib.lib().ggml_zipmoe_cuda_devices())")
    ;;
test)
    for a in deepseek2 qwen2moe; do fill $a $a; done
    cd /tmp && ZIPMOE_TEST_MODELS=$MODELS $PY -m pytest -v -p no:cacheprovider -p no:jaxtyping --timeout 300 $REPO/tests/test_cuda.py \
        $REPO/tests/test_codec.py -k "cuda or bit_pattern or lengths" 2>&1 | tee $OUT/cuda_tests.log
    ;;
models)  # the bench model and its two repacks, ahead of bench (it can run beside test)
    fill qwen6 qwen6
    [ -f $MODELS/qwen6.ghuf.gguf ] || (cd /tmp && $PY -c "from zipmoe_py import format as z; z.repack('$MODELS/qwen6-bf16.gguf', '$MODELS/qwen6.ghuf.gguf', codec='ghuf')")
    ;;
bench)
    bash $0 models
    cd /tmp && $PY $REPO/bench/cuda_bench.py --bf16 $MODELS/qwen6-bf16.gguf --zipmoe $MODELS/qwen6.zipmoe.gguf \
        --ghuf $MODELS/qwen6.ghuf.gguf --out $OUT/cuda_bench.json "${@:2}" 2>&1 | tee $OUT/cuda_bench.log
    ;;
models-ds27)  # the full DeepSeek-V2-Lite geometry (ds27.skel.gguf: bench/make_bench_model.py deepseek2 --layers 27);
    # 31 + 22 GB: the qwen6 files go first on a 64 GB disk
    rm -f $MODELS/qwen6*
    fill ds27 ds27
    ;;
bench-ds27)  # NAME: the results' file names in $OUT (default cuda_bench_ds27)
    bash $0 models-ds27
    name=${NAME:-cuda_bench_ds27}
    cd /tmp && $PY $REPO/bench/cuda_bench.py --bf16 $MODELS/ds27-bf16.gguf --zipmoe $MODELS/ds27.zipmoe.gguf \
        --out $OUT/$name.json "${@:2}" 2>&1 | tee $OUT/$name.log
    ;;
check-ds27)  # one device call on the full DeepSeek-V2-Lite geometry: build, the tests beside its fill, the
    # bench with host memory uncapped for UNCAPPED seconds (default 230), then capped at 12 GiB until
    # DEADLINE seconds from the start (default 560); each stopped bench keeps its finished rounds
    deadline=${2:-560}
    uncapped=${3:-230}
    t0=$(date +%s)
    mkdir -p $OUT
    bash $0 build > /tmp/zipmoe-build.log 2>&1 || { tail -c 4000 /tmp/zipmoe-build.log; exit 1; }
    echo "built in $(( $(date +%s) - t0 )) s"
    bash $0 models-ds27 > /tmp/zipmoe-models.log 2>&1 &
    fill=$!
    bash $0 test > /dev/null 2>&1 || true
    tail -n 3 $OUT/cuda_tests.log
    wait $fill || { tail -c 2000 /tmp/zipmoe-models.log; exit 1; }
    echo "models filled at $(( $(date +%s) - t0 )) s"
    timeout $uncapped env NAME=cuda_bench_ds27 bash $0 bench-ds27 --budgets 50,100 --repeats 5 \
        --systems stock-n-cpu-moe-50,zipmoe-n-cpu-moe-50,stock-gpu,zipmoe-100 > /dev/null 2>&1 ||
        echo "the uncapped bench stopped at its time: cuda_bench_ds27.partial.json holds its finished runs"
    tail -n 6 $OUT/cuda_bench_ds27.log
    left=$(( deadline - ($(date +%s) - t0) ))
    echo "capped bench: $left s left"
    timeout $left env NAME=cuda_bench_ds27_cap12g bash $0 bench-ds27 --budgets 50 --repeats 3 --host-cap 12G \
        --systems stock-n-cpu-moe-50,zipmoe-n-cpu-moe-50 > /dev/null 2>&1 ||
        echo "the capped bench stopped at the deadline: cuda_bench_ds27_cap12g.partial.json holds its finished runs"
    tail -n 6 $OUT/cuda_bench_ds27_cap12g.log
    ;;
check-stores-ds27)  # a second call on a machine that ran check-ds27 (its files kept): host memory uncapped,
    # -ngl 99 with half the experts' slots in VRAM, host stores on and off, and with the CPU computing what the
    # balancer gives it, against stock --n-cpu-moe at the same VRAM, until DEADLINE seconds (default 560)
    deadline=${2:-560}
    mkdir -p $OUT
    timeout $deadline env NAME=cuda_bench_ds27_stores bash $0 bench-ds27 --budgets 50 --repeats 5 --device-stores \
        --cpu-compute --systems stock-n-cpu-moe-50,zipmoe-50,zipmoe-stores-50,zipmoe-cpu-50 > /dev/null 2>&1 ||
        echo "the stores bench stopped at the deadline: cuda_bench_ds27_stores.partial.json holds its finished runs"
    tail -n 6 $OUT/cuda_bench_ds27_stores.log
    ;;
check)  # one device call (its 10 minutes): build, the tests beside the bench model's fill, then the bench
    # (bench's options after the deadline) until DEADLINE seconds from the start (default 540); $OUT keeps
    # the build log, the tests' log and the bench's rounds so far, whatever stops first
    deadline=${2:-540}
    t0=$(date +%s)
    mkdir -p $OUT
    bash $0 build > $OUT/build.log 2>&1 || { tail -c 4000 $OUT/build.log; exit 1; }
    echo "built in $(( $(date +%s) - t0 )) s"
    bash $0 models > $OUT/models.log 2>&1 &
    fill=$!
    bash $0 test > /dev/null 2>&1 || true
    tail -n 3 $OUT/cuda_tests.log
    wait $fill || { tail -c 2000 $OUT/models.log; exit 1; }
    left=$(( deadline - ($(date +%s) - t0) ))
    echo "bench: $left s left"
    timeout $left bash $0 bench "${@:3}" > /dev/null 2>&1 ||
        echo "the bench stopped at the deadline: cuda_bench.partial.json holds its finished runs"
    tail -n 12 $OUT/cuda_bench.log
    ;;
*)
    echo "usage: bash tools/cuda_device.sh prepare|prebuild|build|test|models|bench|models-ds27|bench-ds27|check|check-ds27|check-stores-ds27" >&2
    exit 2
    ;;
esac
