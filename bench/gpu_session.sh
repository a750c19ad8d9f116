#!/usr/bin/env bash
# Everything a lent GPU machine is for, in as few device calls as possible: what the machine
# has, the GPU test suite (per-step path, then the persistent kernels), the GPU benchmark.
# Run from the repository root ON the GPU machine, with its own python3 (CuPy, torch, Numba
# already there; nothing is installed):
#   bash bench/gpu_session.sh tests        # gpu-marked tests, per-step path, then persistent
#   bash bench/gpu_session.sh bench-quick  # python -m fusedrnn bench --device gpu --quick
#   bash bench/gpu_session.sh bench        # the full GPU benchmark (per-step path)
#   bash bench/gpu_session.sh grid MODE    # the GPU size grid of one mode (4 x 6 x 6 sizes,
#                                          # inference and training; one call per mode keeps
#                                          # each under the device's 10 minutes)
#   bash bench/gpu_session.sh tiles        # the persistent products' register tile and
#                                          # slices (FUSEDRNN_GPU_TILE): parity of the
#                                          # tiled plans, then the design-doc cases under
#                                          # each, cuDNN beside; what the plan's rule awaits
#   bash bench/gpu_session.sh all-tests    # every gpu-marked test in one run, the half
#                                          # precision ones included (a fresh machine's
#                                          # first compiles: ~6 min; at most 9)
#   bash bench/gpu_session.sh half         # issue 25: the design size in float16 and
#                                          # bfloat16 against cuDNN in the same dtype
#                                          # (fusedrnn as by default, with its float32
#                                          # products, and without its 16-byte staging
#                                          # loads), after the phases per step with and
#                                          # without those loads (at most 9 min)
#   bash bench/gpu_session.sh anchor       # issue 41: the design size (LSTM, GRU; 1 layer
#                                          # and 5 bidirectional) and the batch sweep against
#                                          # cuDNN strict (TF32 off) and default, the
#                                          # persistent kernels' phases with the backward's
#                                          # GEMMs, and peak memory against cuDNN's with the
#                                          # 1,000-step growth check (at most 8 min)
#   bash bench/gpu_session.sh lease        # one whole lease in one call, by priority under
#                                          # one deadline (LEASE_S, 560 s): every GPU test
#                                          # (4 workers), gpu_checks (host synchronisation,
#                                          # reduce-overhead capture), the phases with the
#                                          # backward's dh product on its default loop and on
#                                          # the tiled one (FUSEDRNN_GPU_TILED_DH=1), anchor's
#                                          # design size, memory and growth, the decoder step,
#                                          # the batch sweep; everything packed into
#                                          # $OUT/lease.tgz after each step (the device returns
#                                          # 8 files); exits 0 whatever the steps did
# Logs and JSON go to $OUT (the device tool's return folder), else ./gpu-session. The golden
# vectors travel with the tree (tests/golden).
# Each phase runs under a hard timeout: a persistent kernel whose grid is not co-resident
# would spin on its barrier forever, and that must end the phase, not the whole call.
set -u
OUT=${OUT:-gpu-session}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=python3

info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv 2>&1
    $PY -c "import sys, numpy, numba, cupy, torch; print('python', sys.version.split()[0],
'numpy', numpy.__version__, 'numba', numba.__version__, 'cupy', cupy.__version__,
'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
}

pytest_gpu() {   # $1: log name, $2: seconds, rest: pytest arguments
    local log=$1 limit=$2
    shift 2
    timeout -s KILL "$limit" $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts= -rfE \
        --maxfail=30 "$@" > "$OUT/$log" 2>&1
    echo "== $log: exit $? (137: killed at ${limit} s)"
    grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/$log" | tail -40
}

