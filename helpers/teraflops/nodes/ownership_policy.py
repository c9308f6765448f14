"""Whose emulated clusters a caller may take down, which one a command runs on, and what is up: the
workshop's rules for clusters on a shared machine (README, "A workshop on one machine"), as Python.

``teraflops cluster up|down|status|exec`` only parses and prints what this module decides; a Python
user gets the same rules (:func:`down_for`, :func:`status_rows`, :func:`up_for`, :func:`exec_target`).

A **caller** is the process a command acts for: the leader of its login session
(:func:`teraflops.ownership.session_owner`: the terminal's shell, not the command's parent, so that
``timeout 60 teraflops cluster up``, ``make``, a script or ``sudo`` record an owner that lives as long
as the user's shell), or a process named explicitly (``--owner PID``, :func:`resolve_caller`). The rules:

* ``up`` makes a cluster owned by the caller; its default name is ``cli<caller pid>``, so every
  command of one session finds it, and two terminals (two sessions) get one each.
* ``down`` takes down the caller's clusters (same owner process: pid and start time), clusters
  whose owner is gone (**leftovers**: anyone may remove them), and, with a name, a cluster of that
  name of the caller's own user. A live cluster of another owner (another session, another user)
  is left running, unless ``all`` (the host's ``down --all``): then it is marked as taken down by the
  caller (:func:`teraflops.ownership.mark_taken_down`), so its jobs can say by whom.
* Owner records of dead owners whose namespaces are gone, and Slurm and Ray files of clusters whose nodes
  and owner are gone, are removed by every ``down``.
"""

from __future__ import annotations

from dataclasses import dataclass

from teraflops import ownership
from teraflops.nodes import cluster as cl
from teraflops.nodes import ray as ray_mod
from teraflops.nodes import slurm as slurm_mod

# Why down takes a cluster (or leaves it)
LEFTOVER = "leftover"  # its owner is gone, or it has none: anyone may remove it
YOURS = "yours"  # the caller owns it
NAMED = "named"  # the caller named it, and it is of the caller's user
ALL = "all"  # another owner's live cluster, taken down by `down --all`
OTHERS = "others"  # another owner's live cluster: left running


@dataclass(frozen=True)
class Decision:
    """What ``down`` does with one cluster.

    Attributes:
        name: the cluster's name (``""``: namespaces of no cluster, a dead process's probe).
        owner: its owner record (:mod:`teraflops.ownership`), or None.
        take: True if ``down`` removes it.
        why: :data:`LEFTOVER`, :data:`YOURS`, :data:`NAMED`, :data:`ALL` or :data:`OTHERS`.
    """

    name: str
    owner: dict | None
    take: bool
    why: str


@dataclass(frozen=True)
class DownResult:
    """What :func:`down_for` did.

    Attributes:
        decisions: one :class:`Decision` per cluster that had namespaces, by name.
        removed: the namespaces removed.
        failed: the namespaces it should have removed and could not (removing needs root).
        processes: processes stopped on the removed clusters' nodes.
        daemons: the names of the Slurm daemons among them, one per daemon.
        released: owner records removed (of clusters taken down, and of dead owners with no nodes).
    """

    decisions: tuple[Decision, ...]
    removed: tuple[str, ...]
    failed: tuple[str, ...]
    processes: int
    daemons: tuple[str, ...]
    released: tuple[str, ...]

    @property
    def skipped(self) -> tuple[Decision, ...]:
        """The clusters left running: live ones of other owners."""
        return tuple(d for d in self.decisions if not d.take)

    @property
    def taken(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.take)


@dataclass(frozen=True)
class Daemon:
    """One Slurm daemon of a cluster: its program (:data:`teraflops.nodes.slurm.DAEMONS`), pid and node."""

    name: str
    pid: int
    node: int

    @property
    def host(self) -> str:
        """The node's host name in the cluster, ``node<i>``."""
        return slurm_mod.host(self.node)


