# shellcheck shell=bash
# Settings for ./run. Every one can be set in the environment or in an untracked
# config.local.sh (the environment wins); what is unset here gets the default below.

# Python environment
: "${PYTHON:=python3}"            # interpreter that creates the venv (3.10 or newer)
: "${VENV:=.venv}"                # where ./run venv puts it

# Data: a shard location holding manifest.json. Empty = the embedded demo, generated once.
: "${DATA:=}"
: "${DEMO_DIR:=data/demo}"        # demo tree and shards go here
: "${DEMO_CLASSES:=10}"
: "${DEMO_TRAIN_PER_CLASS:=160}"
: "${DEMO_VAL_PER_CLASS:=30}"

# AIStore: DATA=ais://bucket/prefix reads from the cluster at AIS_ENDPOINT (token: AIS_AUTHN_TOKEN).
# Unset, ./run uses the local playground (./run ais-up) when it is running.
: "${AIS_ENDPOINT:=}"
: "${AIS_ROOT:=.cache/ais}"       # the local playground's configs, data and logs

# Training (train.py options). The demo gets a small model and images that a CPU trains in minutes.
if [ -z "$DATA" ]; then
  : "${ARCH:=resnet18}" "${EPOCHS:=8}" "${BATCH_SIZE:=32}" "${IMAGE_SIZE:=64}" "${LR:=0.4}" "${WARMUP_EPOCHS:=1}"
fi
: "${ARCH:=resnet50}"
: "${EPOCHS:=90}"
: "${BATCH_SIZE:=256}"            # per process
: "${IMAGE_SIZE:=224}"
: "${LR:=0.1}"                    # per 256 images, scaled by the global batch
: "${WARMUP_EPOCHS:=5}"
: "${EPOCH_MODE:=resampled}"      # resampled | exact
: "${WORKERS:=}"                  # DataLoader workers per process; empty = CPU cores / processes, at most 8
: "${NPROC:=2}"                   # processes for ./run local2
: "${OUTPUT:=}"                   # run directory; empty = runs/<verb>
: "${UPLOAD:=}"                   # gs://, ais:// or a directory: checkpoints, metrics and log are uploaded there too
: "${TRAIN_EXTRA:=}"              # more train.py options, split on spaces
