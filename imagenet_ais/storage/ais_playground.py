"""A local AIStore playground: 1 proxy + N targets of a real aisnode on loopback.

Configs, data, logs and pid files live under its root. Targets run in AIStore's testing mountpath
mode (directories instead of disks). ``up`` is idempotent; ``down`` stops only the processes whose
pid files it wrote. Used by tools/ais_local.py (./run ais-up / ais-down) and the tests' fixture;
``running_endpoint`` is how ``ais://`` locations find it where ``AIS_ENDPOINT`` is unset.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_AISNODE = CHECKOUT / ".cache" / "bin" / "aisnode"  # where ./run ais-install builds it


def default_root() -> Path:
    """The playground's root as ./run has it: ``AIS_ROOT`` (a relative one is the checkout's), else .cache/ais."""
    return CHECKOUT / (os.environ.get("AIS_ROOT") or Path(".cache", "ais"))


def running_endpoint(root: Path | None = None) -> str | None:
    """The endpoint of the playground at ``root`` (default: ``default_root()``) if it runs and is healthy."""
    playground = Playground(root or default_root())
    return playground.endpoint if playground.healthy() else None


@dataclass(frozen=True)
class Node:
    name: str  # "proxy" or "target<i>"
    port: int  # public; intra-control and intra-data follow at +100 and +200

    @property
    def role(self) -> str:
        return "proxy" if self.name == "proxy" else "target"


class Playground:
    def __init__(self, root: Path, aisnode: Path = DEFAULT_AISNODE):
        self.root = root.resolve()
        self.aisnode = aisnode

    # layout -------------------------------------------------------------------------------
    def _state(self) -> dict:
        path = self.root / "playground.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def nodes(self) -> list[Node]:
        state = self._state()
        if not state:
            return []
        base = state["port"]
        return [Node("proxy", base)] + [Node(f"target{i}", base + 1 + i) for i in range(state["targets"])]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._state()['port']}"

    def _pidfile(self, node: Node) -> Path:
        return self.root / node.name / "aisnode.pid"

    # configuration ------------------------------------------------------------------------
    def _write_configs(self, port: int, targets: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "playground.json").write_text(json.dumps({"port": port, "targets": targets}))
        (self.root / "cluster.json").write_text(json.dumps(_cluster_config(f"http://127.0.0.1:{port}"), indent=1))
        for i, node in enumerate(self.nodes()):
            home = self.root / node.name
            (home / "log").mkdir(parents=True, exist_ok=True)
            (home / "local.json").write_text(json.dumps(self._local_config(node, i), indent=1))

    def _local_config(self, node: Node, instance: int) -> dict:
        home = self.root / node.name
        return {
            "confdir": str(home),
            "log_dir": str(home / "log"),
            "host_net": {
                "hostname": "127.0.0.1",
                "hostname_intra_control": "127.0.0.1",
                "hostname_intra_data": "127.0.0.1",
                "port": str(node.port),
                "port_intra_control": str(node.port + 100),
                "port_intra_data": str(node.port + 200),
            },
            "fspaths": {},
            "test_fspaths": {
                "root": str(self.root / "mp"),
                "count": 1 if node.role == "target" else 0,
                "instance": instance,
            },
        }

    # processes ----------------------------------------------------------------------------
    def pid(self, node: Node) -> int | None:
        """The pid from the node's pid file, if that process is still this node's aisnode."""
        try:
            pid = int(self._pidfile(node).read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return None
        return pid if str(self.root / node.name / "local.json") in cmdline else None

    def start_node(self, node: Node) -> None:
        if self.pid(node):
            return
        home = self.root / node.name
        args = [
            str(self.aisnode),
            f"-config={self.root / 'cluster.json'}",
            f"-local_config={home / 'local.json'}",
            f"-role={node.role}",
        ]
        if node.role == "proxy":
            args.append(f"-ntargets={len(self.nodes()) - 1}")
        with (home / "log" / "console.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self._pidfile(node).write_text(str(proc.pid))

    def stop_node(self, node: Node, sig: signal.Signals = signal.SIGTERM, wait: float = 20) -> None:
        pid = self.pid(node)
        if pid:
            os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while self.pid(node) and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                while _alive(pid):
                    time.sleep(0.05)
        self._pidfile(node).unlink(missing_ok=True)

    def healthy(self) -> bool:
        if not self._state():
            return False
        try:
            with urllib.request.urlopen(f"{self.endpoint}/v1/health?prr=true", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.endpoint}/v1/cluster?what=smap", timeout=2) as r:
                smap = json.loads(r.read())
            return len(smap.get("tmap", {})) >= len(self.nodes()) - 1
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            for node in self.nodes():
                # the pid file, not pid(): a just-forked node may not have exec'd aisnode yet
                if not _alive(int(self._pidfile(node).read_text())):
                    raise RuntimeError(f"aisnode {node.name} exited: see {self.root / node.name / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"AIStore at {self.endpoint} not healthy after {timeout:.0f}s: see {self.root}/*/log"
                )
            time.sleep(0.25)

    def up(self, targets: int = 1, port: int | None = None, echo: Callable[[str], None] = lambda _: None) -> str:
        """The endpoint of the running playground, started first where it is not; ``echo`` is told
        what it starts, as it goes (a cold start takes 10-20 s)."""
        if self.nodes() and all(self.pid(n) for n in self.nodes()) and self.healthy():
            echo(f"AIStore playground in {self.root}: already running")
            return self.endpoint
        if not self.aisnode.exists():
            raise FileNotFoundError(f"{self.aisnode} not found: build it with `./run ais-install` (needs Go)")
        self.down()
        state = self._state()
        if state and state["targets"] == targets and port in (None, state["port"]):
            port = state["port"]  # nodes persist the cluster map: same layout, same ports
        else:
            if state:  # another layout: the old cluster's metadata and objects would not fit it
                print(f"AIStore playground: new layout, wiping {self.root}", file=sys.stderr)
                shutil.rmtree(self.root)
            port = port or free_port_block(targets + 1)
        self._write_configs(port, targets)
        start = time.monotonic()
        echo(
            f"AIStore playground in {self.root}: starting {self.aisnode.name} as 1 proxy and {targets} target"
            f"{'s' if targets > 1 else ''} on 127.0.0.1:{port}-{port + targets} (logs: {self.root}/*/log)"
        )
        for node in self.nodes():
            self.start_node(node)
        echo("waiting for the targets to join and the cluster to settle (about 10 s)")
        self.wait_healthy()
        echo(f"up in {time.monotonic() - start:.0f}s")
        return self.endpoint

    def down(self) -> int:
        """Stop its nodes; how many were running."""
        running = [node for node in reversed(self.nodes()) if self.pid(node)]
        for node in reversed(self.nodes()):
            self.stop_node(node)
        return len(running)


# aisnode's feature flag S3-Reverse-Proxy (1 << 13 in v1.5.0's cmn/feat): the gateway passes S3 calls
# on to the target itself instead of redirecting (boto3 follows no redirect of a PUT)
S3_REVERSE_PROXY = 1 << 13


def _cluster_config(primary: str) -> dict:
    """The cluster-wide config: the primary proxy, timeouts and limits for a laptop or CI machine."""
    return {
        "features": str(S3_REVERSE_PROXY),
        "backend": {},
        "proxy": {"primary_url": primary, "original_url": primary, "discovery_url": "", "non_electable": False},
        "timeout": {
            "cplane_operation": "2s",
            "max_keepalive": "5s",
            "cold_get_conflict": "5s",
            "max_host_busy": "20s",
            "startup_time": "30s",  # aisnode's least: the primary waits startup/20 × 4 for targets to settle
            "join_startup_time": "3m",
            "send_file_time": "5m",
            "ec_streams_time": "10m",
            "object_md": "2h",
        },
        # A laptop or CI disk is often fuller than a storage node's: don't refuse writes early.
        "space": {
            "cleanupwm": 90,
            "lowwm": 94,
            "highwm": 97,
            "out_of_space": 99,
            "batch_size": 32768,
            "dont_cleanup_time": "120m",
        },
        "memsys": {
            "min_free": "256mb",
            "default_buf": "32kb",
            "to_gc": "1gb",
            "hk_time": "3m",
            "min_pct_total": 0,
            "min_pct_free": 0,
        },
        "versioning": {"enabled": True, "validate_warm_get": False},
        "resilver": {"enabled": True},
        "net": {
            "l4": {"proto": "tcp", "sndrcv_buf_size": 131072},
            "http": {
                "use_https": False,
                "server_crt": "",
                "server_key": "",
                "domain_tls": "",
                "client_ca_tls": "",
                "client_auth_tls": 0,
                "idle_conn_time": "6s",
                "idle_conns_per_host": 32,
                "idle_conns": 256,
                "write_buffer_size": 0,
                "read_buffer_size": 0,
                "chunked_transfer": True,
                "skip_verify": False,
            },
            "use_ipv6": False,
        },
        "auth": {},
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of this process counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def free_port_block(count: int, start: int = 20000, stop: int = 60000) -> int:
    """A base port P such that P..P+count-1, +100 and +200 of each, are all free on loopback."""
    for base in range(start + (os.getpid() % 997) * 37, stop, 7):
        ports = [base + i + off for i in range(count) for off in (0, 100, 200)]
        if all(_port_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of loopback ports for AIStore")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