@dataclass(frozen=True)
class ClusterRow:
    """One cluster as ``teraflops cluster status`` lists it.

    Attributes:
        name: the cluster's name (``""``: namespaces of no cluster, a leftover).
        owner: its owner record, or None.
        nodes: node namespaces that exist.
        jobs: launches running on them (distinct launch folders among their processes).
        processes: processes running on them.
        slurm: its Slurm configuration, if it runs Slurm.
        daemons: its Slurm daemons, by node then by :data:`teraflops.nodes.slurm.DAEMONS` order.
        ray: its Ray configuration, if it runs Ray.
    """

    name: str
    owner: dict | None
    nodes: int
    jobs: int
    processes: int
    slurm: slurm_mod.SlurmConfig | None
    daemons: tuple[Daemon, ...]
    ray: ray_mod.RayConfig | None = None


def resolve_caller(owner: int | None = None) -> int:
    """The process a command acts for: ``owner`` (``--owner PID``) if given, else the leader of this
    process's login session (:func:`teraflops.ownership.session_owner`).

    Raises:
        teraflops.nodes.cluster.ClusterError: ``owner`` is not a running process.
    """
    if owner is None:
        return ownership.session_owner()
    if isinstance(owner, bool) or not isinstance(owner, int) or owner < 1 or ownership.start_time(owner) is None:
        raise cl.ClusterError(f"--owner {owner}: no such process. Hint: --owner $$ makes your shell the owner; "
                              "leave it out for your login session's.")
    return owner


def decide(groups: dict[str, list[str]], records: dict[str, dict | None], me: dict, name: str | None = None,
           all: bool = False, alive=ownership.alive) -> tuple[Decision, ...]:
    """What ``down`` does with each cluster of ``groups`` (namespaces by cluster name,
    :func:`teraflops.nodes.cluster.by_cluster`), given their owner ``records``, for caller ``me``
    (an owner record, :func:`teraflops.ownership.owner`); the rules are the module docstring's.
    ``alive`` tells whether an owner record's process runs."""
    out = []
    for cluster, _ in sorted(groups.items()):
        held = records.get(cluster) if cluster else None
        if not cluster or not alive(held):
            why = LEFTOVER
        elif ownership.same_owner(held, me):
            why = YOURS
        elif name is not None and cluster == name and held.get("uid") in (me.get("uid"), None):
            why = NAMED
        else:
            why = ALL if all else OTHERS
        out.append(Decision(cluster, held, why != OTHERS, why))
    return tuple(out)


def down_for(caller: int, name: str | None = None, all: bool = False) -> DownResult:
    """Take down what caller process ``caller`` may (see the module docstring): its clusters, leftovers,
    ``name`` if it is of the caller's user, and with ``all`` every cluster; stop every process on their
    nodes, remove them, and the records and Slurm files that are left of them. Needs root to remove
    namespaces (:attr:`DownResult.failed` lists what stayed)."""
    me = ownership.owner(caller)
    groups = cl.by_cluster()
    decisions = decide(groups, {n: ownership.read(n) for n in groups if n}, me, name, all)
    for d in decisions:
        if d.why == ALL:
            ownership.mark_taken_down(d.name, me)  # before its jobs die: they read who did it
    found = [ns for d in decisions if d.take for ns in groups[d.name]]
    daemons = tuple(d["name"] for d in slurm_mod.daemons(found))
    processes = sum(len(cl.pids(ns)) for ns in found)
    removed = cl.down(only=found) if found else []
    released = []
    for d in decisions:
        if d.take and d.name and not set(groups[d.name]) - set(removed):
            ownership.release(d.name)
            released.append(d.name)
    released += _forget_the_dead(groups)
    return DownResult(decisions, tuple(removed), tuple(ns for ns in found if ns not in removed), processes, daemons,
                      tuple(released))


def _forget_the_dead(groups: dict[str, list[str]]) -> list[str]:
    """Remove records of dead owners whose namespaces are gone, and Slurm and Ray files of clusters whose nodes
    and owner are gone; the names of the records removed."""
    released = []
    for name, held in ownership.records().items():
        if name not in groups and not ownership.alive(held):
            ownership.release(name)
            released.append(name)
    for name in slurm_mod.state_names():
        if name not in groups and not ownership.alive(ownership.read(name)):
            slurm_mod.remove_state(name)
    for name in ray_mod.state_names():
        if name not in groups and not ownership.alive(ownership.read(name)):
            ray_mod.remove_state(name)
    return released


