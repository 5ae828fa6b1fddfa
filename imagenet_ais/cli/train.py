"""Train a torchvision classifier on ImageNet WebDataset shards (single process or torchrun DDP)."""

from __future__ import annotations

import os
import re
import signal
import sys

import click
from click.core import ParameterSource

from imagenet_ais.cli.one_line import one_line
from imagenet_ais.errors import EXIT_PREEMPTED, ConfigError
from imagenet_ais.loader.augment import POLICIES
from imagenet_ais.loader.cpu_share import checked
from imagenet_ais.loader.mixture import parse_source
from imagenet_ais.loader.shard_loader import DECODES, EPOCH_MODES, MAX_IMAGE_SIZE, max_workers
from imagenet_ais.train.config import OPTIMIZERS, RECIPES, SCHEDULE_NAMES, SCHEDULES, TrainConfig, with_recipe
from imagenet_ais.train.decentralized import TOPOLOGIES
from imagenet_ais.train.loop import train
from imagenet_ais.train.trackers import TRACKERS

DEFAULTS = TrainConfig()  # the options' defaults are the config's
STOPS = {signal.SIGTERM, signal.SIGINT}  # what stops a run: SIGTERM, and Ctrl-C's SIGINT


def parse_bytes(value: str | None) -> int | None:
    """``"500G"`` → 500 × 2**30 (K, M, G, T: powers of 1024; no suffix: bytes)."""
    if value is None:
        return None
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)I?B?", value.strip().upper())
    if not found:
        raise click.BadParameter(f"{value!r} is not a size: bytes, or a number with K, M, G or T (e.g. 500G)")
    return int(float(found[1]) * 1024 ** " KMGT".index(found[2] or " "))


def parse_workers(value: str) -> int | None:
    """``auto`` → None (sized on the node that trains, see distributed.auto_workers), else a count."""
    if value == "auto":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > max_workers():
        raise click.BadParameter(f"{value!r} is neither 'auto' nor a number of workers (0 to {max_workers()} here)")
    return int(value)


def parse_share(value: str) -> float | str:
    try:
        return checked(value)
    except ConfigError as e:
        raise click.BadParameter(str(e).removeprefix(f"--cpu-share {value}: ")) from None


QUICK_CPU = (
    "A quick run on a CPU or a few hundred images (seconds, not hours):\n\n"
    "\b\n  train.py --data DIR --output runs/quick --arch resnet18 --image-size 64 --batch-size 16 \\\n"
    "      --epochs 2 --warmup-epochs 0.5"
)


