#!/usr/bin/env bash
# The long-epoch figures of bench/RESULTS.md on a lent GPU host (run AF on): ResNet-50 fed through
# train.py on epochs as long as ImageNet's, against the ceiling of the same call, each rank's step
# times and GPU, and where the time goes (a kernel trace of every rank, and py-spy samples of rank
# 0's threads: which holds the GIL, and what each does).
#
#   bench/long_epochs.sh OUT 4 [NAME=OPTIONS ...]   # 4 GPUs: generate the shards, ceiling, end to end, trace
#   bench/long_epochs.sh OUT 1,2                    # then 1 and 2 GPUs on 16 cores each, as 1- and 2-GPU nodes
#
# NAME=OPTIONS add end-to-end rows with these train.py options (bench/throughput.py --variant), e.g.
# 'dali=--decode dali', or 'noshare=--cpu-share 0' (the workers' own crops off: cpu_share.py). DALI's own loop (bench/dali_train.py) is left out: its reader's epochs are
# passes over these 100,000 images (390 steps at 1 GPU), not ImageNet's length.
# Python packages the host lacks come from .wheels/ when it is there (`pip download` them first:
# webdataset, braceexpand, loguru, tenacity, py-spy). The shards stay in /tmp/long-epochs between
# calls to a machine kept warm.
set -euo pipefail
out=${1:?usage: bench/long_epochs.sh OUT GPUS [NAME=OPTIONS ...]}
gpus=${2:?usage: bench/long_epochs.sh OUT GPUS [NAME=OPTIONS ...]}
shift 2
variants=()
for v in "$@"; do variants+=(--variant "$v"); done
mkdir -p "$out"
# NVLink multicast stays off on shared hosts (the lender's rule)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
wheels=(.wheels/*.whl)
if [ -e "${wheels[0]}" ]; then python3 -m pip install -q --no-index --no-deps "${wheels[@]}"; fi
work=/tmp/long-epochs
mkdir -p "$work"

gpu_state() { # every GPU's clocks, temperature, power and throttle reasons, with the time
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_event_reasons.active \
    --format=csv,noheader >>"$out/gpus.csv"
}

sample_rank0() { # py-spy on rank 0's training process for 15 s, once the first end-to-end run is steady
  command -v py-spy >/dev/null || return 0
  local pid=""
  for _ in $(seq 600); do
    for p in $(pgrep -f 'train.py .*--data' || true); do
      if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q torch.distributed.run; then continue; fi
      # torchrun's rank 0, or a process of its own (one GPU: no LOCAL_RANK)
      if ! tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^LOCAL_RANK=[1-9]'; then pid=$p; fi
    done
    [ -z "$pid" ] || break
    sleep 1
  done
  [ -n "$pid" ] || return 0
  sleep 45 # past compilation and CUDA graph capture, inside the 1,100 steps (--nonblocking: the
  # default pauses the process for each sample, which slowed 4 GPUs from 19,000 img/s to 15,400)
  # which thread holds the GIL, then what every thread does
  py-spy record --nonblocking --gil --threads --rate 100 --duration 10 --format raw -p "$pid" \
    -o "$out/pyspy-gil-$gpus.txt" >/dev/null 2>&1 || true
  py-spy record --nonblocking --threads --idle --rate 50 --duration 10 --format raw -p "$pid" \
    -o "$out/pyspy-threads-$gpus.txt" >/dev/null 2>&1 || true
}

gpu_state
nvidia-smi topo -m >"$out/topo-$gpus.txt" 2>&1 || true
sample_rank0 &
sampler=$!
if [ "$gpus" = 4 ]; then
  python3 bench/throughput.py --preset multi-gpu --gpus 4 --work "$work" --no-breakdown --no-dali-loop \
    --json-out "$out/bench-4.json" ${variants[@]+"${variants[@]}"} 2>&1 | tee "$out/bench-4.log"
  gpu_state
  # kernels of steps 300-320 of every rank (the bench's shards, its long epochs)
  python3 -m torch.distributed.run --standalone --nproc-per-node 4 bench/rank_trace.py --at 300 --steps 20 \
    --keep 0,1 --out "$work/trace" -- --data "$work/shards" --output "$work/trace-run" --epochs 1000 \
    --epoch-size 1281167 --max-steps 330 --log-every 10 --keep-last 1 >"$work/trace.log" 2>&1 \
    || tail -30 "$work/trace.log"
  tail -12 "$work/trace.log"
  cp "$work"/trace/trace-rank-*.json.gz "$out/" 2>/dev/null || true
else
  for n in ${gpus//,/ }; do # a node of n GPUs with 16 cores each
    taskset -c "0-$((16 * n - 1))" python3 bench/throughput.py --preset multi-gpu --gpus "$n" --work "$work" \
      --no-breakdown --no-dali-loop --json-out "$out/bench-$n.json" ${variants[@]+"${variants[@]}"} 2>&1 | tee "$out/bench-$n.log"
  done
fi
gpu_state
kill "$sampler" 2>/dev/null || true
wait
