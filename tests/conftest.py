"""Shared fixtures: real synthetic trees, real shards, and the project's CLIs as subprocesses."""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

import click
import pytest
import webdataset as wds
from PIL import Image

from imagenet_ais.cli import shards as shards_cli
from imagenet_ais.cli import train as train_cli
from imagenet_ais.shards import synth
from imagenet_ais.shards.convert import file_sha256
from imagenet_ais.shards.manifest import Manifest, ShardInfo, SplitInfo, load_manifest
from imagenet_ais.storage import open_store
from imagenet_ais.storage.ais_playground import Playground

ROOT = Path(__file__).resolve().parent.parent
# A few seconds of CPU training: a model of 3 MB (ResNet-18's checkpoint is 90 MB, and steps 3× slower)
TINY_ARCH = "shufflenet_v2_x0_5"
UNSIZED = ["--arch", TINY_ARCH, "--batch-size", "4", "--warmup-epochs", "0"]  # (for --progressive's runs)
TINY = [*UNSIZED, "--image-size", "32"]


def run_cli(*args: str | Path, check: bool = True, env: dict[str, str] | None = None, timeout: float = 300):
    """Run a project script (or torchrun) with this interpreter; output captured.

    One still running after ``timeout`` s (under the tests' 600) fails with what it printed and
    every thread's stack of each Python process under it: a hang says where it hangs."""
    cmd = [str(a) for a in args]
    if cmd[0].endswith(".py"):
        cmd = [sys.executable, str(ROOT / cmd[0]), *cmd[1:]]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = {child.pid, *descendants(child.pid)}  # (before any dies: its children would move to init)
            _signal(tree, signal.SIGABRT)  # faulthandler prints the stacks, then the process ends
            time.sleep(3)
            _signal(tree, signal.SIGKILL)
            out, err = child.communicate(timeout=30)
            raise AssertionError(f"{cmd} still running after {timeout:.0f} s:\n{out}\n{err}") from None
        finally:
            if child.returncode is None:  # the test timed out meanwhile: nothing of it runs on
                _signal({child.pid, *descendants(child.pid)}, signal.SIGKILL)
    proc = subprocess.CompletedProcess(cmd, child.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # (ended already)
            os.kill(pid, sig)


@contextlib.contextmanager
def output_to(out: BinaryIO, err: BinaryIO) -> Iterator[None]:
    """This process's stdout and stderr into ``out`` and ``err``, its file descriptors too: what
    the processes it forks meanwhile (DataLoader and pool workers) print is caught as well."""
    saved = sys.stdout, sys.stderr, os.dup(1), os.dup(2)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", closefd=False, encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved[:2]
        for fd, copy in ((1, saved[2]), (2, saved[3])):
            os.dup2(copy, fd)
            os.close(copy)


def here(command: click.Command, *args: str | Path, check: bool = True, env: dict[str, str] | None = None):
    """A CLI run in this process, as ``run_cli`` reports one: for tests of what it does, where the
    process boundary is not the point (each new process imports torch again: 4-5 s here).

    ``env`` is set only while it runs; an exception other than the CLI's own exit is raised."""
    argv, code = [str(a) for a in args], 0
    before = {k: os.environ.get(k) for k in env or {}}
    handlers = {sig: signal.getsignal(sig) for sig in train_cli.STOPS}  # train.py's main sets its own for good
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.environ.update(env or {})
        try:
            with output_to(out, err):
                command.main(argv, prog_name=command.name)
        except SystemExit as e:  # (click's standalone mode exits, 0 included)
            code = e.code if isinstance(e.code, int) else 1
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        printed = []
        for f in (out, err):
            f.seek(0)
            printed.append(f.read().decode("utf-8", "replace"))
    proc = subprocess.CompletedProcess([command.name, *argv], code, *printed)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def shards_here(*args: str | Path, check: bool = True, env: dict[str, str] | None = None):
    """imagenet_shards.py ARGS, run in this process (see ``here``)."""
    return here(shards_cli.cli, *args, check=check, env=env)


def train_here(*args: str | Path, check: bool = True, env: dict[str, str] | None = None):
    """train.py ARGS, run in this process (see ``here``)."""
    return here(train_cli.main, *args, check=check, env=env)


class Server:
    """``./run serve`` (real nginx) on a free loopback port, its state under ``root``."""

    def __init__(self, data: Path, root: Path, **settings: str):
        self.data, self.port = data, free_port()
        self.env = {"SERVE_ROOT": str(root), **settings}
        self.url = f"{'https' if settings.get('SERVE_CERT') else 'http'}://127.0.0.1:{self.port}"
        self.log = root / str(self.port) / "access.log"

    def start(self) -> None:
        run_cli(ROOT / "run", "serve", self.data, "--port", str(self.port), "--addr", "127.0.0.1", env=self.env)

    def stop(self) -> str:
        return run_cli(ROOT / "run", "serve", "--stop", "--port", str(self.port), env=self.env).stdout

    def gets(self) -> Counter[str]:
        """Successful GETs (whole or ranged) per path, from nginx's access log."""
        hits: Counter[str] = Counter()
        for line in self.log.read_text().splitlines() if self.log.exists() else []:
            request, status = line.split('"')[1].split(), line.split('"')[2].split()[0]
            if request[0] == "GET" and status in ("200", "206"):
                hits[request[1].lstrip("/")] += 1
        return hits


@pytest.fixture
def serve(tmp_path: Path):
    """Start ``./run serve`` for a shard directory; everything started is stopped afterwards.

    Without nginx the HTTP tests are skipped, except under CI=true, where that is a failure."""
    if not shutil.which("nginx"):
        message = "nginx missing: ./run test installs it (as root on Debian)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    servers: list[Server] = []
    public: list[Path] = []

    def start(data: Path, **settings: str) -> Server:
        for path in (data, settings.get("SERVE_HTPASSWD")):
            if path and os.geteuid() == 0 and not Path(path).is_symlink():
                public.append(readable_to_nobody(Path(path)))
        server = Server(data, tmp_path / f"serve{len(servers)}", **settings)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    for folder in public:
        shutil.rmtree(folder)


def readable_to_nobody(path: Path) -> Path:
    """As root, ./run serve's nginx workers run as nobody, whom pytest's temporary folders (0700)
    keep out: ``path`` moves into a folder of its own that others may pass, and a link to it takes
    its place (the test's paths keep working). Returns that folder."""
    folder = Path(tempfile.mkdtemp(prefix="served-"))
    folder.chmod(0o711)
    shutil.move(path, folder / path.name)
    path.symlink_to(folder / path.name)
    return folder


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, ... ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def child_pids(pid: int) -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _stat(int(p.name))[1:2] == [str(pid)]}


