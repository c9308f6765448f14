"""A Ray cluster on the emulated nodes: a head on node 0, a worker node on every other, fake GPUs.

:class:`teraflops.nodes.cluster.Cluster` makes K nodes (network namespaces on one bridge). With
``ray=True`` (or a :class:`RayConfig`) it also starts Ray (https://docs.ray.io, ``ray start``), all
as root and all *inside the nodes* (``nsenter --net``):

* node 0: ``ray start --head``: the GCS (Ray's global control store, the cluster's metadata and its
  failure detector) on ``<node0>:6379``, and node 0's raylet (its scheduler and object store);
* every other node: ``ray start --address <node0>:6379``: a raylet joining the head.

Each node's processes bind its own address (``--node-ip-address``; Ray's servers listen on it, on
the namespace's loopback, or, for the few that Ray binds to every address, on every address *of the
namespace*: none is on the machine's own interface, which the nodes cannot even see), the dashboard
is off (``--include-dashboard false``), usage statistics are off, and each node has its own
temporary folder (``--temp-dir``) under :func:`state_dir` (``/run/teraflops/ray/<cluster>/node<i>``)
instead of ``/tmp/ray``, so the teardown can remove it. Ray measured here picks the machine's own
interface even when told ``--node-ip-address 127.0.0.1`` (it probes the default route): that is why
it runs in the namespaces, which have no route out.

Stopping: never ``ray stop``, which kills every Ray process on the machine, other learners'
included. :meth:`Ray.stop` signals the ``ray start --block`` process of each node by PID (it takes
its node's Ray processes down with it), and :func:`teraflops.nodes.cluster.down` then stops
whatever is left in the cluster's namespaces and removes :func:`state_dir`: the same path runs after
the notebook that made the cluster was SIGKILLed (``teraflops cluster down``).

Each node declares :attr:`RayConfig.cpus_per_node` logical CPUs and :attr:`RayConfig.gpus_per_node`
fake GPUs (``--num-gpus`` on a machine without GPUs: Ray counts them as resources and places
placement-group bundles on them; nothing computes on them).

Failure detection: the GCS health-checks every raylet each ``health_check_period_ms`` and declares a
node dead after ``health_check_failure_threshold`` failed checks in a row (Ray's defaults: 3000 ms
and 5, about 15 s; https://docs.ray.io/en/latest/ray-core/fault_tolerance/nodes.html). The course
shortens both (:attr:`RayConfig.health_check_period_ms`, ``..._failure_threshold``) so that a node's
death is noticed in about 3 s here; the lecture says so.

Measured here (2 busy cores, Ray 2.60): a head ~490 MB RSS idle, a worker node ~270 MB; ``ray
start`` ~3 s per node.
"""

from __future__ import annotations

import contextlib
import json
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from teraflops.errors import CourseError
from teraflops.teardown import StateFolders, stop_groups

PORT = 6379  # the GCS's port on node 0 (Ray's default)
STATE_ENV = "TERAFLOPS_RAY_DIR"
START_MARK = "--- teraflops: ray start ---"  # written into a node's log before each start
SLOW_START_S = 15.0  # a node's start slower than this says so (Ray.start); ~3 s on a quiet machine
START_ATTEMPTS = 5  # ray start per node, when it times out waiting for its own raylet (Ray.start; measured: 31.6 s for a head at load 10)
INSTALL = 'pip install "ray[train]==2.60.0"'
# Ray's processes, by program name (psutil's name(); Python ones by the module in their command line)
PROGRAMS = ("gcs_server", "raylet", "ray::", "raylet/agent", "dashboard_agent", "runtime_env_agent", "log_monitor",
            "monitor.py", "ray start", "default_worker")


class RayError(CourseError, RuntimeError):
    """Ray on the emulated nodes could not start or answer; one line with a hint."""


def ray_command() -> list[str] | None:
    """The ``ray`` command: ``<this Python> -m ray.scripts.scripts`` where this Python has Ray (the entry
    point the ``ray`` script calls), else ``ray`` on ``PATH``; None if Ray is not installed. Not the
    environment's ``ray`` script: its first line names the environment's Python by its real path, and
    in a folder with a space Ray's processes then start their helpers through a shell that splits it
    (``ray_client_server`` exited 127); this Python is the space-free link's
    (:mod:`teraflops.course.any_folder`), which Ray's processes inherit as ``sys.executable``."""
    if importlib.util.find_spec("ray") is not None:
        return [sys.executable, "-m", "ray.scripts.scripts"]
    found = shutil.which("ray")
    return [found] if found else None


