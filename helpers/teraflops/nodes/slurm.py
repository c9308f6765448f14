"""A real Slurm cluster on the emulated nodes: the scheduler a learner meets on a GPU cluster.

:class:`teraflops.nodes.cluster.Cluster` makes K nodes (network namespaces on one bridge). With
``slurm=True`` (or a :class:`SlurmConfig`) it also starts, all as root and all *inside the nodes*:

* ``munged`` (authentication; its own key and socket per cluster) and, with accounting, ``mariadbd``
  and ``slurmdbd`` on node 0;
* ``slurmctld`` (the controller) on node 0, the *login node*: ``teraflops cluster exec -- sinfo``;
* one ``slurmd`` per node, each in its node's network namespace (``nsenter --net``) and in UTS and
  mount namespaces of its own (``unshare --uts --mount``): hostname ``node<i>`` and a private
  ``/etc/hosts`` naming every node, so ``srun hostname`` and torchrun's rendezvous see real hosts.

Every daemon and every job process lives in a node's network namespace, so
:func:`teraflops.nodes.cluster.down` (``teraflops cluster down``), which stops whatever runs in the
course's namespaces, also removes the cluster after its notebook was SIGKILLed; the cluster's files
(:func:`state_dir`, under ``/run``) go with it. The daemons outlive the process that started them
(``teraflops cluster up --slurm`` returns, they keep running): another process finds them with
:func:`teraflops.nodes.cluster.attach` from the files (``cluster.json`` keeps the node count and :class:`SlurmConfig`).

Nodes declare their CPUs and ``gpus_per_node`` fake GPUs (GRES backed by character devices like
``/dev/null``: Slurm counts and hands them out, ``--gpus`` sets ``CUDA_VISIBLE_DEVICES``; nothing
computes on them). The scheduler is Slurm's own: ``fifo`` is ``sched/builtin`` (strict priority
order: a job that cannot start blocks the partition), ``backfill`` is ``sched/backfill`` (EASY-style:
a later job starts now if it does not delay the reservation of any higher-priority job, judged by
*time limits*, ``--time``). Slurm keeps time limits in whole minutes: scaled-down jobs run seconds
under limits of minutes, so backfill plans with limits far longer than the runs (see Unit 3).
Accounting (``slurmdbd`` + MariaDB) adds ``sacct`` and fair share (``priority/multifactor``).

Slurm: https://slurm.schedmd.com (slurm.conf(5), gres.conf(5), sched_config, fair_tree). Setup and
gotchas measured on the course machines: ``shared/ENVIRONMENT.md`` (Slurm 22.05, Debian 12).
Needs root, Linux, and the packages of :data:`INSTALL`; :func:`unavailable` says in one line what
is missing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from teraflops.errors import CourseError
from teraflops.teardown import StateFolders, stop_groups

INSTALL = ("apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge "
           "slurmdbd mariadb-server")
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")  # the processes a cluster's Slurm runs
_BINARIES = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd",
             "sinfo": "sinfo", "sbatch": "sbatch", "nsenter": "nsenter", "unshare": "unshare"}
_ACCOUNTING = {"slurmdbd": "/usr/sbin/slurmdbd", "mariadbd": "/usr/sbin/mariadbd",
               "mariadb-install-db": "mariadb-install-db", "sacctmgr": "sacctmgr"}
STATE_ENV = "TERAFLOPS_SLURM_DIR"
SCHEDULERS = {"fifo": "sched/builtin", "backfill": "sched/backfill"}


class SlurmError(CourseError, RuntimeError):
    """Slurm on the emulated nodes could not start or answer; one line with a hint."""


def unavailable(accounting: bool = False) -> str | None:
    """Why Slurm cannot run on emulated nodes here, in one line; ``None`` when it can.

    Checks the Slurm and MUNGE programs (and slurmdbd, MariaDB with ``accounting``) and names the
    install command; the nodes themselves are :func:`teraflops.nodes.cluster.unavailable`'s business.
    """
    wanted = {**_BINARIES, **(_ACCOUNTING if accounting else {})}
    missing = [name for name, path in wanted.items() if shutil.which(path) is None]
    if missing:
        return f"Slurm on emulated nodes needs {', '.join(missing)} (not found; as root: {INSTALL})"
    return None


# Every cluster's Slurm files (configuration, state, logs, job output): one folder per cluster under
# ``${STATE_ENV}`` or ``/run/teraflops/slurm`` (teraflops.teardown.StateFolders).
STATE = StateFolders(STATE_ENV, "/run/teraflops/slurm")
state_root, state_dir, state_names, remove_state = STATE.root, STATE.dir, STATE.names, STATE.remove


def saved(name: str) -> tuple[int, "SlurmConfig"] | None:
    """Cluster ``name``'s node count and :class:`SlurmConfig`, as its :class:`Slurm` wrote them into
    :func:`state_dir` (``cluster.json``); ``None`` when it has no Slurm files (or unreadable ones)."""
    try:
        data = json.loads((state_dir(name) / "cluster.json").read_text())
        config = dict(data["config"])
        config["accounts"] = tuple(config["accounts"])
        return int(data["nodes"]), SlurmConfig(**config)
    except (OSError, ValueError, KeyError, TypeError, SlurmError):
        return None


def host(i: int) -> str:
    """Node ``i``'s hostname inside the cluster (Slurm's NodeName): ``node<i>``."""
    return f"node{i}"


@dataclass(frozen=True)
class SlurmConfig:
    """How a cluster's Slurm is set up.

    Attributes:
        scheduler: ``"backfill"`` (``sched/backfill``) or ``"fifo"`` (``sched/builtin``).
        accounting: start MariaDB + slurmdbd: ``sacct``, accounts, fair share between them.
        gpus_per_node: fake GPUs (GRES ``gpu``) per node, 1-8.
        cpus_per_node: CPUs each node declares (Slurm allocates them; ``config_overrides`` lets a node
            declare more than the machine has). Default: ``gpus_per_node``, so GPUs bind first.
        interval: seconds between scheduling passes (``sched_interval``, ``bf_interval``), 1-60.
        accounts: with accounting, the accounts (teams) made, each with an equal share.
        priority_period: with accounting, minutes between fair-share recalculations
            (``PriorityCalcPeriod``, at least 1; :meth:`Slurm.recompute_priorities` forces one).
    """

    scheduler: str = "backfill"
    accounting: bool = False
    gpus_per_node: int = 2
    cpus_per_node: int | None = None
    interval: int = 1
    accounts: tuple[str, ...] = ("teama", "teamb")
    priority_period: int = 1

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise SlurmError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {self.scheduler!r}. "
                             "Hint: SlurmConfig(scheduler='fifo') or --scheduler backfill.")
        for name, lo, hi in (("gpus_per_node", 1, 8), ("interval", 1, 60), ("priority_period", 1, 60)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise SlurmError(f"{name} must be an int in [{lo}, {hi}], got {value!r}.")
        cpus = self.cpus_per_node
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or not 1 <= cpus <= 256):
            raise SlurmError(f"cpus_per_node must be an int in [1, 256] or None, got {cpus!r}.")
        if not self.accounts or not all(isinstance(a, str) and a.isalnum() and a.islower() for a in self.accounts):
            raise SlurmError(f"accounts must be lower-case alphanumeric names, got {self.accounts!r}.")

    @property
    def cpus(self) -> int:
        return self.cpus_per_node or self.gpus_per_node

    def describe(self) -> str:
        """``"backfill (sched/backfill), 2 CPUs and 2 fake GPUs per node, no accounting"``."""
        accounting = f"accounting (slurmdbd) for {', '.join(self.accounts)}" if self.accounting else "no accounting"
        return (f"{self.scheduler} ({SCHEDULERS[self.scheduler]}), {self.cpus} CPUs and {self.gpus_per_node} "
                f"fake GPUs per node, {accounting}")


def slurm_conf(cluster, config: SlurmConfig, directory: Path) -> str:
    """The text of ``slurm.conf`` for ``cluster`` (its ``name``, ``nodes``, ``address(i)``).

    One partition ``main`` of every node; ``node<i>`` at the node's address with ``config.cpus``
    CPUs and ``gpu:<gpus_per_node>``; controller on node 0. See slurm.conf(5).
    """
    d = directory
    lines = [
        f"ClusterName=tf{cluster.name.lower()}",
        f"SlurmctldHost={host(0)}({cluster.address(0)})",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={d}/munge.socket",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        f"SchedulerType={SCHEDULERS[config.scheduler]}",
        f"SchedulerParameters=bf_interval={config.interval},sched_interval={config.interval},bf_resolution=1,"
        "bf_continue,default_queue_depth=1000",
        "GresTypes=gpu", "ReturnToService=2", "MinJobAge=3600", "SlurmdParameters=config_overrides",
        "MpiDefault=none", "KillWait=2", "InactiveLimit=0", "SlurmctldTimeout=30", "SlurmdTimeout=30",
        "MessageTimeout=20", "SlurmctldDebug=info", "SlurmdDebug=info",
    ]
    if config.accounting:
        lines += ["AccountingStorageType=accounting_storage/slurmdbd", f"AccountingStorageHost={cluster.address(0)}",
                  f"AccountingStoragePass={d}/munge.socket",  # the munge socket of dbd connections
                  # `limits` also makes slurmctld charge a finished job's usage to its association at
                  # its end (acct_policy.c calls priority_g_job_end only then); without it a job that
                  # starts and ends between two PriorityCalcPeriod passes is never charged: RawUsage 0.
                  "AccountingStorageEnforce=associations,limits", "PriorityType=priority/multifactor",
                  "PriorityWeightFairshare=100000", "PriorityWeightAge=0", "PriorityWeightJobSize=0",
                  "PriorityWeightPartition=0", "PriorityWeightQOS=0", "PriorityDecayHalfLife=7-0",
                  f"PriorityCalcPeriod={config.priority_period}",
                  "JobCompType=jobcomp/none"]
    else:
        lines += ["AccountingStorageType=accounting_storage/none", "PriorityType=priority/basic"]
    for i in range(cluster.nodes):
        lines.append(f"NodeName={host(i)} NodeAddr={cluster.address(i)} CPUs={config.cpus} "
                     f"Gres=gpu:{config.gpus_per_node} RealMemory=1000 State=UNKNOWN")
    lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
    return "\n".join(lines) + "\n"


class Slurm:
    """The Slurm daemons of one up :class:`~teraflops.nodes.cluster.Cluster` (made by ``Cluster(slurm=...)``).

    Attributes:
        cluster: the cluster (``name``, ``nodes``, ``node_name(i)``, ``address(i)``).
        config: its :class:`SlurmConfig`.
        dir: :func:`state_dir` of the cluster.
    """

    def __init__(self, cluster, config: SlurmConfig):
        self.cluster, self.config, self.dir = cluster, config, state_dir(cluster.name)
        self.procs: dict[str, subprocess.Popen] = {}

    # ---- files --------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        """``slurm.conf``: what ``SLURM_CONF`` points at."""
        return self.dir / "slurm.conf"

    def env(self) -> dict:
        """The environment for Slurm commands on this cluster: ``os.environ`` plus ``SLURM_CONF``."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write(self) -> None:
        d = self.dir
        shutil.rmtree(d, ignore_errors=True)
        for sub in ("state", "spool", "dev", "jobs", "log", "dbtmp"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        for g in range(self.config.gpus_per_node):  # a fake GPU: a character device like /dev/null (1, 3)
            os.mknod(d / "dev" / f"gpu{g}", 0o666 | 0o020000, os.makedev(1, 3))
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.cluster.address(i)} {host(i)}\n" for i in range(self.cluster.nodes)))
        self.conf.write_text(slurm_conf(self.cluster, self.config, d))
        self._save()
        last = self.config.gpus_per_node - 1
        (d / "gres.conf").write_text(f"Name=gpu File={d}/dev/gpu[0-{last}]\n" if last else
                                     f"Name=gpu File={d}/dev/gpu0\n")
        if self.config.accounting:
            dbd = d / "slurmdbd.conf"
            dbd.write_text("\n".join([
                "AuthType=auth/munge", f"AuthInfo=socket={d}/munge.socket", f"DbdHost={host(0)}",
                f"DbdAddr={self.cluster.address(0)}", "SlurmUser=root", f"PidFile={d}/slurmdbd.pid",
                f"LogFile={d}/slurmdbd.log", "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1",
                "StoragePort=3306", "StorageUser=root", "StorageLoc=slurm_acct_db"]) + "\n")
            os.chmod(dbd, 0o600)

    def _save(self) -> None:
        """``cluster.json``: the node count and config, for :func:`teraflops.nodes.cluster.attach` from another process."""
        (self.dir / "cluster.json").write_text(json.dumps({"name": self.cluster.name, "nodes": self.cluster.nodes,
                                                           "config": asdict(self.config)}))

    # ---- daemons ------------------------------------------------------------------------------------
    def _in_node(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` in node ``i``: its network namespace, a UTS namespace named ``node<i>`` and a mount
        namespace whose ``/etc/hosts`` is the cluster's."""
        wrapper = f'hostname {host(i)} && mount --bind {shlex.quote(str(self.dir / "hosts"))} /etc/hosts && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.cluster.node_name(i)}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", wrapper, "sh", *cmd]

    def _start(self, key: str, i: int, cmd: list[str]) -> subprocess.Popen:
        log = open(self.dir / "log" / f"{key}.out", "ab")
        try:
            proc = subprocess.Popen(self._in_node(i, cmd), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True)
        finally:
            log.close()
        self.procs[key] = proc
        return proc

    def start(self, timeout: float = 60) -> "Slurm":
        """Write the files and start the daemons; return once every node is ``idle`` in ``sinfo``.

        Raises:
            SlurmError: a program is missing (:func:`unavailable`), a daemon exited, or the nodes did
                not come up within ``timeout`` s (the message quotes the controller's log).
        """
        reason = unavailable(self.config.accounting)
        if reason:
            raise SlurmError(reason + ".")
        self._write()
        d = self.dir
        self._start("munged", 0, ["/usr/sbin/munged", "-F", "-f", f"--key-file={d}/munge.key",
                                  f"--socket={d}/munge.socket", f"--pid-file={d}/munged.pid",
                                  f"--seed-file={d}/munged.seed", f"--log-file={d}/log/munged.log"])
        self._wait_for(lambda: (d / "munge.socket").exists(), 10, "munged did not create its socket")
        if self.config.accounting:
            self._start_accounting(timeout)
        self._start("slurmctld", 0, ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)])
        for i in range(self.cluster.nodes):
            self._start(f"slurmd-{i}", i, ["/usr/sbin/slurmd", "-D", "-N", host(i), "-f", str(self.conf)])
        self.wait_idle(timeout)
        if self.config.accounting:
            self._add_accounts()
        return self

    def _start_accounting(self, timeout: float) -> None:
        d = self.dir
        # a temporary folder of its own: bootstraps sharing /tmp at once failed (4 of 12 here, 3 at a time)
        done = subprocess.run(["mariadb-install-db", "--user=root", f"--datadir={d}/db", "--skip-test-db",
                               "--auth-root-authentication-method=normal", "--skip-name-resolve", f"--tmpdir={d}/dbtmp"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            lines = (done.stderr + done.stdout).strip().splitlines()
            why = next((x for x in reversed(lines) if "ERROR" in x or "failed" in x.lower()), lines[-1] if lines else "")
            raise SlurmError(f"mariadb-install-db failed: {why.strip()[-300:]}. Logs: {d}")
        self._start("mariadbd", 0, ["/usr/sbin/mariadbd", "--no-defaults", "--user=root", f"--datadir={d}/db",
                                    f"--socket={d}/mysql.sock", "--bind-address=127.0.0.1", "--port=3306", f"--tmpdir={d}/dbtmp",
                                    "--skip-name-resolve", f"--pid-file={d}/mariadbd.pid",
                                    "--innodb-buffer-pool-size=256M", "--innodb-log-file-size=64M",
                                    "--innodb-lock-wait-timeout=900"])
        self._wait_for(lambda: (d / "mysql.sock").exists(), 30, "mariadbd did not start")
        self._start("slurmdbd", 0, ["/usr/sbin/slurmdbd", "-D"])
        self._wait_for(lambda: self.exec(["sacctmgr", "-n", "show", "cluster"]).returncode == 0, 30,
                       "slurmdbd did not answer")
        self.exec(["sacctmgr", "-i", "add", "cluster", f"tf{self.cluster.name.lower()}"])

    def _add_accounts(self) -> None:
        for account in self.config.accounts:
            self.exec(["sacctmgr", "-i", "add", "account", account, "fairshare=1"], check=True)
        self.exec(["sacctmgr", "-i", "add", "user", "root", f"account={','.join(self.config.accounts)}"],
                  check=True)

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:g} s"
                raise SlurmError(f"{what} ({why}). {self.log_tail()}")
            time.sleep(0.1)

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until ``sinfo`` shows every node ``idle``."""
        def idle():
            out = self.exec(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
            return sum(1 for state in out[1::2] if state == "idle") == self.cluster.nodes
        self._wait_for(idle, timeout, f"the {self.cluster.nodes} nodes did not become idle")

    def log_tail(self, lines: int = 3) -> str:
        """The last errors of the daemons' logs, one line (for an error message)."""
        found = []
        for path in sorted(self.dir.glob("*.log")) + sorted((self.dir / "log").glob("*")):
            try:
                errors = [x for x in path.read_text(errors="replace").splitlines() if "error" in x.lower()]
            except OSError:
                continue
            found += [f"{path.name}: {x.strip()}" for x in errors[-lines:]]
        return ("Last errors: " + " | ".join(found[-lines:])) if found else f"Logs: {self.dir}"

    def restart_controller(self, scheduler: str | None = None) -> None:
        """Restart ``slurmctld`` (keeping its state and queue), with another scheduler if given.

        Changing ``SchedulerType`` needs a restart (slurm.conf(5)); a restart also runs the fair-share
        calculation at once (``priority/multifactor``'s decay thread runs at start-up, then every
        ``PriorityCalcPeriod``).
        """
        if scheduler is not None:
            self.config = replace(self.config, scheduler=scheduler)
            self.conf.write_text(slurm_conf(self.cluster, self.config, self.dir))
            self._save()
        old = self.procs.get("slurmctld")
        if old is not None and old.poll() is None:
            old.terminate()
            try:
                old.wait(15)
            except subprocess.TimeoutExpired:
                old.kill()
                old.wait(5)
        self._start("slurmctld", 0, ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)])
        self._wait_for(lambda: self.exec(["scontrol", "ping"]).stdout.count("UP") >= 1, 30,
                       "slurmctld did not come back")
        self.exec(["scontrol", "reconfigure"])  # slurmd's re-read slurm.conf too

    def recompute_priorities(self) -> None:
        """Run the fair-share calculation now (a controller restart), not after ``PriorityCalcPeriod``."""
        self.restart_controller()

    def stop(self) -> None:
        """Stop the daemons (SIGTERM, in parallel; SIGKILL after 5 s) and reap them. The cluster's
        ``down`` removes whatever is left in the namespaces and the files."""
        stop_groups(self.procs.values())
        self.procs.clear()

    # ---- using it -----------------------------------------------------------------------------------
    def login(self, i: int = 0, cwd: str | os.PathLike | None = None) -> list[str]:
        """The argument list that runs a command on node ``i`` as a user logged in there: its network,
        UTS and mount namespaces (those of its ``slurmd``) and the cluster's Slurm configuration, in
        directory ``cwd`` (default ``/``: entering a mount namespace leaves the caller's directory;
        ``sbatch`` writes ``slurm-<job>.out`` where it runs)."""
        proc = self.procs.get(f"slurmd-{i}")
        pid = proc.pid if proc is not None and proc.poll() is None else _daemon_pid(self.dir, f"slurmd-{host(i)}")
        wd = [f"--wd={os.fspath(cwd)}"] if cwd is not None else []
        if pid is None:  # before slurmd runs (accounting setup): node 0's network namespace only
            return ["nsenter", f"--net=/run/netns/{self.cluster.node_name(i)}", *wd, "env", f"SLURM_CONF={self.conf}"]
        return ["nsenter", "-t", str(pid), "-n", "-u", "-m", *wd, "env", f"SLURM_CONF={self.conf}"]

    def exec(self, cmd: list[str], node: int = 0, timeout: float = 60, check: bool = False,
             cwd: str | os.PathLike | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` on node ``node`` (default the login node, 0) in directory ``cwd`` (default ``/``)
        and wait; output captured as text.

        Raises:
            SlurmError: with ``check``, a non-zero exit (the message quotes its stderr).
        """
        done = subprocess.run(self.login(node, cwd) + list(cmd), capture_output=True, text=True, timeout=timeout,
                              **kwargs)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(cmd)}` on {host(node)} failed: "
                             f"{(done.stderr or done.stdout).strip()[-300:]}")
        return done

    def daemons(self) -> list[dict]:
        """The Slurm daemons running on this cluster's nodes now: ``name``, ``pid``, ``node``."""
        return daemons([self.cluster.node_name(i) for i in range(self.cluster.nodes)])


def _daemon_pid(directory: Path, stem: str) -> int | None:
    try:
        pid = int((directory / f"{stem}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def kill_at_once(pids) -> set[int]:
    """Of ``pids``, the Slurm processes a teardown sends SIGKILL at once instead of SIGTERM: job-step
    managers (``slurmstepd``), which ignore SIGTERM, and ``slurmctld``, which on SIGTERM saves its
    state (measured here: 1.9 s to exit with accounting) into files the teardown deletes anyway.
    :func:`teraflops.nodes.cluster.down` uses it; otherwise it waits its whole grace period for them."""
    import psutil

    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).name() in ("slurmstepd", "slurmctld"):
                out.add(pid)
        except psutil.Error:
            pass
    return out


def daemons(namespaces: list[str]) -> list[dict]:
    """The Slurm daemons (:data:`DAEMONS`) running in network namespaces ``namespaces`` now:
    dicts of ``name``, ``pid``, ``namespace``."""
    import psutil

    out = []
    for ns in namespaces:
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in (int(p) for p in done.stdout.split()) if done.returncode == 0 else ():
            try:
                name = psutil.Process(pid).name()
            except psutil.Error:
                continue
            if name in DAEMONS:
                out.append({"name": name, "pid": pid, "namespace": ns})
    return out
