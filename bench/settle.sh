#!/usr/bin/env bash
# Issue #65's goal 4 on one lent GPU (bench/RESULTS.md run BC): how soon the feed settles. train.py's
# ResNet-18 bs512 from `--max-side 256 --quality 90` shards, or ResNet-50 bs256 at 160 px from the
# generated 500×375 q95 ones (bench/fast_steps.sh's `resnet18 256` and `train 160` rows), fed for
# STEPS steps in an epoch as long as ImageNet's, against the ceiling (`--synthetic`) of the same
# call: the rate from step 100 to 500 and to the end, and every 50 steps the rate, data wait and
# the share the workers cropped (bench/settle.py), with the GPU's clocks, temperature, power and
# throttle reasons every 5 s (OUT/gpus.csv).
#
#   bench/settle.sh OUT resnet18-256 auto= fixed='--cpu-share 0.24'   # NAME=OPTIONS: train.py's options for a fed run
#   bench/settle.sh OUT resnet50-160 base@/tmp/base= head=   # NAME@TREE=: train.py of another tree (a path from
#                                                            # the checkout's root), e.g. git archive COMMIT | tar -xC /tmp/base
#
# STEPS (1100) and CEILING_STEPS (400) in the environment set the runs' lengths, RUN_LIMIT (300 s)
# the most a run may take (one whose feed stopped is ended and named, and the next one runs); TRACE=1
# runs each under bench/stall_trace.py (its trace in OUT/trace-ROW-NAME/, its --x- options among
# OPTIONS). The shards (40,000
# generated pictures, about 100 s to make) stay in /tmp/fast-steps between calls to a machine
# kept warm, shared with bench/fast_steps.sh. Python packages the host lacks come from .wheels/.
set -euo pipefail
usage="usage: bench/settle.sh OUT resnet18-256|resnet50-160 NAME[@TREE]=OPTIONS..."
out=$(realpath -m "${1:?$usage}")
row=${2:?$usage}
shift 2
[ $# -gt 0 ] || { echo "$usage" >&2 && exit 2; }
steps=${STEPS:-1100}
ceiling_steps=${CEILING_STEPS:-400}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
here=$PWD
case $row in
  resnet18-256) model=(--arch resnet18 --batch-size 512 --image-size 224) shards=shards-256 ;;
  resnet50-160) model=(--arch resnet50 --batch-size 256 --image-size 160) shards=shards ;;
  *) echo "$usage" >&2 && exit 2 ;;
esac
mkdir -p "$out"
wheels=(.wheels/*.whl)
if [ -e "${wheels[0]}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/fast-steps-site "${wheels[@]}"
  export PATH=/tmp/fast-steps-site/bin:$PATH PYTHONPATH=/tmp/fast-steps-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
work=/tmp/fast-steps
nvidia-smi --query-gpu=timestamp,clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active,utilization.gpu \
  --format=csv,noheader -l 5 >>"$out/gpus.csv" &
health=$!
trap 'kill $health 2>/dev/null || true' EXIT
shards_cli() { PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} python3 imagenet_shards.py "$@" --workers "$(nproc)" >/dev/null; }
if [ ! -f "$work/shards/manifest.json" ]; then
  shards_cli synth "$work/tree" --classes 1000 --train-per-class 40 --val-per-class 0 --size 500 375 --quality 95
  shards_cli convert "$work/tree" "$work/shards" --splits train
fi
if [ ! -f "$work/shards-256/manifest.json" ]; then # docs/shards.md's --max-side
  shards_cli convert "$work/tree" "$work/shards-256" --splits train --max-side 256 --quality 90
fi
common=("${model[@]}" --epochs 1000 --log-every 10 --keep-last 1 --compile --compile-mode reduce-overhead --epoch-size 1281167)
train() { # NAME TREE OPTION...: one fresh train.py run of TREE's, its records in OUT/ROW-NAME.jsonl
  local name=$1 tree=$2
  shift 2
  rm -rf "$work/runs/$name"
  echo "$(date -u +%T) $row $name: $tree/train.py $*" | tee -a "$out/runs.log"
  local python=(python3)
  if [ -n "${TRACE:-}" ]; then python+=("$here/bench/stall_trace.py" "$out/trace-$row-$name"); fi
  local rc=0
  (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout -k 30 "${RUN_LIMIT:-300}" "${python[@]}" train.py \
    "${common[@]}" "$@" --output "$work/runs/$name") >>"$out/train-$row.log" 2>&1 || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "$row $name took over ${RUN_LIMIT:-300} s and was ended: see $out/train-$row.log" >&2
  elif [ "$rc" != 0 ]; then
    echo "$row $name failed: see $out/train-$row.log" >&2
  fi
  cp "$work/runs/$name/metrics.jsonl" "$out/$row-$name.jsonl" 2>/dev/null || true
}
train ceiling . --synthetic --max-steps "$ceiling_steps"
names=()
for variant in "$@"; do
  name=${variant%%=*} options=${variant#*=} tree=.
  if [[ $name == *@* ]]; then tree=${name#*@} name=${name%%@*}; fi
  read -ra opts <<<"$options"
  train "$name" "$tree" --data "$work/$shards" --workers auto --decode auto "${opts[@]}" --max-steps "$steps"
  names+=("$name=$out/$row-$name.jsonl")
done
PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} python3 bench/settle.py --row "$row" --ceiling "$out/$row-ceiling.jsonl" --json-out "$out/$row.json" "${names[@]}" \
  | tee -a "$out/report.txt"