def unavailable() -> str | None:
    """Why Ray cannot run on emulated nodes here, in one line; ``None`` when it can (the nodes
    themselves are :func:`teraflops.nodes.cluster.unavailable`'s business)."""
    if ray_command() is None:
        return f"Ray is not installed in this environment (install it with: {INSTALL}, or pip install -e '.[ray]')"
    return None


# Every cluster's Ray files (configuration, state, logs, each node's --temp-dir): one folder per cluster under
# ``${STATE_ENV}`` or ``/run/teraflops/ray`` (teraflops.teardown.StateFolders).
STATE = StateFolders(STATE_ENV, "/run/teraflops/ray")
state_root, state_dir, state_names, remove_state = STATE.root, STATE.dir, STATE.names, STATE.remove


def address(cluster) -> str:
    """``<node 0's address>:6379``: what ``ray.init(address=...)`` and ``RAY_ADDRESS`` take."""
    return f"{cluster.address(0)}:{PORT}"


@dataclass(frozen=True)
class RayConfig:
    """How a cluster's Ray is set up.

    Attributes:
        cpus_per_node: logical CPUs each node declares (Ray's ``CPU`` resource; a Train worker takes one).
        gpus_per_node: fake GPUs each node declares (``GPU`` resource; placement groups place on them), 0-8.
        object_store_mb: each node's object store, MB (1e6 bytes; Ray's minimum is 75 MB).
        health_check_period_ms: how often the GCS checks each raylet (Ray's default 3000).
        health_check_failure_threshold: failed checks in a row before a node is declared dead (default 5).
    """

    cpus_per_node: int = 1
    gpus_per_node: int = 2
    object_store_mb: int = 100
    health_check_period_ms: int = 1000
    health_check_failure_threshold: int = 3

    def __post_init__(self):
        checks = (("cpus_per_node", 1, 16), ("gpus_per_node", 0, 8), ("object_store_mb", 80, 4000),
                  ("health_check_period_ms", 100, 60_000), ("health_check_failure_threshold", 1, 100))
        for name, lo, hi in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise RayError(f"RayConfig.{name} must be an int in [{lo}, {hi}], got {value!r}. "
                               "Hint: RayConfig(cpus_per_node=1, gpus_per_node=2).")

    def detection_s(self) -> float:
        """Seconds from a node's death to the GCS declaring it dead, at most: period × threshold
        (the GCS's health check, module docstring), before the check's own timeout."""
        return self.health_check_period_ms * self.health_check_failure_threshold / 1000

    def describe(self) -> str:
        return (f"{self.cpus_per_node} CPU and {self.gpus_per_node} fake GPUs per node; a node is declared dead after "
                f"{self.health_check_failure_threshold} missed health checks {self.health_check_period_ms} ms apart")


def saved(name: str) -> tuple[int, RayConfig] | None:
    """Cluster ``name``'s node count and :class:`RayConfig` from its ``cluster.json``; None if it has none."""
    try:
        data = json.loads((state_dir(name) / "cluster.json").read_text())
        return int(data["nodes"]), RayConfig(**data["config"])
    except (OSError, ValueError, KeyError, TypeError, RayError):
        return None


def namespace_pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns`` now (``ip netns pids``)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def is_ray(pid: int) -> bool:
    """Whether process ``pid`` is one of Ray's (its program or command line, :data:`PROGRAMS`)."""
    try:
        proc = psutil.Process(pid)
        text = proc.name() + " " + " ".join(proc.cmdline()[:3])
    except psutil.Error:
        return False
    return any(p in text for p in PROGRAMS) or "/ray/" in text