def descendants(pid: int) -> set[int]:
    """Every process under ``pid``, however deep (torchrun starts its ranks in sessions of their
    own, so a process group would miss them); one pass over /proc."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (fields := _stat(int(proc.name))):
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def outliving(pids: set[int], seconds: float) -> set[int]:
    """Those of ``pids`` still running (not zombies) after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while (alive := {p for p in pids if _stat(p)[:1] not in ([], ["Z"])}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def ended_as_dropped(held: list, workers: set[int]) -> None:
    """Drops ``held``'s one item, its last reference, with the garbage collector off: it must be
    freed then, not at some later collection in whatever thread, lock or signal handler that runs
    in, and its worker processes ``workers`` must end within 5 s."""
    gone = weakref.ref(held[0])
    gc.disable()
    try:
        held.clear()
        assert gone() is None, "freed as it was dropped"
    finally:
        gc.enable()
    assert not outliving(workers, 5)


def wait_until(
    proc: subprocess.Popen, ready, what: str, timeout: float = 300, poll: float = 0.02, log: Path | None = None
) -> None:
    """Poll ``ready()`` while ``proc`` runs; fail with ``what`` if it ends first or time runs out,
    showing what it printed (its stdout pipe, or ``log``, the file it writes to)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            printed = proc.stdout.read() if proc.stdout else log.read_text()[-20000:] if log else "(not captured)"
            raise AssertionError(f"{what}: the process ended first ({proc.returncode}):\n{printed}")
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f}s"
        time.sleep(poll)


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 classes × 12 train (with CMYK, gray, PNG quirks) + 3 bad files, 4 val per class."""
    out = tmp_path_factory.mktemp("tree")
    synth.make_tree(out, classes=6, train_per_class=12, val_per_class=4, seed=1, with_bad=True)
    return out


def tiny_jpeg(rng: random.Random, cls: int) -> bytes:
    img = Image.new("RGB", (rng.randint(40, 90), rng.randint(40, 90)), (cls * 40 % 256, 80, 200 - cls * 30 % 200))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def members(shard: Path) -> dict[str, bytes]:
    """A tar shard's members by name."""
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def relist(dest: Path) -> Manifest:
    """``dest``'s manifest.json, rewritten to list each shard there at its bytes and SHA-256 as it
    now is: damage that only reading its members can find (a converter's bug, another's shard)."""
    manifest = load_manifest(open_store(str(dest)))
    for split in manifest.splits.values():
        for shard in split.shards:
            if (path := dest / shard.name).exists():
                shard.bytes, shard.sha256 = path.stat().st_size, file_sha256(path)
    (dest / "manifest.json").write_text(manifest.to_json())
    return manifest


def sparse_member(name: str, declared: int) -> bytes:
    """A GNU sparse tar member's header that declares ``declared`` bytes and stores none (a
    reader that trusts it fills that many bytes of holes with zeros)."""
    info = tarfile.TarInfo(name)
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[483:495] = f"{declared:011o}\0".encode()  # the file's real size
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header)


