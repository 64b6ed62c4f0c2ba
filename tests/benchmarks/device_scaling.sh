#!/usr/bin/env bash
# Issue 13's scaling series on a lent many-core machine: plugserve --workers 1 2 4 8
# beside the bare aiohttp handler, c=256, the serving benchmark's MLP on ONNX Runtime's
# CPU provider. The GPU machine has 16 cores and no network. Its image has Python 3.12
# with most of plugserve's packages (/work/.library/device/KINDS.md) but lacks orjson,
# structlog, watchfiles and pyinstrument, and wrk.
#
#   here:   bash tests/benchmarks/device_scaling.sh prepare
#           (wheels of the missing packages and wrk's .deb files into .device/, which
#           .git/info/exclude keeps out of git)
#   there:  the device tool's run, in one call:
#           command: bash tests/benchmarks/device_scaling.sh run
#           carry: [".device"], timeout_s: 480 (about 5 minutes on 16 cores, which
#           leaves a rerun within a session's 15 minutes of device time)
#   or, for issues 13 and 14 and the GPU test in one call (session 13 ran this):
#           command: bash tests/benchmarks/device_scaling.sh all
#           carry: [".device"], timeout_s: 595
#
# Issue 14 on the same machine's GPU (isolated runners against in-worker ones, the model
# on CUDA: one copy of it and full batches for every worker, where in-worker runners hold
# one copy each; whether the image's ONNX Runtime has the CUDA provider, its `pip list`
# line above the table says):
#           command: bash tests/benchmarks/device_scaling.sh run --isolated --workers 1 2 4
#                    --runner 'providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]'
#
# `run` takes more of the serving benchmark's options after it (a later one wins), and
# prints the serving benchmark's table and the req/s by worker count, and writes
# them to $OUT/scaling.txt. MLServer is not run (it needs a network to install).
# Not run by CI.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dev=$root/.device
python=${PYTHON:-python3}

out=${OUT:-/tmp}

# Installs the carried wheels and wrk (once a machine) and sets the environment.
setup() {
    if [ ! -d /tmp/site ]; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site "$dev"/whl/*.whl
        for deb in "$dev"/deb/*.deb; do dpkg -x "$deb" /tmp/wrk-root; done
    fi
    export PYTHONPATH=/tmp/site:$root PYTHONUNBUFFERED=1
    export PATH=/tmp/wrk-root/usr/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/wrk-root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    if ldd "$(command -v wrk)" | grep 'not found'; then
        echo "wrk cannot load a library (above): carry its .deb too" >&2
        exit 1
    fi
    if [ -z "${SETUP_SHOWN:-}" ]; then
        export SETUP_SHOWN=1
        echo "cores: $(nproc)"
        "$python" -m pip list 2>/dev/null \
            | grep -iE '^(aiohttp|grpcio|protobuf|onnxruntime|numpy|uvloop|torch) '
    fi
    cd "$root"
}

case "${1:-}" in
prepare)
    grep -qxF '/.device/' "$root/.git/info/exclude" 2>/dev/null \
        || echo '/.device/' >>"$root/.git/info/exclude"
    rm -rf "$dev" && mkdir -p "$dev/whl" "$dev/deb"
    # The packages plugserve needs that the machine's image lacks (KINDS.md's list), and
    # grpcio and protobuf at the versions its generated gRPC code is tested with, in case
    # the image's are older: /tmp/site comes first on the path there.
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dev/whl" orjson structlog watchfiles pyinstrument \
        'grpcio>=1.81' 'protobuf>=6.33.5,<7'
    (cd "$dev/deb" && apt-get download -q wrk libluajit-5.1-2 libluajit-5.1-common)
    du -sh "$dev"
    ;;
run)
    setup
    bash "$0" serving scaling --workers 1 2 4 8 --concurrency 256 --rounds 3 --duration 6 "${@:2}"
    ;;
all)
    # Both issues in one call (timeout_s 595; about 9 minutes): the machine, the scaling
    # series, the isolation series (both shortened to fit), then the GPU test of isolated
    # runners. Each stage has a limit of its own, so one that hangs leaves the next its
    # time, and writes a file of its own under $OUT. A dry run here: all --rounds 1 --duration 1
    setup
    {
        nvidia-smi -L || true
        "$python" -c 'import onnxruntime as o; print("ONNX Runtime providers:", o.get_available_providers())' || true
    } 2>&1 | tee "$out/machine.txt"
    timeout -s INT -k 10 215 bash "$0" serving scaling --workers 1 2 4 8 --concurrency 256 \
        --rounds 3 --duration 4 "${@:2}" || true
    pkill -f 'server serve' || true
    timeout -s INT -k 10 245 bash "$0" serving isolation --isolated --workers 1 2 \
        --concurrency 1 64 --rounds 3 --duration 3 --only plugserve "${@:2}" || true
    pkill -f 'server serve' || true
    timeout -s INT -k 10 110 "$python" -m pytest -q -p no:cacheprovider -o addopts= \
        tests/server/processes/test_isolation.py -k gpu 2>&1 | tee "$out/gpu.txt" || true
    ;;
serving)
    # One series of the serving benchmark into $OUT/<name>.txt (for `run` and `all`).
    setup
    name=$2
    "$python" -m tests.benchmarks.serving --wrk-threads 4 --only bare plugserve "${@:3}" 2>&1 \
        | tee "$out/$name.txt"
    ;;
*)
    echo "usage: $0 prepare|run|all [serving benchmark options]" >&2
    exit 2
    ;;
esac