class Ray:
    """The Ray processes of one up :class:`~teraflops.nodes.cluster.Cluster` (made by ``Cluster(ray=...)``).

    Attributes:
        cluster: the cluster (``name``, ``nodes``, ``node_name(i)``, ``address(i)``).
        config: its :class:`RayConfig`.
        dir: :func:`state_dir` of the cluster.
        procs: node index -> its ``ray start --block`` process (this process's children only).
    """

    def __init__(self, cluster, config: RayConfig):
        self.cluster, self.config, self.dir = cluster, config, state_dir(cluster.name)
        self.procs: dict[int, subprocess.Popen] = {}
        self.attempts: dict[int, int] = {}  # node -> which start this is (Ray._retry)

    @property
    def address(self) -> str:
        return address(self.cluster)

    def env(self) -> dict:
        """The environment for Ray commands and drivers on this cluster: ``RAY_ADDRESS``, usage
        statistics off, this Python's ``bin`` first on ``PATH`` (where ``ray`` is)."""
        bin_dir = str(Path(sys.executable).parent)
        return {**os.environ, "RAY_ADDRESS": self.address, "RAY_USAGE_STATS_ENABLED": "0",
                "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}

    def temp_dir(self, i: int) -> Path:
        """Node ``i``'s ``--temp-dir``: ``state_dir/node<i>`` (Ray's sessions, sockets, logs)."""
        return self.dir / f"node{i}"

    def command(self, i: int) -> list[str]:
        """The ``ray start --block`` command of node ``i`` (head on node 0), run in its namespace."""
        c = self.config
        common = ["--block", "--node-ip-address", self.cluster.address(i), "--num-cpus", str(c.cpus_per_node),
                  "--num-gpus", str(c.gpus_per_node), "--object-store-memory", str(c.object_store_mb * 10**6),
                  "--temp-dir", str(self.temp_dir(i)), "--disable-usage-stats"]
        if i == 0:
            system = {"health_check_period_ms": c.health_check_period_ms,
                      "health_check_failure_threshold": c.health_check_failure_threshold,
                      "health_check_initial_delay_ms": 1000, "agent_register_timeout_ms": 120_000}
            return [*ray_command(), "start", "--head", "--port", str(PORT), "--include-dashboard", "false",
                    "--system-config", json.dumps(system), *common]
        return [*ray_command(), "start", "--address", self.address, *common]

    def start_node(self, i: int, attempt: int = 1) -> subprocess.Popen:
        """Start node ``i``'s Ray (``ray start --block`` in its namespace; log ``log/node<i>.out``).
        Also to bring a node back after it was killed (Unit 3)."""
        (self.dir / "log").mkdir(parents=True, exist_ok=True)
        self.temp_dir(i).mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "log" / f"node{i}.out", "ab")
        log.write(START_MARK.encode() + b"\n")
        log.flush()
        try:
            proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.cluster.node_name(i)}", *self.command(i)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                                    start_new_session=True)
        finally:
            log.close()
        self.procs[i], self.attempts[i] = proc, attempt
        return proc

    def start(self, timeout: float = 90) -> "Ray":
        """Start the head, then each worker node in turn; return once every node's ``ray start`` has
        said its raylet registered with the head and ``ray status`` lists every node (the autoscaler's
        view lags the registration by a few seconds on a busy machine: :meth:`wait_listed`).

        Raises:
            RayError: Ray is missing (:func:`unavailable`), a ``ray start`` exited, or the nodes did
                not all join within ``timeout`` s (the message quotes the last log lines).
        """
        reason = unavailable()
        if reason:
            raise RayError(reason + ".")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        (self.dir / "cluster.json").write_text(json.dumps({"name": self.cluster.name, "nodes": self.cluster.nodes,
                                                           "config": asdict(self.config)}))
        for i in range(self.cluster.nodes):  # one at a time: started together on 2 busy cores, their agents'
            began = time.monotonic()          # imports outlasted ray start's 30 s (see _retry)
            self.start_node(i)
            self.wait_nodes([i], timeout)
            self._say_if_slow(f"Ray on node {i} of {self.cluster.nodes}", time.monotonic() - began)
        self.wait_listed(timeout)
        return self

    @staticmethod
    def _say_if_slow(what: str, took: float) -> None:
        """One line when a start took longer than :data:`SLOW_START_S` (a lecture cell under load shows
        progress, not minutes of silence), with the load that explains it."""
        if took > SLOW_START_S:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            print(f"{what} up after {took:.0f} s (load {load:.1f} on {os.cpu_count()} cores: Ray starts "
                  "slowly on a busy machine)", flush=True)

    def wait_listed(self, timeout: float) -> str:
        """Wait until ``ray status`` lists every node of the cluster as active; its text.

        Raises:
            RayError: not within ``timeout`` s (quoting the last status).
        """
        deadline = time.monotonic() + timeout
        while True:
            text = self.status()
            listed = text.split("Pending:", 1)[0].count(" node_")
            if listed >= self.cluster.nodes:
                return text
            if time.monotonic() > deadline:
                raise RayError(f"ray status lists {listed} of {self.cluster.nodes} nodes after {timeout:g} s: "
                               f"{' '.join(text.split())[:300]}")
            time.sleep(1.0)

    def _retry(self, i: int) -> bool:
        """Start node ``i`` again if its ``ray start`` gave up waiting for its raylet to register (Ray waits a
        fixed 30 s, ``ray/_private/node.py``; on 2 busy cores the raylet's Python agents can take longer to
        import), at most :data:`START_ATTEMPTS` times in all; whether it was restarted."""
        text = (self.dir / "log" / f"node{i}.out").read_text(errors="replace")
        attempt = self.attempts.get(i, 1)
        if attempt >= START_ATTEMPTS or "timed out during startup" not in text.rsplit(START_MARK, 1)[-1]:
            return False
        for pid in namespace_pids(self.cluster.node_name(i)):  # what the failed start left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.start_node(i, attempt + 1)
        return True

    def started(self, i: int) -> bool:
        """Whether node ``i``'s ``ray start`` has said "Ray runtime started" (its raylet registered with the
        head) since it was last started (its log's last start)."""
        try:
            text = (self.dir / "log" / f"node{i}.out").read_text(errors="replace")
        except OSError:
            return False
        return "Ray runtime started" in text.rsplit(START_MARK, 1)[-1]

    def wait_nodes(self, nodes, timeout: float) -> None:
        """Wait until every node of ``nodes`` has started (:meth:`started`), ``timeout`` s per start.

        Raises:
            RayError: a node's ``ray start`` exited, or ``timeout`` s passed (quoting the logs).
        """
        deadline = time.monotonic() + timeout
        while not all(self.started(i) for i in nodes):
            exited = [i for i in nodes if i in self.procs and self.procs[i].poll() is not None]
            dead = [i for i in exited if not self._retry(i)]
            if len(dead) < len(exited):
                deadline = time.monotonic() + timeout  # a node started again: its own time
            if dead or time.monotonic() > deadline:
                why = f"ray start on node {dead[0]} exited" if dead else f"not within {timeout:g} s"
                raise RayError(f"Ray did not start on node(s) {', '.join(map(str, nodes))} ({why}). {self.log_tail()}")
            time.sleep(0.2)

    def status(self) -> str:
        """``ray status`` on the head's node: the nodes, resources and demands as Ray sees them."""
        done = self.exec([*ray_command(), "status"], timeout=60)
        return done.stdout if done.returncode == 0 else f"ray status failed: {(done.stderr or done.stdout).strip()[-300:]}"

    def log_tail(self, lines: int = 2) -> str:
        """The last lines of the nodes' ``ray start`` logs, one line (for an error message)."""
        found = []
        for path in sorted((self.dir / "log").glob("node*.out")):
            try:
                tail = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()][-lines:]
            except OSError:
                continue
            found += [f"{path.stem}: {x}" for x in tail]
        return ("Last lines: " + " | ".join(found[-2 * lines:])) if found else f"Logs: {self.dir}"

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL every process in node ``i``'s namespace (its raylet, its workers, its ``ray start``):
        the node dies as a machine does, without telling the head; the PIDs killed."""
        victims = namespace_pids(self.cluster.node_name(i))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc = self.procs.pop(i, None)
        if proc is not None:
            proc.wait(10)
        return victims

    def stop(self) -> None:
        """Stop every node's Ray by PID (SIGTERM to each ``ray start --block`` process group, in
        parallel; SIGKILL after 5 s), never ``ray stop``. The cluster's ``down`` removes whatever is
        left in the namespaces, and the files."""
        stop_groups(self.procs.values())
        self.procs.clear()

    def login(self, i: int = 0) -> list[str]:
        """The argument list that runs a command on node ``i`` with this cluster's ``RAY_ADDRESS``."""
        env = self.env()
        return ["nsenter", f"--net=/run/netns/{self.cluster.node_name(i)}", "env", f"RAY_ADDRESS={env['RAY_ADDRESS']}",
                "RAY_USAGE_STATS_ENABLED=0", f"PATH={env['PATH']}"]

    def exec(self, cmd: list[str], node: int = 0, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` on node ``node`` (default the head's) and wait; output captured as text."""
        return subprocess.run(self.login(node) + list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)

    def processes(self) -> list[dict]:
        """Ray's processes on this cluster's nodes now: ``pid``, ``name``, ``node``."""
        out = []
        for i in range(self.cluster.nodes):
            for pid in namespace_pids(self.cluster.node_name(i)):
                if is_ray(pid):
                    try:
                        out.append({"pid": pid, "name": psutil.Process(pid).name(), "node": i})
                    except psutil.Error:
                        pass
        return out