def write_shards(
    dest: Path,
    sizes: dict[str, list[int]],
    classes: int = 4,
    corrupt: set[str] = frozenset(),
    pictures: dict[str, bytes] | None = None,
    names: list[str] | None = None,
    prefix: str = "",
) -> Manifest:
    """Shards of the given sizes per split, with keys `<prefix><split>-<shard>-<i>`, plus their
    manifest: ``classes`` classes, named ``names`` (else c0, c1, ...).

    Keys named in ``corrupt`` get bytes that are not an image, those in ``pictures`` its bytes."""
    rng = random.Random(0)
    dest.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(names or [f"c{k}" for k in range(classes)], {})
    classes = len(manifest.classes)
    for split, counts in sizes.items():
        info = SplitInfo()
        for s, count in enumerate(counts):
            name = f"imagenet-{split}-{s:06d}.tar"
            with wds.TarWriter(str(dest / name)) as tar:
                for i in range(count):
                    key, cls = f"{prefix}{split}-{s}-{i}", rng.randrange(classes)
                    data = b"garbage" if key in corrupt else tiny_jpeg(rng, cls)
                    data = (pictures or {}).get(key, data)
                    tar.write({"__key__": key, "jpg": data, "cls": str(cls).encode()})
            path = dest / name
            info.shards.append(ShardInfo(name, count, path.stat().st_size, file_sha256(path), "test"))
        manifest.splits[split] = info
    (dest / "manifest.json").write_text(manifest.to_json())
    return manifest


def picture(rng: random.Random, cls: int, ext: str = "jpg") -> bytes:
    """A small picture of class ``cls``'s colour, in the format its extension names (jpg, png, webp)."""
    img = Image.new("RGB", (rng.randint(40, 90), rng.randint(40, 90)), (cls * 40 % 256, 80, 200 - cls * 30 % 200))
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext])
    return buf.getvalue()


def write_hub_shards(
    dest: Path,
    sizes: dict[str, list[int]],
    classes: int = 4,
    exts: dict[str, str] | None = None,
    labels: tuple[str, ...] = ("cls", "json"),
    names: list[str] | None = None,
    info: bool = True,
) -> dict[str, int]:
    """Shards as the Hugging Face hub's timm/imagenet-1k-wds lays them out, made by another tool:
    ``imagenet1k-{train|validation}-NNNN.tar`` (the split ``val`` written ``validation``), each
    sample ``KEY.jpg`` (``.png``/``.webp`` for the keys ``exts`` names), ``KEY.cls`` (the class
    index) and ``KEY.json`` (``label``: the index, or the class's name from ``names``), keys
    ``<split>-<shard>-<i>``; and ``_info.json``. No manifest. Returns each key's class."""
    rng, classes_of = random.Random(1), {}
    dest.mkdir(parents=True, exist_ok=True)
    listed: dict[str, dict] = {}
    for split, counts in sizes.items():
        hub = "validation" if split == "val" else split
        listed[hub] = {"name": hub, "filenames": [], "shard_lengths": counts, "num_samples": sum(counts)}
        for s, count in enumerate(counts):
            name = f"imagenet1k-{hub}-{s:04d}.tar"
            listed[hub]["filenames"].append(name)
            with wds.TarWriter(str(dest / name)) as tar:
                for i in range(count):
                    key, cls = f"{split}-{s}-{i}", rng.randrange(classes)
                    ext = (exts or {}).get(key, "jpg")
                    label = names[cls] if names else cls
                    sample = {"__key__": key, ext: picture(rng, cls, ext)}
                    if "cls" in labels:
                        sample["cls"] = str(cls).encode()
                    if "json" in labels:
                        sample["json"] = json.dumps({"label": label, "filename": f"{key}.JPEG"}).encode()
                    tar.write(sample)
                    classes_of[key] = cls
    if info:
        (dest / "_info.json").write_text(json.dumps({"name": "imagenet-1k", "splits": listed}))
    return classes_of