def status_rows() -> list[ClusterRow]:
    """Every cluster with namespaces now, by name: owner, nodes, jobs and processes, Slurm and its daemons."""
    rows = []
    for name, found in sorted(cl.by_cluster().items()):
        n_jobs, n_procs = cl.jobs(found)
        daemons = sorted((Daemon(d["name"], d["pid"], node_index(d["namespace"])) for d in slurm_mod.daemons(found)),
                         key=lambda d: (d.node, slurm_mod.DAEMONS.index(d.name)))
        saved = slurm_mod.saved(name) if name else None
        rows.append(ClusterRow(name, ownership.read(name) if name else None, sum(1 for ns in found if "-node" in ns),
                               n_jobs, n_procs, saved[1] if saved else None, tuple(daemons),
                               (ray_mod.saved(name) or (0, None))[1] if name else None))
    return rows


def node_index(namespace: str) -> int:
    """``teraflops-<name>-node<i>`` -> ``i``."""
    return int(namespace.rsplit("-node", 1)[1])


def default_name(caller: int) -> str:
    """The name of caller ``caller``'s cluster when none is given: ``cli<pid>``."""
    return f"cli{caller}"


def up_for(caller: int, nodes: int, link: cl.Link | None = None, name: str | None = None,
           slurm: bool | slurm_mod.SlurmConfig = False, ray: bool | ray_mod.RayConfig = False) -> cl.Cluster:
    """Bring up a cluster of ``nodes`` nodes owned by caller process ``caller`` (name: ``name`` or
    :func:`default_name`); it stays up after this process ends, until :func:`down_for`.

    Raises:
        teraflops.nodes.cluster.ClusterError: the caller's cluster of that name is already up, the
            name belongs to another live owner, or the machine cannot host it (:meth:`Cluster.up`).
    """
    made = cl.Cluster(nodes, link or cl.Link(), name=name or default_name(caller), owner_pid=caller, slurm=slurm,
                      ray=ray)
    held = ownership.read(made.name)
    if held and ownership.alive(held) and ownership.same_owner(held, ownership.owner(caller)) and made.namespaces():
        raise cl.ClusterError(f"your cluster {made.name!r} is already up. Hint: `teraflops cluster down` first, "
                              "or --name another.")
    return made.up()


def exec_target(caller: int, name: str | None = None) -> str:
    """The cluster a command of caller ``caller`` runs on: ``name``; else the caller's own
    (:func:`default_name`), else the only one up with Slurm or Ray (else the only one up).

    Raises:
        teraflops.nodes.cluster.ClusterError: ``name`` is not up; none is up; several are and none is the caller's.
    """
    groups = {n: found for n, found in cl.by_cluster().items() if n}
    if name is not None:
        if name not in groups:
            raise cl.ClusterError(f"no cluster named {name!r} is up (up now: {', '.join(sorted(groups)) or 'none'}). "
                                  "Hint: `teraflops cluster status` lists them.")
        return name
    if default_name(caller) in groups:
        return default_name(caller)
    with_slurm = [n for n in sorted(groups) if slurm_mod.saved(n) is not None or ray_mod.saved(n) is not None]
    candidates = with_slurm or sorted(groups)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise cl.ClusterError("no cluster is up. Hint: teraflops cluster up --nodes 3 --slurm")
    raise cl.ClusterError(f"{len(candidates)} clusters are up ({', '.join(candidates)}) and none is your shell's. "
                          f"Hint: choose one with --name, e.g. teraflops cluster exec --name {candidates[0]} -- sinfo")


def joined(name: str) -> cl.Cluster:
    """Cluster ``name``, up and made by another process, to run commands on: with its Slurm
    (:func:`teraflops.nodes.cluster.attach`) where it runs Slurm, else its nodes alone (counted from
    its namespaces); its :meth:`~teraflops.nodes.cluster.Cluster.taken_down` says if it goes meanwhile."""
    if slurm_mod.saved(name) is not None:
        return cl.attach(name)
    if ray_mod.saved(name) is not None:
        return cl.attach_ray(name)
    made = cl.Cluster(max(1, sum(1 for ns in cl.by_cluster().get(name, []) if "-node" in ns)), name=name)
    made.up_ = True
    return made
