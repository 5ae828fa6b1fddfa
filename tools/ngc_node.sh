#!/usr/bin/env bash
# What every node of an NGC job runs (see ./run singlenode / ais): maps NGC's array variables to
# one torchrun per node and starts train.py with --resume auto, so a RESUMABLE job that was
# preempted continues from its last checkpoint. Arguments go to train.py.
# DRY_RUN=1 prints the torchrun command instead; TRAIN_PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

nnodes=${NGC_ARRAY_SIZE:-1}
node_rank=${NGC_ARRAY_INDEX:-0}
master=${NGC_MASTER_ADDR:-127.0.0.1}
if [ -n "${NGC_GPUS_PER_NODE:-}" ]; then
  nproc=$NGC_GPUS_PER_NODE
else
  nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "$nproc" -ge 1 ] || nproc=1
fi

cmd=("${TRAIN_PYTHON:-python}" -m imagenet_ais.cli.torchrun --nnodes "$nnodes" --nproc-per-node "$nproc"
  --node-rank "$node_rank" --master-addr "$master" --master-port "${MASTER_PORT:-29500}"
  train.py --resume auto "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}" | sed 's/ $//'
  echo
else
  exec "${cmd[@]}"
fi