def write_sorted_shards(dest: Path, classes: int, per_class: int, per_shard: int) -> dict[str, int]:
    """The webdataset project's ImageNet example's layout: ``imagenet-train-NNNNNN.tar`` with
    ``%08d`` keys (``.jpg``, ``.cls``), written in class order: each shard holds one class or two.
    One picture per class (their bytes are not the point). Returns each key's class."""
    rng, classes_of = random.Random(2), {}
    dest.mkdir(parents=True, exist_ok=True)
    pictures = [picture(rng, c) for c in range(classes)]
    samples = [(f"{i:08d}", c) for i, c in enumerate(c for c in range(classes) for _ in range(per_class))]
    for s in range(0, len(samples), per_shard):
        with wds.TarWriter(str(dest / f"imagenet-train-{s // per_shard:06d}.tar")) as tar:
            for key, cls in samples[s : s + per_shard]:
                tar.write({"__key__": key, "jpg": pictures[cls], "cls": str(cls).encode()})
                classes_of[key] = cls
    return classes_of


@pytest.fixture(scope="session")
def ais(tmp_path_factory: pytest.TempPathFactory):
    """A real AIStore (1 proxy + 1 target, aisnode v1.5.0) on free loopback ports, for the session.

    Without aisnode the AIStore tests are skipped, except under CI=true, where that is a failure."""
    aisnode = ROOT / ".cache" / "bin" / "aisnode"
    if not aisnode.exists():
        message = f"{aisnode} missing: build it with ./run ais-install (needs Go)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    playground = Playground(tmp_path_factory.mktemp("ais"), aisnode)
    said: list[str] = []
    playground.up(targets=1, echo=said.append)
    (playground.root / "up.log").write_text("".join(f"{line}\n" for line in said))  # (test_ais reads it)
    yield playground
    playground.down()


def records(output: Path, kind: str) -> list[dict]:
    """The records of ``kind`` ("train", "val", "epoch", "run") in the metrics.jsonl of the run in ``output``."""
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def tiny_run_env(data: Path, output: Path) -> dict[str, str]:
    """./run settings for a few-second CPU training run of tiny shards."""
    return {
        "DATA": str(data),
        "OUTPUT": str(output),
        "ARCH": TINY_ARCH,
        "IMAGE_SIZE": "32",
        "BATCH_SIZE": "4",
        "EPOCHS": "1",
        "WORKERS": "1",
        "OMP_NUM_THREADS": "1",
    }


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves a folder's files, writing no line per request (a test's own server: http_server)."""

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def http_server(root: Path | None, handler: type[QuietHandler], address: str = "127.0.0.1") -> Iterator[str]:
    """A threaded HTTP server of the folder ``root`` (None: an empty one) that answers with
    ``handler``, while the block lasts: its URL."""
    with (
        tempfile.TemporaryDirectory() as empty,
        ThreadingHTTPServer((address, 0), functools.partial(handler, directory=str(root or empty))) as server,
    ):
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://{address}:{server.server_port}"
        finally:
            server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GCSEmulator:
    """fake-gcs-server on a free loopback port, its objects on disk so they survive a restart."""

    def __init__(self, binary: Path, root: Path, external_port: int | None = None):
        self.port = free_port()
        self.binary, self.root = binary, root
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # the address it hands out for resumable upload sessions (a proxy's, to route through one)
        self.external = f"http://127.0.0.1:{external_port or self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-external-url",
                self.endpoint,
                "-public-host",
                f"127.0.0.1:{self.port}",
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None

    def make_bucket(self) -> str:
        from google.cloud import storage

        name = f"b{secrets.token_hex(6)}"  # (not random's: a run in this process seeds it)
        storage.Client().create_bucket(name)
        return name


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory):
    """A real GCS emulator for the session; STORAGE_EMULATOR_HOST points at it (skipped without it, failed under CI)."""
    binary = ROOT / ".cache" / "bin" / "fake-gcs-server"
    if not binary.exists():
        message = f"{binary} missing: ./run test installs it (needs Go)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    emulator = GCSEmulator(binary, tmp_path_factory.mktemp("gcs"))
    emulator.start()
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.endpoint
    yield emulator
    os.environ.pop("STORAGE_EMULATOR_HOST", None)
    emulator.stop()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``dali`` run last, all in one of ./run test's processes: a process that had
    run DALI's pipelines crashed a DataLoader worker it forked later (a segmentation fault)."""
    for item in items:
        if item.get_closest_marker("dali"):
            item.add_marker(pytest.mark.xdist_group("dali"))
    items.sort(key=lambda item: item.get_closest_marker("dali") is not None)  # (stable: the rest keep their order)
