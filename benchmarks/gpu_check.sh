#!/usr/bin/env bash
# The GPU check of reshard, in two steps (docs/concepts.md, "GPU memory"; benchmarks/README.md, "GPU"):
#
#   benchmarks/gpu_check.sh prepare   # here, with a package registry: the cp312 wheels reshard needs beyond
#                                     # what a CUDA image usually has, into .whl/ (ignored by git)
#   benchmarks/gpu_check.sh run       # on the GPU machine, from the repository root (no registry needed):
#                                     # installs those wheels into /tmp/site, puts src/ on PYTHONPATH (reshard
#                                     # from the working tree, no dependencies resolved), runs the GPU tests and
#                                     # the GPU benchmark; logs and the JSON report go to $OUT (or ./gpu-check/)
#
# The GPU machine this project is lent has Python 3.12 with a CUDA build of torch, numpy, tqdm, fsspec, pytest
# and pytest-timeout; reshard also needs crc32c (not there) and xxhash (carried at the tested version).
# Each step of `run` has its own time limit, so that one hung step still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(crc32c==2.9.post0 xxhash==4.1.0)
SIZE_GIB=${SIZE_GIB:-2}
REPEAT=${REPEAT:-2}

prepare() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
}

run() {
    local out=${OUT:-gpu-check}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the wheels of .whl/ did not install (run 'benchmarks/gpu_check.sh prepare' first)"; exit 2; }
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 -c 'import sys, torch, reshard, crc32c, xxhash; print(sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "xxhash", xxhash.VERSION, "reshard", reshard.__file__)'
        nproc; free -g | head -2; df -h /tmp | tail -1
    } > "$out/env.txt" 2>&1
    cat "$out/env.txt"
    timeout 210 python3 -m pytest -q -ra -p no:cacheprovider tests/io/test_gpu.py tests/io/test_device_paths.py \
        > "$out/tests.log" 2>&1
    echo "tests: exit $?"; tail -25 "$out/tests.log"
    timeout 330 python3 benchmarks/gpu.py --size-gib "$SIZE_GIB" --repeat "$REPEAT" --json "$out/gpu.json" \
        > "$out/bench.log" 2>&1
    echo "benchmark: exit $?"; tail -40 "$out/bench.log"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
esac
