#!/usr/bin/env bash
# Issue #48's rows on one lent GPU (bench/RESULTS.md runs AQ-AZ): where the step is fast, each
# against its own ceiling in the same call, with the GPU's clocks, temperature, power and
# throttle reasons every 5 s (OUT/gpus.csv).
#
#   bench/fast_steps.sh OUT own none default reduce-overhead   # a user's loop (bench/own_loop.py) per torch.compile mode
#   bench/fast_steps.sh OUT own default -- --cpu-share 0.5     # after --: more of own_loop.py's options, for each mode
#   bench/fast_steps.sh OUT spy default                        # the same under py-spy --native: OUT/spy.log splits each thread
#   bench/fast_steps.sh OUT beside default                     # each part of the feed beside that loop's step, in turns (bench/beside_step.py)
#   bench/fast_steps.sh OUT beside reduce-overhead -- --image-size 160 --variants decode,feed   # beside_step's options after --
#   bench/fast_steps.sh OUT train 160 192                      # train.py's ResNet-50 at these sizes
#   bench/fast_steps.sh OUT resnet18 [full|MAX_SIDE...]        # train.py's ResNet-18 bs512 at 224 px, from the shards as generated (full, the default)
#                                                              # or converted again with --max-side MAX_SIDE --quality 90
#   bench/fast_steps.sh OUT indexed [converted] [hub]          # train.py's ResNet-50 at 224 px from the converted shards, and from
#                                                              # the same pictures in the hub's layout (bench/hub_copy.py), indexed in place
#
# Each own-loop row takes 2-3 minutes (torch.compile from a cold cache the longest), each
# train.py size about 100 s, a beside row about 6 minutes: put what fits in one call's time after it. The shards (40,000
# generated 500×375 q95 JPEGs of 1,000 classes, about 75 s to make) stay in /tmp/fast-steps
# between calls to a machine kept warm. Python packages the host lacks come from .wheels/ when
# it is there (as for bench/long_epochs.sh: webdataset, braceexpand, loguru, tenacity, py-spy;
# nvidia-nvimgcodec-cu13 and nvidia-nvjpeg for beside's nvimgcodec variant).
set -euo pipefail
usage="usage: bench/fast_steps.sh OUT own|spy|beside MODE... [-- OPTION...] | train SIZE... | resnet18 [full|MAX_SIDE...] | indexed [converted] [hub]"
out=$(realpath -m "${1:?$usage}")
what=${2:?$usage}
shift 2
extra=()  # own_loop.py's options after --
for i in $(seq 1 $#); do
  if [ "${!i}" = -- ]; then
    extra=("${@:i+1}")
    set -- "${@:1:i-1}"
    break
  fi
done
case $what in
  own | spy | beside | train) [ $# -gt 0 ] || { echo "$usage" >&2 && exit 2; } ;;
  resnet18 | indexed) ;;
  *) echo "$usage" >&2 && exit 2 ;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
wheels=(.wheels/*.whl)
if [ -e "${wheels[0]}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/fast-steps-site "${wheels[@]}"
  export PATH=/tmp/fast-steps-site/bin:$PATH PYTHONPATH=/tmp/fast-steps-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
work=/tmp/fast-steps
nvidia-smi --query-gpu=timestamp,clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active,utilization.gpu \
  --format=csv,noheader -l 5 >>"$out/gpus.csv" &
health=$!
trap 'kill $health 2>/dev/null || true' EXIT
if [ "$what" != beside ] && [ ! -f "$work/shards/manifest.json" ]; then
  python3 imagenet_shards.py synth "$work/tree" --classes 1000 --train-per-class 40 --val-per-class 0 \
    --size 500 375 --quality 95 --workers "$(nproc)" >/dev/null
  python3 imagenet_shards.py convert "$work/tree" "$work/shards" --splits train --workers "$(nproc)" >/dev/null
fi
bench() { # SHARDS OPTION...: train.py's rows, ceiling and fed, epochs as long as ImageNet's
  local data=$1
  shift
  python3 bench/throughput.py --gpus 1 --data "$data" --work "$work/label" --no-breakdown --no-dali-loop "$@"
}
loop() { # SCRIPT NAME OPTION...: bench/SCRIPT.py under torchrun, 32 queues as docs/library.md's loop sets before CUDA starts
  local script=$1 name=$2
  shift 2
  CUDA_DEVICE_MAX_CONNECTIONS=32 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    "bench/$script.py" --json-out "$out/$name.jsonl" "$@" "${extra[@]}" >>"$out/$name.log" 2>&1 \
    || echo "$script $* failed: see $out/$name.log" >&2
  tail -1 "$out/$name.jsonl" 2>/dev/null || true
}
own() { loop own_loop own --data "$work/shards" "$@"; }
case $what in
  own) for mode in "$@"; do own --compile "$mode"; done ;;
  spy) # where each thread's time goes, ceiling against fed (bench/spy_split.py)
    for mode in "$@"; do
      own --compile "$mode" --profile "$out/spy-$mode.txt" --profile-mode native
      python3 bench/spy_split.py "$out/spy-$mode-ceiling.txt" "$out/spy-$mode.txt" | tee -a "$out/spy.log" \
        || echo "no py-spy samples for --compile $mode: see $out/own.log" >&2
    done
    ;;
  beside) # the feed's parts apart, in this process and in one of their own (generated JPEGs: no shards needed)
    for mode in "$@"; do loop beside_step beside --compile "$mode"; done
    ;;
  train)
    for size in "$@"; do bench "$work/shards" --preset multi-gpu --image-size "$size" --json-out "$out/train-$size.json"; done
    ;;
  resnet18)
    for side in "${@:-full}"; do
      if [ "$side" = full ]; then
        bench "$work/shards" --preset resnet18 --json-out "$out/resnet18.json"
        continue
      fi # smaller stored pictures (docs/shards.md's --max-side)
      [ -f "$work/shards-$side/manifest.json" ] || python3 imagenet_shards.py convert "$work/tree" "$work/shards-$side" \
        --splits train --max-side "$side" --quality 90 --workers "$(nproc)" >/dev/null
      bench "$work/shards-$side" --preset resnet18 --json-out "$out/resnet18-$side.json"
    done
    ;;
  indexed) # shards another tool made, indexed where they are, against ours (the same bytes)
    if [ ! -f "$work/hub/manifest.json" ]; then
      python3 bench/hub_copy.py "$work/shards" "$work/hub"
      start=$EPOCHREALTIME
      python3 imagenet_shards.py index "$work/hub" --workers "$(nproc)" | tee "$out/index.log"
      awk -v b="$(du -sb "$work/hub" | cut -f1)" -v s="$(awk -v a="$start" -v z="$EPOCHREALTIME" 'BEGIN { print z - a }')" \
        'BEGIN { printf "index: %d bytes in %.1f s (with start-up)\n", b, s }' | tee -a "$out/index.log"
    fi
    [ $# -gt 0 ] || set -- converted hub
    for which in "$@"; do
      data=$work/shards
      [ "$which" = converted ] || data=$work/hub
      bench "$data" --preset multi-gpu --json-out "$out/$which.json"
    done
    ;;
esac
