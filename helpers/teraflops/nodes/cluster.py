"""A cluster on one machine: emulated nodes joined by shaped links (Linux network namespaces + tc).

Each **node** is a network namespace (``ip netns``; man ``ip-netns(8)``): its own interfaces,
addresses and routes, so processes started in it see only the emulated network. The **switch** is a
Linux bridge in a namespace of its own, and each node's **link** is a veth pair (a virtual cable;
man ``veth(4)``) from the node's ``eth0`` to a switch port. Every name starts with
:data:`PREFIX`, so :func:`down` (``teraflops cluster down``) finds and removes whatever a crashed
run left. Each cluster belongs to an owner process (:mod:`teraflops.ownership`: pid, start time and
user, recorded before any namespace is made): on a shared machine nobody's ``up`` or ``down``
touches a live cluster of another owner (only the host's ``teraflops cluster down --all`` does;
:mod:`teraflops.nodes.ownership_policy` holds those rules).

A link's settings apply in both directions (on the node's ``eth0`` and on its switch port), with
traffic control (man ``tc(8)``):

* **rate**: ``tbf`` (token bucket filter, man ``tc-tbf(8)``), in bytes/s (GB = 1e9, MB = 1e6);
* **latency** and **loss**: ``netem`` (man ``tc-netem(8)``), one-way delay in seconds and the
  fraction of packets dropped, with ``tbf`` as its child when a rate is set (the combination the
  netem documentation gives). Only where the kernel has netem (:func:`qdiscs`): the course's CPU
  machines (kernel 6.18 without ``CONFIG_NET_SCH_NETEM``) shape rate only.

So a message between two nodes crosses two shaped queues (sender's ``eth0``, receiver's switch
port): the one-way latency is twice the configured delay, the rate that of the slower link. Ranks on
one node talk over its loopback, unshaped: that is the intra-node level of the hierarchy.

Nodes have no default route and no link to the host's network: no traffic leaves the emulated
subnet. Needs Linux, root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``); :func:`unavailable` says
in one line what is missing.

Measured here (2-core CPU machine, root): a 200 Mbit/s tbf link between two namespaces carried
23.9 MB/s against the 25 MB/s configured.
"""

from __future__ import annotations

import itertools
import math
import re
import numbers
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from teraflops import ownership
from teraflops.nodes import ray as ray_mod
from teraflops.nodes import slurm as slurm_mod
from teraflops.errors import CourseError
from teraflops.teardown import uninterruptible

PREFIX = "teraflops-"  # every namespace this module makes: teraflops-<name>-switch, teraflops-<name>-node0, ...
SUBNET = "10.213.0"  # node i is 10.213.0.(i+1)/24 on its cluster's own bridge; nothing routes in or out
IFNAME = "eth0"  # a node's interface (each namespace has its own)
MAX_NODES = 200
MAX_RATE = 100e9  # bytes/s; tbf's rate and bucket are 32-bit counters in the kernel's netlink message
_COUNTER = itertools.count()


class ClusterError(CourseError, RuntimeError):
    """The emulated cluster could not be built, changed or used; one line with a hint."""


