# shellcheck shell=bash
# Settings for ./run. Every one can be set in the environment or in an untracked
# config.local.sh (the environment wins); what is unset here gets the default below.

# Python environment
: "${PYTHON:=python3}"            # interpreter that creates the venv (3.10 or newer)
: "${VENV:=.venv}"                # where ./run venv puts it
# torch's build in the venv (uv's --torch-backend; ./run test's venv is the dev lock's as it is):
# empty = PyPI's (on Linux the CUDA build, about 5 GB); cpu = the CPU build, for machines without
# a GPU; cu126, cu128, ... a CUDA version's; auto = the one for this machine's driver
: "${TORCH_BACKEND:=}"

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

# Training (train.py options: python train.py --help lists their defaults). Empty = train.py's
# default (ImageNet's: resnet50, 90 epochs, batch 256 per process, 224 px, LR 0.1 per 256 images,
# 5 warmup epochs), or on the demo data its small model and images a CPU trains in minutes
# (run's train_args: resnet18, 8, 32, 64 px, 0.4, 1).
: "${ARCH:=}" "${EPOCHS:=}" "${BATCH_SIZE:=}" "${IMAGE_SIZE:=}" "${LR:=}" "${WARMUP_EPOCHS:=}"
: "${EPOCH_MODE:=}"               # resampled (train.py's default) | exact
: "${WORKERS:=}"                  # DataLoader workers per process; empty = auto, sized where it trains (CPUs per local rank, less 2 on a GPU)
: "${NPROC:=2}"                   # processes for ./run local2, and per host for ./run nodes
: "${RDZV_PORT:=29400}"           # ./run nodes: c10d rendezvous port on the first host
: "${RDZV_ID:=imagenet-ais}"      # ./run nodes: names the job; agents with the same id meet
: "${SSH:=ssh}"                   # ./run nodes: how other hosts are reached (e.g. "ssh -p 2222")
: "${REMOTE_DIR:=$PWD}"           # ./run nodes: this checkout's path on the other hosts
: "${RAY_ADDRESS:=}"              # ./run ray: the cluster (auto, HOST:PORT); empty = a private local one for the run
: "${RAY_WORKERS:=2}"             # ./run ray: training workers
: "${RAY_GPU:=0}"                 # ./run ray: 1 = one GPU per worker
: "${SLURM_NODES:=1}"             # ./run slurm: nodes (NPROC processes, one per GPU, on each)
: "${SLURM_TIME:=04:00:00}"       # ./run slurm: time limit; the job checkpoints and requeues itself before it
: "${SLURM_WARN:=300}"            # ./run slurm: seconds before the limit to stop and checkpoint (SIGUSR1)
: "${SLURM_GPUS:=$NPROC}"         # ./run slurm: --gpus-per-node (0: ask for none, e.g. CPU nodes)
: "${SLURM_CPUS:=$((NPROC * 12))}" # ./run slurm: --cpus-per-task, i.e. CPUs per node (one task per node)
: "${SLURM_EXTRA:=}"              # ./run slurm: more sbatch options, e.g. "--partition gpu --account proj"
: "${SERVE_PORT:=8080}"           # ./run serve: the port nginx listens on
: "${SERVE_ADDR:=127.0.0.1}"      # ./run serve: the address it binds (another than loopback needs SERVE_ALLOW)
: "${SERVE_ALLOW:=}"              # ./run serve: who may read, CIDRs (e.g. "10.0.0.0/8 192.168.1.0/24"), or "all"; empty = this machine
: "${SERVE_TOKEN:=}"              # ./run serve: a bearer token readers must send (train with SHARDS_HTTP_TOKEN set to it)
: "${SERVE_HTPASSWD:=}"           # ./run serve: an htpasswd file: basic auth (train with SHARDS_HTTP_USER/_PASSWORD)
: "${SERVE_CERT:=}"               # ./run serve: PEM certificate and key: HTTPS (clients: REQUESTS_CA_BUNDLE=CA file)
: "${SERVE_KEY:=}"
: "${SERVE_RATE:=}"               # ./run serve: cap per connection, e.g. 100m (bytes/s); empty = none
: "${SERVE_ROOT:=.cache/serve}"   # ./run serve: per-port nginx config, pid file and logs
: "${OUTPUT:=}"                   # run directory; empty = runs/<verb>
: "${UPLOAD:=}"                   # gs://, s3://, ais:// or a directory: checkpoints, metrics and log are uploaded there too
: "${TRAIN_EXTRA:=}"              # more train.py options, split on spaces

# Container (./run build, push, shell, docker2)
: "${BASE_IMAGE:=nvcr.io/nvidia/pytorch:25.12-py3}"  # NGC PyTorch: torch, torchvision, CUDA, NCCL, DALI
: "${REGISTRY:=nvcr.io}"
: "${NGC_ORG:=${NGC_CLI_ORG:-}}"  # your NGC org (the registry path and job submission)
: "${NGC_TEAM:=${NGC_CLI_TEAM:-}}"
: "${IMAGE_NAME:=imagenet-ais}"
: "${IMAGE_TAG:=latest}"
: "${IMAGE:=$REGISTRY/${NGC_ORG:-local}/${NGC_TEAM:+$NGC_TEAM/}$IMAGE_NAME:$IMAGE_TAG}"
: "${RESULTS:=runs/docker}"       # host directory mounted at /results by shell and docker2
: "${DOCKER_GPUS:=all}"           # docker run --gpus (podman: CDI devices nvidia.com/gpu=each of these); none: no GPU
# docker/podman run --ulimit each: NGC's for PyTorch (pinned memory uncapped, a 64 MiB stack). Where
# the engine says "error setting rlimit type N: operation not permitted", give limits the host
# allows (type 6 nproc, 7 nofile, 8 memlock), e.g. "nofile=4096:4096 nproc=4096:4096 stack=67108864"
: "${DOCKER_ULIMITS:=memlock=-1 stack=67108864}"
: "${ENGINE:=auto}"               # container engine: auto (docker if its daemon answers, else podman; buildah to build), docker, podman, buildah
: "${BUILD_OPTS:=}"               # more options for the image build, e.g. podman/buildah: --volume CA.crt:/etc/ssl/certs/ca-certificates.crt:ro

# NGC Base Command (./run singlenode, ais, tail, killall)
: "${NGC_ACE:=${NGC_CLI_ACE:-}}"
: "${NGC_INSTANCE:=dgxa100.80g.8.norm}"
: "${NGC_REPLICAS:=2}"            # nodes for ./run ais
: "${NGC_TOTAL_RUNTIME:=8H}"      # multinode wall-clock limit, [nD][nH][nM][nS]
: "${NGC_RESULT_DIR:=/results}"
: "${NGC_PREEMPT:=RESUMABLE}"     # RESUMABLE: a preempted job restarts and resumes from its checkpoint
: "${NGC_LABEL:=imagenet_ais}"    # marks this project's jobs (killall touches only these)
: "${NGC_JOB_NAME:=imagenet-ais}"
: "${NGC_DATA:=}"                 # DATA inside the job (a mounted dataset path, gs://...); ais uses AIS_BUCKET
: "${NGC_MOUNTS:=}"               # extra ngc flags, e.g. "--datasetid 123:/data --workspace ws:/ws:RO"
: "${NGC_SECRETS:=}"              # NGC secret specs NAME[:KEY[:ALIAS]] (credentials never go on the command line)
: "${AIS_BUCKET:=}"               # ./run ais trains from ais://$AIS_BUCKET at AIS_ENDPOINT