phase=${1:-tests}
shift || true
case "$phase" in
    tests)   # extra arguments go to pytest (e.g. -k features)
        info | tee "$OUT/info.txt"
        pytest_gpu tests.log 330 tests/gpu/test_parity.py tests/torch/test_cuda.py \
            -k "not persistent" "$@"
        FUSEDRNN_GPU_PERSISTENT=1 pytest_gpu persistent.log 200 tests/gpu/test_parity.py \
            -k persistent "$@"
        ;;
    bench-quick)   # the per-step path, then the persistent kernels where they fit
        for persistent in 0 1; do
            FUSEDRNN_GPU_PERSISTENT=$persistent timeout -s KILL 280 $PY -m fusedrnn bench \
                --device gpu --quick --json "$OUT/gpu-quick-p$persistent.json" \
                --plot "$OUT/gpu-quick-p$persistent.png" "$@" 2>&1 \
                | tee "$OUT/bench-quick-p$persistent.log" | tr '\r' '\n' | grep -v '^\['
        done
        ;;
    bench)   # FUSEDRNN_GPU_PERSISTENT passes through; extra arguments go to the CLI
        timeout -s KILL 580 $PY -m fusedrnn bench --device gpu \
            --json "$OUT/gpu.json" --plot "$OUT/gpu-batch.png" "$@" 2>&1 \
            | tee "$OUT/bench.log" | tr '\r' '\n' | grep -v '^\['
        ;;
    grid)   # $1: the mode; 20 ms blocks: GPU calls are short and 1152 cells are many
        mode=${1:?usage: bash bench/gpu_session.sh grid MODE}
        shift
        timeout -s KILL 580 $PY -m fusedrnn bench --device gpu --cases grid \
            --filter "^$mode " --repeats 3 --block-ms 20 --peers fusedrnn,torch \
            --json "$OUT/gpu-grid-$mode.json" --heatmap "$OUT/gpu-grid-$mode.png" "$@" 2>&1 \
            | tee "$OUT/grid-$mode.log" | tr '\r' '\n' | grep -v '^\['
        ;;
    tiles)   # extra arguments go to the CLI; at most 9 minutes (the phases' timeouts)
        info | tee "$OUT/info.txt"
        for tile in 4 2,16; do   # tiled plans against the CPU (the persistent tests)
            FUSEDRNN_GPU_TILE=$tile pytest_gpu "parity-tile-$tile.log" 120 \
                tests/gpu/test_parity.py -k persistent
        done
        for tile in 1,1 2 4 4,8; do   # 1,1: the plan's default, the first form
            echo "== FUSEDRNN_GPU_TILE=$tile"
            FUSEDRNN_GPU_TILE=$tile timeout -s KILL 75 $PY -m fusedrnn bench --device gpu \
                --cases design-doc --filter "^(lstm|gru) T=300 N=20 I=800 H=800 (infer|train)" \
                --peers fusedrnn,torch --repeats 3 --json "$OUT/gpu-tile-$tile.json" "$@" 2>&1 \
                | tee "$OUT/tile-$tile.log" | tr '\r' '\n' | grep -E '^\| (lstm|gru)'
        done
        ;;
    all-tests)   # extra arguments go to pytest (e.g. -k float16)
        info | tee "$OUT/info.txt"
        pytest_gpu all-tests.log 540 tests/gpu tests/torch/test_cuda.py "$@"
        ;;
    half)   # extra arguments go to fusedrnn.benchmark.half (e.g. --modes lstm --rounds 2)
        info | tee "$OUT/info.txt"
        for wide in 1 0; do   # the phases with and without the 16-byte staging loads
            echo "== FUSEDRNN_GPU_WIDE_STAGING=$wide"
            FUSEDRNN_GPU_WIDE_STAGING=$wide timeout -s KILL 70 \
                $PY -m fusedrnn.benchmark.gpu_phases --dtype float16 --modes lstm,gru 2>&1 \
                | tee "$OUT/half-phases-wide$wide.log"
        done
        timeout -s KILL 390 $PY -m fusedrnn.benchmark.half --device cuda --rounds 1 \
            --modes lstm,gru "$@" 2>&1 | tee "$OUT/half.log"
        ;;
    anchor)   # extra arguments go to the design-doc bench (e.g. --repeats 5)
        info | tee "$OUT/info.txt"
        timeout -s KILL 200 $PY -m fusedrnn bench --device gpu --cases design-doc \
            --filter '^(lstm|gru) ' --peers fusedrnn,torch,torch-strict --repeats 3 \
            --json "$OUT/anchor-design.json" "$@" 2>&1 | tee "$OUT/anchor-design.log" \
            | tr '\r' '\n' | grep -E '^\| (case|lstm|gru)'
        timeout -s KILL 120 $PY -m fusedrnn bench --device gpu --cases batch \
            --peers fusedrnn,torch,torch-strict --repeats 3 --json "$OUT/anchor-batch.json" \
            --plot "$OUT/anchor-batch.png" 2>&1 | tee "$OUT/anchor-batch.log" \
            | tr '\r' '\n' | grep -E '^\| (case|lstm)'
        timeout -s KILL 70 $PY -m fusedrnn.benchmark.gpu_phases --modes lstm,gru 2>&1 \
            | tee "$OUT/anchor-phases.log"
        timeout -s KILL 150 $PY -m fusedrnn.benchmark.gpu_memory --modes lstm,gru \
            --batches 20,256 --steps 0 --json "$OUT/anchor-memory.json" 2>&1 \
            | tee "$OUT/anchor-memory.log"
        timeout -s KILL 60 $PY -m fusedrnn.benchmark.gpu_memory --modes lstm --batches 20 \
            --steps 1000 --json "$OUT/anchor-growth.json" 2>&1 | tee "$OUT/anchor-growth.log"
        ;;
    lease)   # each step's limit is its cap or what is left of the deadline, the smaller
        DEADLINE=$(( $(date +%s) + ${LEASE_S:-560} ))
        final=$OUT
        OUT=$(mktemp -d)
        cap() { local left=$(( DEADLINE - $(date +%s) )); echo $(( left < $1 ? left : $1 )); }
        step() {   # $1: cap in seconds, $2: log name, rest: the command
            local limit
            limit=$(cap "$1")
            if [ "$limit" -lt 15 ]; then echo "== $2: skipped, the deadline"; return; fi
            shift
            local log=$1
            shift
            echo "== $log (limit ${limit} s)"
            timeout -s KILL "$limit" "$@" > "$OUT/$log" 2>&1
            echo "== $log: exit $? (137: killed)"
            tr '\r' '\n' < "$OUT/$log" | grep -E '^\| |passed|failed|^(FAILED|ERROR)|^check ' \
                | tail -40
            tar czf "$final/lease.tgz" -C "$OUT" .   # after every step: a killed call keeps it
        }
        info | tee "$OUT/info.txt"
        step 220 all-tests.log $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts= -rfE \
            --maxfail=30 -n 4 tests/gpu tests/torch/test_cuda.py
        step 60 checks.log $PY -m fusedrnn.benchmark.gpu_checks
        step 50 phases.log $PY -m fusedrnn.benchmark.gpu_phases --modes lstm,gru
        FUSEDRNN_GPU_TILED_DH=1 step 50 phases-tiled-dh.log $PY -m fusedrnn.benchmark.gpu_phases \
            --modes lstm,gru
        peers=fusedrnn,torch,torch-strict
        step 130 anchor-design.log $PY -m fusedrnn bench --device gpu --cases design-doc \
            --filter '^(lstm|gru) ' --peers $peers --repeats 3 --json "$OUT/anchor-design.json"
        step 150 anchor-memory.log $PY -m fusedrnn.benchmark.gpu_memory --modes lstm,gru \
            --batches 20,256 --steps 0 --json "$OUT/anchor-memory.json"
        step 90 anchor-growth.log $PY -m fusedrnn.benchmark.gpu_memory --modes lstm \
            --batches 20 --steps 1000 --json "$OUT/anchor-growth.json"
        step 40 seq2seq.log $PY -m fusedrnn bench --device gpu --cases seq2seq --peers $peers \
            --repeats 3 --json "$OUT/seq2seq.json"
        step 90 anchor-batch.log $PY -m fusedrnn bench --device gpu --cases batch \
            --peers $peers --repeats 3 --json "$OUT/anchor-batch.json"
        ;;
    *)
        echo "usage: bash bench/gpu_session.sh [tests|all-tests|bench-quick|bench|grid MODE|tiles|half|anchor|lease] [arguments]" >&2
        exit 2
        ;;
esac
