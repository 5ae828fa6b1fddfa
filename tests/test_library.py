"""The package used from someone else's program: importing it changes nothing in the process, and
a run changes the process only while it runs. A fresh interpreter each (the state is the point)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TINY_ARCH, outliving, run_cli, write_shards

STATE = """
import atexit, os, random, signal, torch, torch._dynamo
random.seed(1234)
torch.manual_seed(1234)
def state():
    return {
        "atexit handlers": atexit._ncallbacks(),
        "SIGTERM": signal.getsignal(signal.SIGTERM), "SIGUSR1": signal.getsignal(signal.SIGUSR1),
        "SIGCHLD": signal.getsignal(signal.SIGCHLD), "threads": torch.get_num_threads(),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "optimize_ddp": torch._dynamo.config.optimize_ddp,
        "random": random.getstate(), "torch's generator": torch.get_rng_state().tolist(),
    }
"""


def run_python(script: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_importing_the_package_and_a_run_leave_the_process_as_they_found_it(tmp_path: Path) -> None:
    # Process-wide, on import or use: an atexit handler killing every daemonic child, optimize_ddp,
    # CUDA_DEVICE_MAX_CONNECTIONS, torch's threads, the run's signal handlers, the run's seeds.
    run_python(
        STATE
        + f"""
import ast, importlib, pathlib, pkgutil
# what the libraries we import do on import is theirs (matplotlib and loguru register atexit
# handlers): imported first, so that what is measured is our own modules'
for path in pathlib.Path("imagenet_ais").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            if not name.startswith("imagenet_ais") and not name.startswith("nvidia"):  # (DALI: when used)
                importlib.import_module(name)
import tqdm  # tqdm's monitor thread registers its own atexit handler with the first bar
tqdm.tqdm(total=1, file=open(os.devnull, "w")).close()
before = state()
import imagenet_ais
for module in pkgutil.walk_packages(imagenet_ais.__path__, "imagenet_ais."):
    importlib.import_module(module.name)
assert state() == before, ("import", before, state())
from imagenet_ais.train import loop
from imagenet_ais.train.config import TrainConfig
cfg = TrainConfig(output={str(tmp_path / "run")!r}, synthetic=True, arch={TINY_ARCH!r}, image_size=32, batch_size=2,
                  epochs=1, epoch_size=4, warmup_epochs=0)
assert loop.train(cfg)["exit_code"] == 0
assert state() == before, ("run", before, state())
"""
    )


def test_at_exit_only_our_own_loader_workers_are_killed(tmp_path: Path) -> None:
    # Our workers ignore SIGTERM, so they are killed at exit; another daemonic child of the same
    # program is left to multiprocessing's own exit hook, which terminates it (SIGTERM) as usual.
    write_shards(tmp_path / "data", {"train": [40, 40]})
    proc = run_python(
        f"""
import multiprocessing as mp, signal, sys, time
def theirs(path):
    signal.signal(signal.SIGTERM, lambda *_: (open(path, "w").write("terminated"), sys.exit(0)))
    time.sleep(60)
if __name__ == "__main__":
    child = mp.get_context("fork").Process(target=theirs, args=({str(tmp_path / "theirs")!r},), daemon=True)
    child.start()
    from imagenet_ais.loader.engine import Feeding, TrainLoader
    from imagenet_ais.loader.mixture import one_source
    from imagenet_ais.shards.manifest import load_manifest
    from imagenet_ais.storage import open_store
    from imagenet_ais.loader.worker import LoaderSpec
    split = load_manifest(open_store({str(tmp_path / "data")!r})).split("train")
    spec = LoaderSpec(world=1, rank=0, batch=2, seed=0, image_size=32)
    batches = iter(TrainLoader(one_source(split, {str(tmp_path / "data")!r}), "resampled", spec, Feeding(2), 4))
    next(batches)
    time.sleep(0.5)  # the other child has its handler by now
    print("leaving", flush=True)
"""
    )
    assert "leaving" in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "theirs").read_text() == "terminated"


def test_a_worker_whose_parent_died_before_it_watched_still_exits() -> None:
    # it took its new parent (PID 1, or a subreaper) for the one that started it, and lived on
    script = """
import os, time
from imagenet_ais.children import exit_with_parent
parent = os.getpid()
if (pid := os.fork()) == 0:
    os.close(1), os.close(2)  # (the test reads its parent's output to the end)
    while os.getppid() == parent:
        time.sleep(0.01)
    exit_with_parent(parent)
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
"""
    child = int(run_python(script).stdout)
    assert not outliving({child}, 5)


def test_under_the_forkserver_start_method_workers_read_and_end_with_their_loader(tmp_path: Path) -> None:
    # Python 3.14's default: each worker's parent is the server, not the loader's process, and
    # they took that for their parent gone and exited at once (WorkerDied)
    write_shards(tmp_path / "shards", {"train": [16]})
    script = f"""
import multiprocessing as mp, os, signal
from imagenet_ais import ShardLoader
mp.set_start_method("forkserver")
loader = ShardLoader({str(tmp_path / "shards")!r}, "train", 4, image_size=32, workers=2, device="cpu")
keys = [key for _, _, batch in loader for key in batch]
print(len(keys), *(child.pid for child in mp.active_children()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    read, *workers = map(int, proc.stdout.split())
    assert read == 16 and len(workers) == 2
    assert not outliving(set(workers), 5), "killed outright: its workers end with it"


def test_the_docs_plain_loop_runs_as_written_under_torchrun_on_a_cpu(tmp_path: Path) -> None:
    # as written it called for NCCL and CUDA: "ProcessGroupNCCL is only supported with GPUs"
    data = tmp_path / "shards"
    write_shards(data, {"train": [8, 8]})
    docs = (ROOT / "docs" / "library.md").read_text()
    code = docs.partition("## A plain DDP loop")[2].partition("```python\n")[2].partition("```")[0]
    small = {  # the data, its checkpoint here, and a run this machine finishes in seconds: one epoch, batches of 8
        '"ais://imagenet/shards"': repr(str(data)), '"ckpt.pt': f'"{tmp_path}/ckpt.pt',
        "range(loader.epoch, 90)": "range(loader.epoch, 1)", '"train", 256,': '"train", 8,', "resnet50": "resnet18",
    }  # fmt: skip
    for written, here in small.items():
        assert written in code, f"the docs' loop no longer holds {written}"
        code = code.replace(written, here)
    (tmp_path / "my_train.py").write_text(code + "print('trained', step + 1, 'steps', flush=True)\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    out = run_cli(*torchrun, tmp_path / "my_train.py", env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert "trained 2 steps" in out.stdout, "one epoch of 16 samples in batches of 8"
    assert (tmp_path / "ckpt.pt").exists(), "its checkpoint, saved at step 0"