@click.command(context_settings={"show_default": True, "max_content_width": 100}, epilog=QUICK_CPU)
@click.option(
    "--data",
    "data",
    multiple=True,
    help="shard location holding manifest.json (directory, file://, ais://, gs://, s3://, http(s)://); repeat it "
    "as LOCATION:WEIGHT to train on several mixed (docs/training.md#several-shard-sets-mixed)",
)
@click.option("--val-data", help="the shard location to validate on (default: the first --data)")
@click.option(
    "--recipe",
    type=click.Choice(list(RECIPES)),
    help="settings of a known recipe (fast: FFCV's; v2: torchvision's V2) for the options not given; see the README",
)
@click.option(
    "--launcher-defaults",
    default="",
    hidden=True,  # ./run's: which of the options it passes are its own defaults (a --recipe overrides them)
    help="comma-separated option names",
)
# torchvision's reference names work too: --output-dir, --model, -b, -j, --print-freq, --train-crop-size, ...
@click.option("--output", "--output-dir", default=DEFAULTS.output, help="checkpoints, metrics.jsonl and logs go here")
@click.option(
    "--arch", "--model", default=DEFAULTS.arch, help="any torchvision classification model, or timm/NAME: timm's"
)
@click.option("--epochs", default=DEFAULTS.epochs, type=click.IntRange(min=1))
@click.option("--batch-size", "-b", default=DEFAULTS.batch_size, type=click.IntRange(min=1), help="per process")
@click.option(
    "--opt",
    default=DEFAULTS.opt,
    type=click.Choice(OPTIMIZERS),
    help="sgd: with Nesterov momentum; lamb, lars: timm's (for large global batches; ./run venv --extra timm)",
)
@click.option(
    "--lr", default=DEFAULTS.lr, type=float, help="peak learning rate per 256 images (scaled by global batch)"
)
@click.option("--warmup-epochs", "--lr-warmup-epochs", default=DEFAULTS.warmup_epochs, type=click.FloatRange(min=0))
@click.option(
    "--lr-scheduler",
    default=DEFAULTS.lr_scheduler,
    type=click.Choice([*SCHEDULES, *SCHEDULE_NAMES], case_sensitive=False),
    callback=lambda ctx, param, value: SCHEDULE_NAMES.get(value.lower(), value.lower()),
    help="after the warmup: cosine to 0; step: × --lr-gamma every --lr-step-size epochs; onecycle: torch's "
    "OneCycleLR (a cosine rise over the warmup from 1/25 of the peak); torchvision's names too",
)
@click.option("--lr-step-size", default=DEFAULTS.lr_step_size, type=click.IntRange(min=1), help="epochs (step)")
@click.option("--lr-gamma", default=DEFAULTS.lr_gamma, type=click.FloatRange(min=0), help="factor (step)")
@click.option("--momentum", default=DEFAULTS.momentum, type=click.FloatRange(min=0), help="sgd, rmsprop")
@click.option("--weight-decay", "--wd", default=DEFAULTS.weight_decay, type=float, help="of the other parameters")
@click.option("--norm-weight-decay", default=DEFAULTS.norm_weight_decay, type=float, help="of norm layers and biases")
@click.option("--label-smoothing", default=DEFAULTS.label_smoothing, type=click.FloatRange(0, 1))
@click.option("--mixup-alpha", default=DEFAULTS.mixup_alpha, type=click.FloatRange(min=0), help="Mixup (0: off)")
@click.option(
    "--cutmix-alpha",
    default=DEFAULTS.cutmix_alpha,
    type=click.FloatRange(min=0),
    help="CutMix (0: off; both: one per batch)",
)
@click.option(
    "--auto-augment",
    type=click.Choice(POLICIES),
    help="per-sample policy after the crop: AutoAugment's imagenet, RandAugment, TrivialAugmentWide, AugMix",
)
@click.option(
    "--random-erase",
    default=DEFAULTS.random_erase,
    type=click.FloatRange(0, 1),
    help="probability of erasing a random box of each training image",
)
@click.option("--model-ema", is_flag=True, help="keep an exponential moving average of the weights (validated, saved)")
@click.option(
    "--model-ema-steps", default=DEFAULTS.model_ema_steps, type=click.IntRange(min=1), help="steps per update"
)
@click.option(
    "--model-ema-decay",
    default=DEFAULTS.model_ema_decay,
    type=click.FloatRange(0, 1),
    help="decay, adjusted to the global batch, --model-ema-steps and --epochs as torchvision's recipe does",
)
@click.option("--model-ema-best", is_flag=True, help="choose best.pt on the EMA's validation top-1")
@click.option("--clip-grad-norm", type=click.FloatRange(min=0, min_open=True), help="clip the gradients' global norm")
@click.option("--sync-bn", is_flag=True, help="BatchNorm statistics over all ranks (GPUs only)")
@click.option(
    "--weights",
    help="start from this state dict or checkpoint file (torchvision's or train.py's), or torchvision's weights by "
    "name (e.g. ResNet50_Weights.IMAGENET1K_V2: downloaded once into torch hub's cache); --resume's checkpoint wins",
)
@click.option("--test-only", is_flag=True, help="validate --weights or --resume's model on the val split, then stop")
@click.option(
    "--workers",
    "-j",
    default="auto",
    callback=lambda ctx, param, value: parse_workers(value),
    help="DataLoader workers per process; auto: this node's CPUs per local rank (less 2 on a GPU)",
)
@click.option(
    "--image-size",
    "--train-crop-size",  # torchvision's name
    "image_size",
    default=DEFAULTS.image_size,
    type=click.IntRange(min=16, max=MAX_IMAGE_SIZE),
    help="training (and validation) size",
)
@click.option(
    "--progressive",
    metavar="START:END",
    help="progressive resizing: training size grows linearly from START to END over the epochs (steps of 32)",
)
@click.option(
    "--val-size",
    "--val-crop-size",  # torchvision's name
    "val_size",
    type=click.IntRange(min=16),
    help="validation crop [default: END or --image-size]",
)
@click.option(
    "--val-resize-size",
    type=click.IntRange(min=16),
    help="validation resizes the short side to this, then takes the centre --val-size [default: --val-size / 0.875]",
)
@click.option(
    "--amp", default=DEFAULTS.amp, type=click.Choice(["auto", "bf16", "fp16", "off"]), help="auto: bf16 on GPU"
)
@click.option("--channels-last/--no-channels-last", default=None, help="[default: on for GPU]")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile the model [default: on for GPU]")
@click.option(
    "--compile-mode",
    type=click.Choice(["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]),
    help="torch.compile mode [default: reduce-overhead (CUDA graphs) on GPU, else default]",
)
@click.option(
    "--decode",
    default=DEFAULTS.decode,
    type=click.Choice(DECODES),
    help="cpu: PIL in the DataLoader workers; gpu: nvJPEG, crop and resize on the GPU; dali: the crops decoded "
    "by DALI on the GPU's JPEG engines (./run venv --extra dali); auto: gpu where CUDA is",
)
@click.option(
    "--cpu-share",
    default=DEFAULTS.cpu_share,
    callback=lambda ctx, param, value: parse_share(value),
    help="with --decode gpu/dali, the share of training samples the DataLoader workers crop themselves; "
    "auto: as much as their spare time allows (on a GPU), up to 0.5",
)
@click.option(
    "--dp",
    default=DEFAULTS.dp,
    type=click.Choice(["ddp", "decent"]),
    help="ddp: all-reduce of gradients; decent: decentralized, each rank mixes with its --topology peers",
)
@click.option(
    "--topology",
    default=DEFAULTS.topology,
    type=click.Choice(TOPOLOGIES),
    help="--dp decent: who mixes with whom at each step",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    help="keep shards read from a remote --data here (later epochs read them locally); share it per node",
)
@click.option(
    "--cache-size",
    metavar="SIZE",
    callback=lambda ctx, param, value: parse_bytes(value),
    help="bound of --cache-dir, e.g. 500G (least recently used shards go first) [default: none]",
)
@click.option("--seed", default=DEFAULTS.seed)
@click.option("--resume", help="'auto' (the last checkpoint in --output, if any) or a checkpoint path")
@click.option("--max-steps", type=click.IntRange(min=1), help="stop after this global step (checkpointed)")
@click.option("--synthetic", is_flag=True, help="random data already on the device: the throughput ceiling")
@click.option("--epoch-mode", default=DEFAULTS.epoch_mode, type=click.Choice(EPOCH_MODES))
@click.option(
    "--epoch-size",
    type=click.IntRange(min=1, max=10**12),
    metavar="N",
    help="resampled mode: an epoch is N samples (the schedule, checkpoints and resume count in these) "
    "[default: the manifest's train samples]",
)
@click.option(
    "--shuffle-buffer",
    default=DEFAULTS.shuffle_buffer,
    type=click.IntRange(min=1),
    help="samples each rank mixes, split among its workers (each at least one batch)",
)
@click.option(
    "--data-timeout",
    default=DEFAULTS.data_timeout,
    type=click.FloatRange(min=1),
    metavar="SECONDS",
    help="no batch for this long (a worker stopped, reads that hang): the run stops, exit 4",
)
@click.option(
    "--collective-timeout",
    default=DEFAULTS.collective_timeout,
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="a rank waiting this long for the others (one died, stopped or hangs): every rank stops, exit 6, "
    "naming them; 0: the collective library's own timeout",
)
@click.option(
    "--max-bad",
    default=DEFAULTS.max_bad,
    type=click.FloatRange(0, 1),
    help="fraction of an epoch's samples that may be skipped or padded (damaged data) before the run stops",
)
@click.option(
    "--log-every",
    "--print-freq",
    default=DEFAULTS.log_every,
    type=click.IntRange(min=1),
    help="steps per metrics record",
)
@click.option(
    "--tracker",
    "trackers",
    multiple=True,
    default=DEFAULTS.trackers,
    type=click.Choice(TRACKERS),
    help="where records go besides metrics.jsonl and TensorBoard's files in --output (repeatable): MLflow "
    "(MLFLOW_TRACKING_URI, else --output's mlflow.db), W&B (WANDB_MODE=offline keeps it local); none: "
    "metrics.jsonl alone; a resumed run continues their runs",
)
@click.option("--log-keys", is_flag=True, help="write every training key per epoch and rank under OUTPUT/keys/")
@click.option("--upload", help="also upload checkpoints, metrics and log here (gs://, s3://, ais:// or a directory)")
@click.option("--checkpoint-every", type=click.IntRange(min=1), help="steps between checkpoints (besides epoch ends)")
@click.option(
    "--keep-last", default=DEFAULTS.keep_last, type=click.IntRange(min=1), help="step checkpoints kept in --output"
)
@click.option(
    "--upload-retry-seconds",
    default=DEFAULTS.upload_retry_seconds,
    help="retry a failing upload this long before warning",
)
@click.option("--flush-timeout", default=DEFAULTS.flush_timeout, help="at exit, wait this long for pending uploads")
def main(compile_: bool, **options: object) -> None:
    """Train with fixed-length epochs, DDP, validation and checkpoints every epoch.

    Exit status: 0 done (or --max-steps reached); 1 bad input, or a DataLoader worker was killed
    (continue with --resume auto), or the GPU ran out of memory (lower --batch-size, then --resume
    auto); 3 some upload never made it (local copies kept); 4 an epoch's data was damaged beyond
    --max-bad (checkpoint saved), or none of it could be read; 5 the loss stayed NaN or infinite
    (diverged: nothing saved past the last finite checkpoint); 6 some rank never reached the others
    within --collective-timeout (named: continue with --resume auto once every rank can run); 75
    stopped by SIGTERM/SIGUSR1 after saving (or, with several ranks whose data never came, without:
    from the last checkpoint): continue with --resume auto; 130 stopped by Ctrl-C before training
    began (nothing to save).
    """
    for sig in STOPS:
        signal.signal(sig, _stopped)  # for the rest of this process (the run sets its own meanwhile)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # (held while train.py imported this: now)
    # (a second Ctrl-C stops the run at once, as KeyboardInterrupt)
    with one_line("stopped at once by a second Ctrl-C, unsaved: --resume auto goes on from the last checkpoint"):
        outcome = train(config(click.get_current_context()))  # (a --recipe's settings are checked too)
    # The run is over. A signal in the process's last steps would replace its status by the
    # signal's: the interpreter's teardown gives Python's handlers back to the default action
    # (an ignored signal stays ignored), and the process is ending anyway.
    for sig in STOPS:
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(outcome["exit_code"])


def _stopped(signum: int, frame: object) -> None:
    """SIGTERM or Ctrl-C where the run's own handler is not set (before it starts, while it or this
    process winds down after it ended, say on a data error): the process ends with one line and a
    stopped run's status, 75 for SIGTERM, 128 + 2 for Ctrl-C (not by the signal, nor as click's
    "Aborted!" and 1; the run's handler saves first, here nothing is left to save). Raised in the
    process's last steps (its exit handlers), the status already given stands."""
    by = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    # (os.write, not print: the signal may have come in the middle of a print to stderr)
    os.write(2, f"train.py: stopped by {by} where no training was under way: nothing to save\n".encode())
    raise SystemExit(128 + signum if signum == signal.SIGINT else EXIT_PREEMPTED)


def config(ctx: click.Context) -> TrainConfig:
    """The config of the parsed options in ``ctx``: a --recipe's settings where no option was given
    (or only a launcher's own default), and where each setting came from."""
    options = dict(ctx.params)
    launcher = {name.strip().replace("-", "_") for name in options.pop("launcher_defaults").split(",") if name.strip()}
    given = {name for name in options if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
    sources = {name.rstrip("_"): "launcher" if name in launcher else "option" for name in given}
    data, mix = data_sources(options.pop("data"))
    cfg = TrainConfig(compile=options.pop("compile_"), data=data, mix=mix, **options, sources=sources)
    return with_recipe(cfg)


def data_sources(given: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """--data's values: the first location (validation's by default), and all of them as given
    where they make a mixture (several, or a weight), else none."""
    if not given:
        return None, ()
    first = parse_source(given[0])
    return first.location, given if len(given) > 1 or first.weight != 1 else ()


def parse(args: list[str]) -> TrainConfig:
    """The config these options give, for launchers that call ``train`` themselves (tools/ray_train.py)."""
    with main.make_context("train.py", list(args)) as ctx:
        return config(ctx)


if __name__ == "__main__":  # python -m imagenet_ais.cli.train (it printed nothing)
    main()