@dataclass(frozen=True)
class Link:
    """One node's link to the switch, in both directions.

    Attributes:
        rate: bytes/s (1e6 = 1 MB/s = 8 Mbit/s), or None for unshaped (veth runs at memory speed).
        latency: one-way delay added per direction, in seconds (netem ``delay``).
        loss: fraction of packets dropped per direction, 0 ≤ loss < 1 (netem ``loss``).
    """

    rate: float | None = None
    latency: float = 0.0
    loss: float = 0.0

    def __post_init__(self):
        for name in ("latency", "loss") + (("rate",) if self.rate is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ClusterError(f"Link {name} must be a finite number, got {value!r}. "
                                   "Hint: rate in bytes/s (25e6 = 200 Mbit/s), latency in seconds (1e-3 = 1 ms).")
        if self.rate is not None and not 1e4 <= self.rate <= MAX_RATE:
            raise ClusterError(f"Link rate {self.rate!r} B/s is outside [10 kB/s, {MAX_RATE / 1e9:g} GB/s]. "
                               "Hint: rate is in bytes/s: 25e6 is 25 MB/s = 200 Mbit/s; None leaves a link unshaped.")
        if not 0 <= self.latency <= 10:
            raise ClusterError(f"Link latency {self.latency!r} s is outside [0, 10] s. Hint: latency is in seconds: 1e-3 is 1 ms.")
        if not 0 <= self.loss < 1:
            raise ClusterError(f"Link loss {self.loss!r} is outside [0, 1). Hint: loss is a fraction: 0.01 drops 1% of packets.")

    def describe(self) -> str:
        """``"25 MB/s (200 Mbit/s), 1 ms, 0% loss"``."""
        rate = "unshaped" if self.rate is None else f"{self.rate / 1e6:.3g} MB/s ({self.rate * 8 / 1e6:.3g} Mbit/s)"
        return f"{rate}, {self.latency * 1e3:.3g} ms, {self.loss * 100:.3g}% loss"

    def tc_commands(self, dev: str) -> list[list[str]]:
        """``tc`` argument lists that give device ``dev`` this link's egress (after ``qdisc del root``).

        Raises:
            ClusterError: latency or loss is asked for and this kernel has no netem qdisc.
        """
        if (self.latency or self.loss) and "netem" not in qdiscs():
            raise ClusterError(f"this kernel has no netem qdisc (sch_netem), so a link cannot add latency or loss "
                               f"here (asked: {self.describe()}). Hint: keep latency=0 and loss=0; rate shaping (tbf) works.")
        commands = []
        tbf = ["tbf", "rate", f"{int(self.rate * 8)}bit", "burst", f"{_burst(self.rate)}", "latency", "100ms"] \
            if self.rate is not None else []
        if self.latency or self.loss:
            netem = ["netem", "delay", f"{self.latency * 1e6:.0f}us", "loss", f"{self.loss * 100:g}%", "limit", "100000"]
            commands.append(["qdisc", "add", "dev", dev, "root", "handle", "1:", *netem])
            if tbf:
                commands.append(["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        elif tbf:
            commands.append(["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        return commands


def _burst(rate: float) -> int:
    """tbf bucket size in bytes: 2 ms of traffic, at least 64 KiB (a GSO super-packet must fit)."""
    return max(64 * 1024, int(rate * 2e-3))


_PROBE: tuple | None = None  # (why a namespace cannot be made, qdiscs), probed once per process
_PROBE_LOCK = threading.Lock()


def _probe() -> tuple[str | None, frozenset]:
    """Make a scratch namespace once per process: why that failed (``None`` if it worked), and the
    shaping qdiscs of ``{"tbf", "netem"}`` that could be added to its loopback."""
    global _PROBE
    with _PROBE_LOCK:  # threads of one process (teraflops.orchestration.slurm_queue.run_lecture) share the probe's name
        return _probe_once()


def _probe_once() -> tuple[str | None, frozenset]:
    global _PROBE
    if _PROBE is None:
        probe, found = f"{PREFIX}probe{os.getpid()}", set()
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            _PROBE = (f"cannot create a network namespace here ({made.stderr.strip() or 'ip netns add failed'})",
                      frozenset())
            return _PROBE
        try:
            for kind, args in (("tbf", ["rate", "1mbit", "burst", "32k", "latency", "10ms"]), ("netem", ["delay", "1ms"])):
                cmd = ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", kind, *args]
                if subprocess.run(cmd, capture_output=True).returncode == 0:
                    found.add(kind)
                    subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "del", "dev", "lo", "root"],
                                   capture_output=True)
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        _PROBE = (None, frozenset(found))
    return _PROBE


def qdiscs() -> frozenset:
    """The shaping qdiscs this kernel has, of ``{"tbf", "netem"}`` (probed once, in a scratch namespace;
    empty where no namespace can be made).

    ``tbf`` sets a link's rate; ``netem`` its latency and loss. A kernel built without
    ``CONFIG_NET_SCH_NETEM`` (as on the course's CPU machines) has rate shaping only.
    """
    return _probe()[1]


def unavailable(probe: bool = True) -> str | None:
    """Why emulated nodes cannot run here, in one line; ``None`` when they can.

    Checks, in order: Linux, root (network namespaces need CAP_NET_ADMIN), ``ip`` and ``tc`` on the
    PATH, and (``probe``, the default) that a namespace can be made and removed (a container may
    forbid it); ``probe=False`` makes no namespace, for a report that must not touch the machine.
    """
    if sys.platform != "linux":
        return f"emulated nodes need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces and tc need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need iproute2 ({' and '.join(missing)} not found; apt install iproute2)"
    if not probe:
        return None
    why, found = _probe()
    if why:
        return why
    if "tbf" not in found:
        return "this kernel has no tbf qdisc (sch_tbf), so links cannot be rate-shaped"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}. "
                           "Hint: `teraflops cluster down` removes leftovers of an earlier run.")
    return done


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`tc {' '.join(args)}` in {ns} failed: {done.stderr.strip()}. "
                           "Hint: the link's settings may be out of tc's range; `teraflops cluster down` removes the nodes.")
    return done


