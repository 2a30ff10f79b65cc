#!/usr/bin/env bash
# The accuracy runs issue 38 asks for that this shared 2-core host cannot make in a session (a CPU core
# here gives a process about 10%: 15 pretraining epochs alone took over an hour), for one machine with a
# GPU and 16 cores. Parts (default: sparse_update tinytrain), with their expected wall on one H200 + 16 cores:
#
#   sparse_update   Sparse Update as the paper runs it (proxy contribution search, flash, 256 KiB) against
#                   full, last layer, bias-only and tuned bias-only, 5 seeds, widened lrs; arms in parallel
#                   processes, backbone pretrained on the GPU (about 7 minutes: the proxy analysis alone
#                   took 208 s in the void first run, which failed on fork after GPU autograd, now fixed)
#   tinytrain       TinyTrain's few-shot accuracy with widened lrs, 3 seeds x 10 episodes (about 2-3 minutes)
#   elastictrainer  the ElasticTrainer accuracy runs whose picks sat at a grid edge, widened: the H100 run's
#                   setting (MobileNetV2, rotation 90) and the head-only regime (x0.5, labels=1) (about 6 minutes)
#
#   bash benchmarks/reproduce/device_accuracy.sh --out DIR [PART ...]
#
# Without CUDA it writes DIR/skipped.json and exits 0. Each part writes DIR/<part>*.json and .log.
set -euo pipefail
[ "${1:-}" = "--out" ] && [ -n "${2:-}" ] || { echo "usage: $0 --out DIR [PART ...]" >&2; exit 2; }
out=$2
shift 2
parts=${*:-sparse_update tinytrain}
mkdir -p "$out"
py=${PYTHON:-python}
here=$(dirname "$0")
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo '{"skipped": "no CUDA device"}' > "$out/skipped.json"
    echo "no CUDA device: skipped (wrote $out/skipped.json)"
    exit 0
fi
export OMP_NUM_THREADS=1
for part in $parts; do
    start=$(date +%s)
    case $part in
    sparse_update)
        "$py" "$here/sparse_update/run.py" --pretrain-device cuda --jobs 15 --pretrain-epochs 15 --steps 400 \
            --seeds 0 1 2 3 4 --skip-emulation --arms full last_layer bn_bias bn_bias_tuned sparse_update_searched \
            --out "$out/sparse_update_paper_method.json" 2>&1 | tee "$out/sparse_update_paper_method.log" ;;
    tinytrain)
        "$py" "$here/tinytrain/run.py" --pretrain-device cuda --jobs 15 --pretrain-epochs 5 --skip-emulation \
            --out "$out/tinytrain_widened.json" 2>&1 | tee "$out/tinytrain_widened.log" ;;
    elastictrainer)
        "$py" "$here/elastictrainer_accuracy/run.py" --device cuda --models mobilenetv2 \
            --out "$out/elastictrainer_rotation90_widened.json" 2>&1 | tee "$out/elastictrainer_rotation90_widened.log"
        "$py" "$here/elastictrainer_accuracy/run.py" --device cuda --models mobilenetv2 --width-mult 0.5 \
            --source-n 6000 --target-n 1500 --pretrain-epochs 10 10 --shifts labels=1 --strategies full elastic_0.5 \
            --out "$out/elastictrainer_labels_widened.json" 2>&1 | tee "$out/elastictrainer_labels_widened.log" ;;
    *) echo "unknown part $part (sparse_update, tinytrain, elastictrainer)" >&2; exit 2 ;;
    esac
    echo "$part: $(( $(date +%s) - start )) s" | tee -a "$out/walls.txt"
done