def namespaces() -> list[str]:
    """The course's network namespaces that exist now (``teraflops-*``), e.g. left by a crash."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True) if shutil.which("ip") else None
    if done is None or done.returncode != 0:
        return []
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def pids(ns: str) -> list[int]:
    """Processes running in namespace ``ns`` (``ip netns pids``)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def cluster_of(ns: str) -> str | None:
    """The cluster name in namespace ``ns`` (``teraflops-<name>-switch`` or ``-node<i>``), else None."""
    m = re.fullmatch(re.escape(PREFIX) + r"([A-Za-z0-9]+)-(switch|node\d+)", ns)
    return m.group(1) if m else None


def by_cluster() -> dict[str, list[str]]:
    """The course's namespaces now, by cluster name (a probe namespace of a dead process under ``""``)."""
    out: dict[str, list[str]] = {}
    for ns in namespaces():
        name = cluster_of(ns)
        if name is None:
            probe = re.fullmatch(re.escape(PREFIX) + r"probe(\d+)", ns)
            if probe and ownership.start_time(int(probe.group(1))) is not None:
                continue  # a live process's probe
            name = ""
        out.setdefault(name, []).append(ns)
    return out


def leftovers() -> dict[str, list[str]]:
    """Namespaces whose owner is gone (or was never recorded), by cluster name: anyone may remove them."""
    return {name: found for name, found in by_cluster().items()
            if not name or not ownership.alive(ownership.read(name))}


def jobs(found: list[str]) -> tuple[int, int]:
    """(jobs, processes) running in namespaces ``found``: a job is one launch (its results folder)."""
    import psutil

    procs = [p for ns in found for p in pids(ns)]
    dirs = set()
    for pid in procs:
        try:
            dirs.add(psutil.Process(pid).environ().get("TERAFLOPS_RESULTS_DIR"))
        except psutil.Error:
            pass
    return len(dirs - {None}), len(procs)


def down(grace: float = 3.0, only: list[str] | None = None) -> list[str]:
    """Remove every namespace of the course (or ``only`` these), after stopping the processes in it.

    Returns the names actually removed (removing needs root: one that is still there is left out).

    SIGTERM, then SIGKILL after ``grace`` s, to every process in a ``teraflops-*`` namespace (SIGKILL at
    once to ``slurmstepd`` and ``slurmctld``: :func:`teraflops.nodes.slurm.kill_at_once`); then
    ``ip netns del`` (which removes the veth pairs and the bridge inside). Safe to call at any time,
    also when nothing is left: ``teraflops cluster down``.
    """
    found = namespaces() if only is None else list(only)
    _stop_processes(found, grace)
    for ns in found:
        _ip("netns", "del", ns, check=False)
    left = set(namespaces())
    for name in {cluster_of(ns) for ns in found} - {None}:
        if not any(cluster_of(ns) == name for ns in left):
            slurm_mod.remove_state(name)  # a Slurm cluster's files, once its daemons are gone
            ray_mod.remove_state(name)  # a Ray cluster's temporary folders, likewise
    return [ns for ns in found if ns not in left]


def _stop_processes(found: list[str], grace: float) -> None:
    """SIGTERM every process in namespaces ``found`` (SIGKILL to :func:`teraflops.nodes.slurm.kill_at_once`'s),
    then SIGKILL what is left after ``grace`` s; returns once they are gone or the second grace is over."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        victims = {p for ns in found for p in pids(ns)}
        hard = slurm_mod.kill_at_once(victims) if sig == signal.SIGTERM else set()
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL if p in hard else sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while victims and time.monotonic() < deadline:
            victims = {p for p in victims if _alive(p)}
            time.sleep(0.05)
        if not victims:
            return


def _down_uninterrupted(names: list[str]) -> None:
    """:func:`down` of ``names``, finished even if more Ctrl-Cs arrive; one that came is raised afterwards."""
    uninterruptible(down, only=names)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Cluster:
    """K emulated nodes on one switch; a context manager that tears everything down on exit.

    >>> with Cluster(2, Link(rate=25e6, latency=0.5e-3)) as cl:   # doctest: +SKIP
    ...     cl.run(0, ["ping", "-c", "1", cl.address(1)])

    Args:
        nodes: how many nodes (1 ≤ nodes ≤ 200).
        link: every node's link (one :class:`Link`), or one per node (a list).
        name: the cluster's part of its namespaces' names (default: unique to this process and
            cluster), so that clusters do not meet; each has its own bridge (the same subnet on each).
        owner_pid: the process the cluster belongs to (default: this one; ``teraflops cluster up`` gives
            the leader of its caller's login session, :mod:`teraflops.nodes.ownership_policy`). While it
            lives, no other owner's ``up`` of the same name or ``teraflops cluster down`` touches the cluster.
        slurm: ``True`` or a :class:`teraflops.nodes.slurm.SlurmConfig`: also run a Slurm cluster on the nodes
            (:mod:`teraflops.nodes.slurm`; then ``cl.slurm_`` is its :class:`~teraflops.nodes.slurm.Slurm`).
        ray: ``True`` or a :class:`teraflops.nodes.ray.RayConfig`: also run a Ray cluster on the nodes, its
            head on node 0 (:mod:`teraflops.nodes.ray`; then ``cl.ray_`` is its :class:`~teraflops.nodes.ray.Ray`).

    Raises:
        ClusterError: the machine cannot host it (:func:`unavailable`), bad arguments, or an
            ``ip``/``tc`` command failed (the message names it).
    """

    nodes: int
    link: Link | list[Link] = field(default_factory=Link)
    name: str = field(default_factory=lambda: f"{os.getpid()}c{next(_COUNTER)}")
    owner_pid: int | None = None  # the process it belongs to (default: this one; the CLI: the login session's leader)
    slurm: bool | slurm_mod.SlurmConfig = False
    slurm_: slurm_mod.Slurm | None = field(init=False, default=None)
    ray: bool | ray_mod.RayConfig = False
    ray_: ray_mod.Ray | None = field(init=False, default=None)
    links: list[Link] = field(init=False, default_factory=list)
    up_: bool = field(init=False, default=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isalnum() or len(self.name) > 20:
            raise ClusterError(f"name must be 1-20 letters or digits, got {self.name!r}. Hint: Cluster(2, name='demo').")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, numbers.Integral) or not 1 <= self.nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be an int in [1, {MAX_NODES}], got {self.nodes!r}. Hint: Cluster(2) makes two nodes.")
        links = self.link if isinstance(self.link, (list, tuple)) else [self.link] * self.nodes
        if len(links) != self.nodes or not all(isinstance(x, Link) for x in links):
            raise ClusterError(f"link must be one Link or a list of {self.nodes} Links, got {self.link!r}. "
                               "Hint: Link(rate=25e6, latency=1e-3).")
        self.links = list(links)
        if self.slurm is True:
            self.slurm = slurm_mod.SlurmConfig()
        if self.slurm is not False and not isinstance(self.slurm, slurm_mod.SlurmConfig):
            raise ClusterError(f"slurm must be True, False or a SlurmConfig, got {self.slurm!r}. "
                               "Hint: Cluster(3, slurm=SlurmConfig(scheduler='fifo')).")
        if self.ray is True:
            self.ray = ray_mod.RayConfig()
        if self.ray is not False and not isinstance(self.ray, ray_mod.RayConfig):
            raise ClusterError(f"ray must be True, False or a RayConfig, got {self.ray!r}. "
                               "Hint: Cluster(3, ray=RayConfig(gpus_per_node=2)).")

    @property
    def switch(self) -> str:
        """The switch's namespace, ``teraflops-<name>-switch``."""
        return f"{PREFIX}{self.name}-switch"

    def node_name(self, i: int) -> str:
        """Node ``i``'s namespace, ``teraflops-<name>-node<i>``."""
        return f"{PREFIX}{self.name}-node{i}"

    def namespaces(self) -> list[str]:
        """This cluster's namespaces that exist now."""
        mine = {self.switch, *(self.node_name(i) for i in range(self.nodes))}
        return [ns for ns in namespaces() if ns in mine]

    @staticmethod
    def address(i: int) -> str:
        """Node ``i``'s IPv4 address on the emulated subnet."""
        return f"{SUBNET}.{i + 1}"

    def up(self) -> "Cluster":
        """Create the switch, the nodes and their links (removing any leftovers first)."""
        reason = unavailable() or (slurm_mod.unavailable(self.slurm.accounting) if self.slurm else None) or \
            (ray_mod.unavailable() if self.ray else None)
        if reason:
            raise ClusterError(reason + ".")
        claimed, held = ownership.claim(self.name, self.nodes, self.owner_pid)
        if not claimed:  # nothing of the other owner's cluster is touched
            raise ClusterError(f"a cluster named {self.name!r} belongs to {ownership.describe(held)}. "
                               "Hint: use another name (Cluster(2, name=...), `teraflops cluster up --name ...`), "
                               "or leave the name out for one of your own.")
        ownership.clear_taken_down(self.name)
        mine = self.namespaces()
        if any(pids(ns) for ns in mine):
            ownership.release(self.name)
            raise ClusterError(f"a cluster named {self.name!r} is up with processes running on it. "
                               "Hint: take that one down first (Cluster.down(), or `teraflops cluster down`), or use another name.")
        down(only=mine)  # leftovers of a crashed cluster of the same name (its owner is gone), idle
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i in range(self.nodes):
                ns, port = self.node_name(i), f"port{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", IFNAME, ns=ns)
                _ip("link", "set", IFNAME, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
                self._shape(i, self.links[i])
            if self.slurm:
                self.slurm_ = slurm_mod.Slurm(self, self.slurm).start()
            if self.ray:
                self.ray_ = ray_mod.Ray(self, self.ray)
                self.ray_.start()
            self.up_ = True
        except BaseException:
            self._stop_services()
            _down_uninterrupted(self.namespaces())  # a second Ctrl-C must not leave half a cluster
            ownership.release(self.name)  # only ours: the claim above made the name ours
            self.up_ = False
            raise
        return self

    def _shape(self, i: int, link: Link) -> None:
        """Give both ends of node ``i``'s link ``link``'s egress; every command is built (and checked) first."""
        plan = [(ns, link.tc_commands(dev), dev) for ns, dev in ((self.node_name(i), IFNAME), (self.switch, f"port{i}"))]
        for ns, commands, dev in plan:
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)  # none yet is fine
            for args in commands:
                _tc(ns, *args)

    def set_link(self, i: int, link: Link | None = None, **changes) -> Link:
        """Change node ``i``'s link now (also while jobs run): a new :class:`Link`, or fields to change.

        ``cl.set_link(1, rate=5e6)`` slows node 1 to 5 MB/s and keeps its latency and loss.
        Returns the link now in force.
        """
        self._check_node(i)
        unknown = set(changes) - {"rate", "latency", "loss"}
        if unknown or (link is not None and changes) or (link is not None and not isinstance(link, Link)):
            raise ClusterError(f"set_link takes a Link or some of rate=, latency=, loss=; got {link!r} and {changes}. "
                               "Hint: cl.set_link(1, rate=5e6) or cl.set_link(1, Link(rate=5e6)).")
        new = link if link is not None else replace(self.links[i], **changes)
        if self.up_:
            self._shape(i, new)
        self.links[i] = new
        return new

    def _check_node(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.nodes:
            raise ClusterError(f"node must be an int in [0, {self.nodes - 1}], got {i!r}.")

    def prefix(self, i: int) -> list[str]:
        """The argument list that runs a command on node ``i``: ``["ip", "netns", "exec", name]``."""
        self._check_node(i)
        if not self.up_:
            raise ClusterError(f"cluster {self.name!r} is not up. Hint: with Cluster(2) as cl: ..., or cl.up().")
        return ["ip", "netns", "exec", self.node_name(i)]

    def run(self, i: int, cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` on node ``i`` and wait (output captured as text)."""
        return subprocess.run(self.prefix(i) + list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)

    def down(self) -> None:
        """Stop every process on the nodes and remove them, the switch and the links (also through a
        second Ctrl-C)."""
        held = ownership.read(self.name)
        if self._mine() or not ownership.alive(held):  # never a live cluster of another owner of the name
            self._stop_services()
            _down_uninterrupted(self.namespaces())
            slurm_mod.remove_state(self.name)
            ray_mod.remove_state(self.name)
            ownership.release(self.name)
        self.slurm_ = self.ray_ = None
        self.up_ = False

    def _stop_services(self) -> None:
        """Stop the Slurm daemons and the Ray nodes this process started (by PID, in parallel, reaped; also
        through a second Ctrl-C); :func:`down` kills what is left in the namespaces."""
        if self.slurm_ is not None or self.slurm:
            uninterruptible((self.slurm_ or slurm_mod.Slurm(self, self.slurm)).stop)
        if self.ray_ is not None:
            uninterruptible(self.ray_.stop)

    def _mine(self) -> bool:
        held = ownership.read(self.name)
        return bool(held) and held.get("pid") == (self.owner_pid or os.getpid())

    def taken_down(self, since: float | None = None) -> str | None:
        """Why this cluster is gone though it was up (one line: who removed it), else None. ``since``
        (Unix seconds): a ``down --all`` noted after it counts even while its namespaces are still
        being removed (it marks the cluster before it stops the processes on it)."""
        by = ownership.taken_down_by(self.name)
        noted = by is not None and since is not None and by.get("time", 0) >= since
        if not self.up_ or (not noted and len(self.namespaces()) == self.nodes + 1):
            return None
        who = f"{ownership.describe(by).replace(', gone', '')} with `teraflops cluster down --all`" if by else "someone"
        return f"cluster {self.name!r} was taken down by {who} while the job ran."

    def describe(self) -> str:
        """One line per node: name, address, link."""
        return "\n".join(f"{self.node_name(i)}  {self.address(i)}  {self.links[i].describe()}" for i in range(self.nodes))

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def attach(name: str) -> Cluster:
    """Cluster ``name`` with its Slurm, up and started by another process (``teraflops cluster up
    --slurm``, a notebook), from the files in :func:`teraflops.nodes.slurm.state_dir`: its ``slurm_``'s
    ``exec``, ``login`` and ``daemons`` work. Links are unknown (unshaped in ``links``); the daemons
    stay the starter's (``slurm_.stop`` stops none).

    Raises:
        teraflops.nodes.slurm.SlurmError: no Slurm files for ``name``, or its nodes are not all there.
    """
    found = slurm_mod.saved(name)
    if found is None:
        raise slurm_mod.SlurmError(
            f"no Slurm cluster named {name!r} is up here (no {slurm_mod.state_dir(name)}/cluster.json). "
            "Hint: `teraflops cluster up --slurm` starts one; `teraflops cluster status` lists them.")
    nodes, config = found
    made = Cluster(nodes, name=name, slurm=config)
    if len(made.namespaces()) != nodes + 1:
        raise slurm_mod.SlurmError(
            f"cluster {name!r} has Slurm files but not its {nodes} nodes (taken down?). Hint: "
            "`teraflops cluster down` removes what is left; `teraflops cluster up --slurm` again.")
    made.slurm_, made.up_ = slurm_mod.Slurm(made, config), True
    return made


def attach_ray(name: str) -> Cluster:
    """Cluster ``name`` with its Ray, up and started by another process (``teraflops cluster up --ray``,
    a notebook), from :func:`teraflops.nodes.ray.state_dir`'s ``cluster.json``: its ``ray_``'s ``exec``,
    ``login`` and ``processes`` work; its Ray stays the starter's (``ray_.stop`` stops none).

    Raises:
        teraflops.nodes.ray.RayError: no Ray files for ``name``, or its nodes are not all there.
    """
    found = ray_mod.saved(name)
    if found is None:
        raise ray_mod.RayError(f"no Ray cluster named {name!r} is up here (no {ray_mod.state_dir(name)}/cluster.json). "
                               "Hint: `teraflops cluster up --ray` starts one; `teraflops cluster status` lists them.")
    nodes, config = found
    made = Cluster(nodes, name=name, ray=config)
    if len(made.namespaces()) != nodes + 1:
        raise ray_mod.RayError(f"cluster {name!r} has Ray files but not its {nodes} nodes (taken down?). Hint: "
                               "`teraflops cluster down` removes what is left; `teraflops cluster up --ray` again.")
    made.ray_, made.up_ = ray_mod.Ray(made, config), True
    return made
