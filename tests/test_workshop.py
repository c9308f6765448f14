"""A workshop on one machine: clusters belong to their owners, a killed notebook takes its
run with it, a host's warm cache, builds that say why they failed."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from traversal import course_paths, traversable

from teraflops.nodes import cluster as cl
from teraflops import ownership

REASON = cl.unavailable() if sys.platform == "linux" else "needs Linux"
NEEDS_NODES = pytest.mark.skipif(REASON is not None, reason=f"emulated nodes unavailable: {REASON}")
TRIALS = int(os.environ.get("TERAFLOPS_UP_TRIALS", "2"))  # 20 by hand: TERAFLOPS_UP_TRIALS=20


def _shell(*args: str) -> subprocess.Popen:
    """A learner's terminal: a shell leading a login session of its own that runs `teraflops cluster ARGS`,
    prints its exit code and stays (the session, so the shell, owns the cluster)."""
    line = shlex.join([sys.executable, "-m", "teraflops", "cluster", *args])  # a Python in a path with a space
    return subprocess.Popen(["sh", "-c", f"{line}; echo rc=$?; exec sleep 120"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _until_done(shell: subprocess.Popen) -> str:
    out = []
    for line in shell.stdout:
        out.append(line)
        if line.startswith("rc="):
            return "".join(out)
    return "".join(out)


def _ping(name: str) -> bool:
    """A TCP connection from node 0 to node 1 of cluster ``name`` (the machine has no ping)."""
    ns = f"{cl.PREFIX}{name}-node"
    server = subprocess.Popen(["ip", "netns", "exec", ns + "1", sys.executable, "-c",
                               "import socket; s = socket.create_server(('10.213.0.2', 5599)); print('up', flush=True); "
                               "s.settimeout(10); c, _ = s.accept(); c.sendall(b'ok')"], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "up":
            return False
        client = subprocess.run(["ip", "netns", "exec", ns + "0", sys.executable, "-c",
                                 "import socket; print(socket.create_connection(('10.213.0.2', 5599), 5).recv(2))"],
                                capture_output=True, text=True, timeout=20)
        return "ok" in client.stdout
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_a_claim_is_atomic_and_a_dead_owners_claim_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv(ownership.CLUSTER_DIR_ENV, str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert ownership.claim("x", 2, pid=os.getppid())[0]
    ok, held = ownership.claim("x", 2)
    assert not ok and held["pid"] == os.getppid()  # a live owner's name is refused, its record kept
    assert ownership.read("x")["pid"] == os.getppid()
    (tmp_path / "y.json").write_text('{"pid": %d, "start": 1.0, "user": "gone"}' % dead.pid)
    assert ownership.claim("y", 2)[0] and ownership.read("y")["pid"] == os.getpid()


@NEEDS_NODES
@pytest.mark.slow
@pytest.mark.parametrize("same_name", [False, True])
def test_concurrent_ups_both_work_or_one_refuses_and_down_spares_live_owners(same_name):
    for trial in range(TRIALS):
        name = f"w20t{trial}"
        shells = [_shell("up", *(["--name", name] if same_name else [])) for _ in range(2)]
        try:
            outs = [_until_done(s) for s in shells]
            ok = [o for o in outs if "rc=0" in o]
            names = [o.split("cluster '", 1)[1].split("'", 1)[0] for o in ok]
            if same_name:  # one cluster, one clean refusal that names the owner
                assert len(ok) == 1 and any("belongs to" in o and "rc=2" in o for o in outs), outs
            else:  # each shell its own cluster
                assert len(ok) == 2 and len(set(names)) == 2, outs
            assert all(_ping(n) for n in names), f"trial {trial}: a cluster that said it was up is not usable"
            third = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down"], capture_output=True,
                                   text=True)
            assert third.returncode == 0 and all(_ping(n) for n in names), third.stdout + third.stderr
            status = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "status"], capture_output=True,
                                    text=True).stdout
            assert all(n in status for n in names) and "owner: root (pid" in status, status
            gone = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down", "--all"],
                                  capture_output=True, text=True)
            assert gone.returncode == 0 and not any(n in {cl.cluster_of(ns) for ns in cl.namespaces()} for n in names)
        finally:
            for s in shells:
                s.kill()
                s.wait()
            cl.down(only=[ns for ns in cl.namespaces() if (cl.cluster_of(ns) or "").startswith(("w20t", "cli"))
                          and not ownership.alive(ownership.read(cl.cluster_of(ns)))])


# ---- the owner is the caller's login session ---------------------------------------------------------


def _processes(monkeypatch, table: dict[int, tuple[int, int, str]]) -> None:
    """Make ownership see the processes of ``table`` (pid: session id, parent, name) and no others."""
    def getsid(pid):
        if pid not in table:
            raise ProcessLookupError(pid)
        return table[pid][0]

    monkeypatch.setattr(ownership.os, "getsid", getsid)
    monkeypatch.setattr(ownership, "parent", lambda pid: table[pid][1] or None if pid in table else None)
    monkeypatch.setattr(ownership, "_name", lambda pid: table[pid][2] if pid in table else None)


LOGIN = {1: (0, 0, "init"), 50: (50, 1, "sshd"), 100: (100, 50, "bash")}  # sshd's login shell, pid 100


@pytest.mark.parametrize("chain, cli, owner", [
    ({150: (100, 100, "timeout"), 200: (100, 150, "python")}, 200, 100),  # timeout 60 teraflops ...: the shell
    ({150: (100, 100, "make"), 160: (100, 150, "sh"), 200: (100, 160, "python")}, 200, 100),  # a make recipe
    # sudo with use_pty: the command's session is led by sudo's monitor (a child of sudo, in the shell's session)
    ({300: (100, 100, "sudo"), 301: (301, 300, "sudo"), 302: (301, 301, "python")}, 302, 100),
    ({400: (100, 100, "su"), 401: (401, 400, "sh"), 402: (401, 401, "python")}, 402, 100),  # su -c in a new session
    ({500: (500, 100, "python")}, 500, 100),  # setsid teraflops ...: the session it was started from
    ({600: (0, 601, "python"), 601: (0, 1, "python")}, 600, 601),  # no login session at all: its parent
    ({700: (700, 1, "python")}, 700, 700),  # its own session, started by init: nobody else to own it
])
def test_a_commands_owner_is_its_login_sessions_leader_through_timeout_make_sudo_su_and_setsid(
        monkeypatch, chain, cli, owner):
    _processes(monkeypatch, {**LOGIN, **chain})
    assert ownership.session_owner(cli) == owner


def test_the_owner_of_this_process_is_its_sessions_leader_or_the_session_it_came_from():
    """The rule of session_owner() on this very process, whatever runs the tests: a login session's leader;
    the session of the parent when pytest leads its own; the parent when there is no login session (session
    0 or 1: a CI container whose session leader lies outside its pid namespace)."""
    leader = ownership.login_session()
    if leader is None:
        want = os.getppid() if os.getppid() > 1 else os.getpid()
    elif leader == os.getpid():
        want = ownership.session_owner(os.getppid())
    else:
        want = leader
    assert ownership.session_owner() == want and ownership.start_time(want) is not None


def test_a_reused_pid_is_another_owner():
    assert ownership.same_owner({"pid": 7, "start": 100.0}, {"pid": 7, "start": 100.4})
    assert not ownership.same_owner({"pid": 7, "start": 100.0}, {"pid": 7, "start": 160.0})
    assert not ownership.same_owner({"pid": 7, "start": 100.0}, {"pid": 8, "start": 100.0})
    assert not ownership.same_owner(None, {"pid": 7})


def test_down_takes_the_callers_own_leftovers_a_named_one_of_its_user_and_with_all_everyones():
    from teraflops.nodes import ownership_policy as policy

    me = {"pid": 100, "start": 5.0, "uid": 1000, "user": "alice"}
    records = {"mine": {**me, "name": "mine"},
               "shell2": {"pid": 200, "start": 6.0, "uid": 1000, "user": "alice"},  # her other terminal
               "bobs": {"pid": 300, "start": 7.0, "uid": 1001, "user": "bob"},
               "dead": {"pid": 400, "start": 8.0, "uid": 1001, "user": "bob"}, "norecord": None}
    groups = {n: [f"teraflops-{n}-switch"] for n in [*records, ""]}
    live = lambda r: bool(r) and r["pid"] != 400  # noqa: E731

    def verdicts(**kw):
        return {d.name: (d.take, d.why) for d in policy.decide(groups, records, me, alive=live, **kw)}

    assert verdicts() == {"": (True, "leftover"), "dead": (True, "leftover"), "norecord": (True, "leftover"),
                          "mine": (True, "yours"), "shell2": (False, "others"), "bobs": (False, "others")}
    assert verdicts(name="shell2")["shell2"] == (True, "named")  # a cluster of hers, by name
    assert verdicts(name="bobs")["bobs"] == (False, "others")  # never another user's by name
    assert {n: v for n, v in verdicts(all=True).items() if v[1] == "all"} == {"shell2": (True, "all"),
                                                                             "bobs": (True, "all")}


def test_an_owner_that_is_not_a_process_is_one_line(capsys):
    from teraflops.course.cli import main

    dead = 2 ** 22 + 7  # above pid_max's default on 64-bit Linux (4194304)
    assert main(["cluster", "down", "--owner", str(dead)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--owner {dead}: no such process" in err and "--owner $$" in err


def _login(script: str) -> subprocess.Popen:
    """A terminal: ``sh -c script`` leading a session of its own, stdin and stdout piped."""
    return subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _upto(shell: subprocess.Popen, mark: str) -> str:
    out = []
    for line in shell.stdout:
        out.append(line)
        if line.startswith(mark):
            break
    return "".join(out)


def _teraflops(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teraflops", "cluster", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


@NEEDS_NODES
@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["timeout 60", "sh -c", "make", "setsid"])
def test_the_owner_lives_as_long_as_the_shell_and_a_subshell_of_its_session_takes_it_down(tmp_path, wrapper):
    """`timeout 60 teraflops cluster up` (and make, a script, setsid) in a terminal: the cluster belongs to
    the terminal's shell, alive after the command; another session's `down` leaves it running, a subshell
    of the same session takes it down."""
    name = f"own{os.getpid()}{['timeout 60', 'sh -c', 'make', 'setsid'].index(wrapper)}"
    up = f"{sys.executable} -m teraflops cluster up --nodes 1 --name {name}"
    if wrapper == "make":
        (tmp_path / "Makefile").write_text(f"up:\n\t{up}\n")
        command = f"make -s -C {tmp_path} up"
    else:
        command = {"timeout 60": f"timeout 60 {up}", "sh -c": f"sh -c '{up}'", "setsid": f"setsid {up}"}[wrapper]
    shell = _login(f"{command}; echo rc=$?; read go; ({sys.executable} -m teraflops cluster down); echo rc=$?; "
                   "exec sleep 60")
    try:
        out = _upto(shell, "rc=")
        assert "rc=0" in out, out
        held = ownership.read(name)
        assert held["pid"] == shell.pid and ownership.alive(held), (held, shell.pid)  # the shell, not the wrapper
        other = _teraflops("down")  # another terminal (this test's session)
        assert other.returncode == 0 and f"{name} of root (pid {shell.pid})" in other.stdout, other.stdout
        assert f"owner: root (pid {shell.pid})" in _teraflops("status").stdout
        shell.stdin.write("go\n")
        shell.stdin.flush()
        down = _upto(shell, "rc=")
        assert "rc=0" in down and f"teraflops-{name}-node0" in down, down
        assert ownership.read(name) is None and not [ns for ns in cl.namespaces() if cl.cluster_of(ns) == name]
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
        cl.down(only=[ns for ns in cl.namespaces() if cl.cluster_of(ns) == name])
        ownership.release(name)


@NEEDS_NODES
@pytest.mark.slow
def test_another_users_down_and_status_see_a_live_cluster_of_someone_else():
    """User nobody (uid 65534), in a session of its own, names root's live cluster: `down --name` leaves it
    running (never another user's by name), `status` shows its owner."""
    name = f"usr{os.getpid()}"
    shell = _shell("up", "--nodes", "1", "--name", name)
    home = Path(tempfile.mkdtemp(prefix="teraflops-nobody-"))  # under /tmp: pytest's tmp_path is root's alone
    os.chown(home, 65534, 65534)
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    try:
        assert "rc=0" in _until_done(shell)
        argv = ["sh", "-c", f"{sys.executable} -m teraflops cluster down --name {name}; "  # in a session of theirs
                f"{sys.executable} -m teraflops cluster status"]
        with traversable(course_paths()):  # user nobody runs this Python and imports this clone
            theirs = subprocess.run(_as_user("65534", argv), capture_output=True, text=True, env=env, timeout=120,
                                    start_new_session=True, cwd="/")
        assert f"left running (other owners'; --all removes them): {name} of root (pid {shell.pid})" in theirs.stdout, \
            theirs.stdout + theirs.stderr
        assert f"owner: root (pid {shell.pid})" in theirs.stdout
        assert len([ns for ns in cl.namespaces() if cl.cluster_of(ns) == name]) == 2  # untouched
    finally:
        shell.kill()
        shell.wait()
        cl.down(only=[ns for ns in cl.namespaces() if cl.cluster_of(ns) == name])
        ownership.release(name)
        shutil.rmtree(home, ignore_errors=True)


@NEEDS_NODES
@pytest.mark.slow
def test_a_cluster_exec_job_whose_cluster_is_taken_down_says_by_whom():
    name = f"exe{os.getpid()}"
    shell = _shell("up", "--nodes", "2", "--name", name)
    try:
        assert "rc=0" in _until_done(shell)
        job = subprocess.Popen([sys.executable, "-m", "teraflops", "cluster", "exec", "--name", name, "--node", "1",
                                "--", "sh", "-c", "echo started; exec sleep 60"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        assert job.stdout.readline().strip() == "started"
        host = _teraflops("down", "--all")  # the host, in another session
        assert host.returncode == 0 and f"teraflops-{name}-node1" in host.stdout, host.stdout + host.stderr
        _, err = job.communicate(timeout=30)
        lines = err.strip().splitlines()
        assert job.returncode == 128 + signal.SIGTERM and len(lines) == 1, err
        assert re.fullmatch(rf"error: cluster '{name}' was taken down by root \(pid \d+\) with "
                            r"`teraflops cluster down --all` while the job ran\.", lines[0]), lines
    finally:
        shell.kill()
        shell.wait()
        cl.down(only=[ns for ns in cl.namespaces() if cl.cluster_of(ns) == name])
        ownership.release(name)
        ownership.clear_taken_down(name)


def _owned_by(folder: str, pid: int) -> bool:
    """True if launch folder ``folder``'s owner record names process ``pid`` (other launches on a shared
    machine, other learners' or other tests', are not this test's)."""
    import json

    try:
        return json.loads(Path(folder, "owner.json").read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def _members(results: str) -> list:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TERAFLOPS_RESULTS_DIR") == results:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_killed_notebook_takes_its_run_with_it(tmp_path, launcher):
    """SIGKILL of the notebook-side process: within 10 s no launcher or rank runs, its files are gone."""
    import glob
    import json

    from teraflops.launch import leftovers, ops  # not `launcher`: the parameter of that name says which one

    if launcher == "deepspeed":
        ops.prepare_deepspeed_ops(cpu=True)
    script = tmp_path / "notebook.py"
    script.write_text(
        "from teraflops.launch.selftest import SelftestSpec, run\n"
        f"run(2, SelftestSpec(timeout_s=600, deepspeed={launcher == 'deepspeed'}), launcher={launcher!r}, timeout=600,"
        " env={'TERAFLOPS_FAULT': 'hang:rank=1:step=1'})\n")
    before = set(glob.glob("/tmp/teraflops-launch-*"))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # another learner's run's owner
    other = f"/dev/shm/{leftovers.SHM_PREFIX}_{os.getuid()}_127.0.0.1_1_0"
    with open(other, "wb"):
        pass  # a buffer no launch of a dead owner made: it is left alone while mapped... or owned
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # CPU ranks (launch(env=) may not hide GPUs)
    try:
        deadline = time.monotonic() + 240
        while True:
            folders = {f for f in set(glob.glob("/tmp/teraflops-launch-*")) - before if _owned_by(f, victim.pid)}
            members = [p for f in folders for p in _members(f)]
            ranks = [p for p in members if "selftest" in " ".join(p.cmdline()) and "rank_wrapper.py" not in " ".join(p.cmdline())]
            ports = [json.loads(Path(f, "owner.json").read_text())["port"] for f in folders]
            shm = [s for port in ports for s in leftovers.shm_files(port)] if launcher == "deepspeed" else ["-"]
            if len(ranks) >= 2 and shm:
                break
            assert time.monotonic() < deadline and victim.poll() is None, "the run did not start"
            time.sleep(0.5)
        time.sleep(2)
        (folder,) = folders
        port = json.loads(Path(folder, "owner.json").read_text())["port"]
        os.kill(victim.pid, signal.SIGKILL)  # as a kernel killed by a restart: its finally never runs
        victim.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 60 and (_members(folder) or os.path.exists(folder)):  # a hang guard
            time.sleep(0.2)
        assert _members(folder) == [], f"still running 60 s after the kill: {[p.cmdline() for p in _members(folder)]}"
        assert not os.path.exists(folder)
        assert leftovers.shm_files(port) == []
        assert glob.glob(f"{folder}/torchelastic*") == []
    finally:
        victim.kill()
        live.kill()
        live.wait()
        if os.path.exists(other):
            os.unlink(other)


@pytest.mark.slow
def test_the_sweep_removes_a_dead_owners_leftovers_and_never_a_live_ones(tmp_path, monkeypatch):
    import json
    import tempfile

    from teraflops.launch import leftovers

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(leftovers, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    uid = os.getuid()
    for tag, pid, port in (("dead", dead.pid, 41001), ("live", os.getpid(), 41002)):
        folder = tmp_path / f"teraflops-launch-{tag}"
        folder.mkdir()
        record = {**ownership.owner(pid if pid == os.getpid() else None), "pid": pid, "port": port, "addr": "127.0.0.1"}
        if pid != os.getpid():
            record["start"] = 1.0
        (folder / "owner.json").write_text(json.dumps(record))
        (tmp_path / "shm" / f"{leftovers.SHM_PREFIX}_{uid}_127.0.0.1_{port}_0").write_bytes(b"x")
    removed = {p.name for p in leftovers.sweep()}
    assert "teraflops-launch-dead" in removed and f"{leftovers.SHM_PREFIX}_{uid}_127.0.0.1_41001_0" in removed
    assert (tmp_path / "teraflops-launch-live").exists()
    assert (tmp_path / "shm" / f"{leftovers.SHM_PREFIX}_{uid}_127.0.0.1_41002_0").exists()


def test_a_learner_copies_the_warm_op_without_its_lock(tmp_path, monkeypatch):
    from teraflops import caches

    monkeypatch.setenv(caches.WARM_ENV, str(tmp_path / "warm"))
    monkeypatch.setattr(caches, "ninja_version", lambda: "1.13.2")
    ext = tmp_path / "mine" / "torch_extensions" / "py311-abc"
    source = caches.warm_op_dir(ext)
    source.mkdir(parents=True)
    (source / caches.op_stamp()).touch()
    (source / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    (source / "lock").touch()
    os.utime(source / "deepspeed_shm_comm.so", (1e9, 1e9))
    assert caches.seed_op(ext)
    copied = ext / caches.OP
    assert (copied / "deepspeed_shm_comm.so").stat().st_mtime == 1e9  # ninja sees it up to date
    assert not (copied / "lock").exists() and not caches.seed_op(ext)  # once


def test_a_cache_of_another_user_says_why_in_one_line(tmp_path, monkeypatch):
    from teraflops import caches

    (tmp_path / caches.OP).mkdir()
    monkeypatch.setattr(caches.os, "access", lambda path, mode: False)
    why = caches.unwritable_reason(tmp_path)
    assert "lock" in why and "TERAFLOPS_CACHE" in why and "\n" not in why


@pytest.mark.parametrize("code, words, not_words", [
    (-9, "killed by SIGKILL after 10 s", "900"), (None, "not done after 900 s", "killed by"),
])
def test_a_build_killed_elsewhere_says_so_and_no_compiler_hint_when_one_is_there(tmp_path, monkeypatch, code, words,
                                                                                 not_words):
    import shutil

    from teraflops import caches
    from teraflops.launch import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "_build_once", lambda ext, log, timeout: (code, 10.0))
    monkeypatch.setattr(ops, "_builds", lambda ext: [])
    monkeypatch.setattr(caches, "seed_op", lambda ext: False)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    with pytest.raises(ops.OpBuildFailed) as err:
        ops.prepare_deepspeed_ops(cpu=True)
    assert words in str(err.value) and not_words not in str(err.value) and "g++" not in str(err.value)


def test_a_waiter_whose_other_build_died_builds_it_itself(tmp_path, monkeypatch):
    from teraflops import caches
    from teraflops.launch import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def build(ext, log, timeout):
        calls.append(1)
        log.write_text("ImportError: deepspeed_shm_comm.so: cannot open shared object file\n")
        return (1 if len(calls) == 1 else 0), 1.0

    monkeypatch.setattr(ops, "_build_once", build)
    monkeypatch.setattr(ops, "_builds", lambda ext: [4242] if not calls else [])
    monkeypatch.setattr(caches, "seed_op", lambda ext: False)
    ops.prepare_deepspeed_ops(cpu=True)
    assert len(calls) == 2


def test_builds_and_ranks_run_the_environments_ninja_and_the_op_stamp_names_it(monkeypatch):
    import shutil

    import ninja

    from teraflops import caches

    env = caches.with_ninja({"PATH": "/usr/bin:/bin"})
    assert shutil.which("ninja", path=env["PATH"]) == f"{ninja.BIN_DIR}/ninja"  # not Debian's /usr/bin/ninja
    assert env["PATH"].endswith(":/usr/bin:/bin")
    monkeypatch.setattr(caches, "ninja_version", lambda: "1.11.1")
    assert caches.op_stamp().endswith("-ninja1.11.1")  # an op another ninja built is not taken as ours


def test_the_header_folder_is_torchs():
    from torch._inductor import codecache

    from teraflops import caches

    assert str(caches.header_dir()) == codecache._HEADER_DIR


def _fake_warm_cache(root, versions, at=1):
    import json

    warm = root / "warm" / "compile"
    for rel, data in (("inductor/ab/cabc.so", b"\x7fELF"), ("inductor/fxgraph/x/entry", b"graph"),
                      ("inductor/locks/cabc.lock", b""), ("triton/k1/kernel.cubin", b"cubin"),
                      ("precompiled_headers/cp.h", b"#include <x>"), ("precompiled_headers/cp.h.gch", b"pch"),
                      ("precompiled_headers/locks/cp.lock", b"")):
        (warm / rel).parent.mkdir(parents=True, exist_ok=True)
        (warm / rel).write_bytes(data)
    os.utime(warm / "inductor/ab/cabc.so", (1e9, 1e9))
    (warm / "STAMP.json").write_text(json.dumps({"versions": versions, "compiled": [], "at": at}))
    return warm


@pytest.fixture
def learner(tmp_path, monkeypatch):
    import tempfile

    from teraflops import caches

    monkeypatch.setenv(caches.WARM_ENV, str(tmp_path / "warm"))
    monkeypatch.setenv("TERAFLOPS_CACHE", str(tmp_path / "mine"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)  # and what seeding sets is undone after the test
    return tmp_path


def test_a_learners_import_seeds_the_compile_caches_once_per_warmup(learner):
    from teraflops import caches

    warm = _fake_warm_cache(learner, caches.versions())
    assert caches.seed_compile_caches()
    inductor, triton = learner / "mine" / "inductor", learner / "mine" / "triton"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor) and os.environ["TRITON_CACHE_DIR"] == str(triton)
    assert (inductor / "ab/cabc.so").read_bytes() == b"\x7fELF" and (inductor / "ab/cabc.so").stat().st_mtime == 1e9
    assert (inductor / "fxgraph/x/entry").exists() and (triton / "k1/kernel.cubin").exists()
    assert not (inductor / "locks").exists()  # torch's locks are the learner's own to make
    headers = caches.header_dir()
    assert str(headers).startswith(str(learner / "tmp" / "torchinductor_"))
    assert os.readlink(headers / "cp.h.gch") == str(warm / "precompiled_headers/cp.h.gch")
    assert not (headers / "locks").exists()
    (inductor / "ab/cabc.so").write_bytes(b"mine")
    assert not caches.seed_compile_caches()  # seeded: nothing copied again
    _fake_warm_cache(learner, caches.versions(), at=2)  # the host warmed again
    assert caches.seed_compile_caches()
    assert (inductor / "ab/cabc.so").read_bytes() == b"mine"  # what the learner has is kept


def test_without_a_warm_cache_for_this_environment_nothing_changes(learner):
    from teraflops import caches

    assert not caches.seed_compile_caches()  # no warm cache at all
    _fake_warm_cache(learner, {**caches.versions(), "torch": "0.0"})  # another torch's kernels
    assert not caches.seed_compile_caches()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and not (learner / "mine" / "inductor").exists()


def test_a_compile_cache_it_cannot_write_says_why_in_one_line_and_torch_compiles_as_usual(learner, monkeypatch):
    from teraflops import caches

    _fake_warm_cache(learner, caches.versions())

    def refuse(source, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(caches, "_merge", refuse)
    with pytest.warns(UserWarning) as caught:
        assert not caches.seed_compile_caches()
    (why,) = [str(w.message) for w in caught]
    assert "Permission denied" in why and "TERAFLOPS_CACHE" in why and "\n" not in why
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_unit4_lecture_compiles_as_warmup_does():
    """Inductor's cache keys follow the generated code (threads, sizes): warmup's compile_course mirrors
    the lecture's calls, and a lecture that changes them must change it too."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "notebooks" / "04_compilation.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for call in ('if p.device == "cpu":\n    torch.set_num_threads(1)', "decode.decode_model(p, dtype=torch.float32)",
                 "cache = model.new_cache(1)", "decode.compile_decode(model, cache)",
                 "for dynamic in (False, None, True):\n"
                 "    r = decode.recompile_demo(seq_lens=(8, 9, 10), dynamic=dynamic)"):
        assert call in code, f"the Unit 4 lecture no longer does {call!r}: update teraflops.course.warmup.compile_course"


_LEARNER = r'''
import json, os, time
import teraflops  # seeds the compile caches from the host's
from teraflops import caches, sizing
from teraflops.compilation import decode
from teraflops.launch.placement import data_parallel_plan
from teraflops.parallelization import zero
from teraflops.sizing import PRESETS

t0 = time.perf_counter()
runs = zero.run_zero(stages=(1,), plan=data_parallel_plan(PRESETS["tiny"]), steps=2)  # a first ZeRO run
zero_s = time.perf_counter() - t0
import torch
from torch._dynamo.utils import counters

p = sizing.preset()
if p.device == "cpu":
    torch.set_num_threads(1)  # the Unit 4 lecture, as it runs
model = decode.decode_model(p, dtype=torch.float32)
compile_s = decode.compile_decode(model, model.new_cache(1)).compile_seconds
seen = {}
def add():
    for k, v in counters["inductor"].items():
        seen[k] = seen.get(k, 0) + v
add()
for dynamic in (False, None, True):
    decode.recompile_demo(seq_lens=(8, 9, 10), dynamic=dynamic)  # clears the counters first
    add()
print(json.dumps({"stages": [r.stage for r in runs], "inductor": seen, "zero_s": zero_s, "compile_s": compile_s,
                  "headers": str(caches.header_dir()),
                  "dirs": [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")]}))
'''


def _probe(call: str) -> bool:
    """A compiler call that builds nothing kept: a version probe; torch's preprocessing of its kernel
    header (``g++ -E``, hashed on every run: ``_precompile_header`` in torch/_inductor/codecache.py);
    DeepSpeed's libaio probe (a one-line ``test.c`` compiled and linked in a temporary folder on every
    run: ``has_function`` in deepspeed/ops/op_builder/builder.py)."""
    import re

    return (all(arg in ("--version", "-v") or arg.startswith("-dump") for arg in call.split())
            or " -E " in f" {call} "
            or re.search(r"/tmp\w+/(test\.c|test\.o) ", f"{call} ") is not None)


def _as_user(user: str, argv: list) -> list:
    """``argv`` run as ``user``, no supplementary groups."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="needs root on Linux (a second Unix user)")
def test_after_roots_warmup_a_second_users_first_runs_compile_nothing():
    """A workshop host's first run: root runs `teraflops warmup`; a new non-root user's first ZeRO run
    and first torch.compile of the Unit 4 lecture then start no compiler (a logging g++/c++ first on
    both PATHs), leave the op's ninja log untouched, hit Inductor's cache for every graph and add no
    kernel to the caches seeded from the host's."""
    import json
    import pwd
    import shutil
    import stat
    import tempfile
    from contextlib import suppress
    from pathlib import Path

    import psutil

    from teraflops import caches

    base = Path(tempfile.mkdtemp(prefix="teraflops-warm-test-"))
    base.chmod(0o755)
    warm, home, tools = base / "warm", base / "home", base / "bin"
    user = f"tfwarm{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/usr/sbin/nologin", user],
                   check=True, capture_output=True)
    learner = None
    try:
        tools.mkdir()
        for cc in ("g++", "c++", "gcc", "cc"):  # host and learner alike: `g++ -v` (in Inductor's keys) reads the same
            (tools / cc).write_text(f'#!/bin/sh\necho "$*" >> "${{COMPILERS_LOG:-/dev/null}}"\n'
                                    f'exec /usr/bin/{cc} "$@"\n')
            (tools / cc).chmod(0o755)
        # the host's shell has the environment's bin/ first (an activated venv: the wheel's ninja 1.13), the
        # learner's kernel not (Debian's ninja 1.11 first): the op's builds and ranks must not care
        host = subprocess.run([sys.executable, "-m", "teraflops", "warmup", "--dest", str(warm)], capture_output=True,
                              text=True, timeout=900, stdin=subprocess.DEVNULL,
                              env={**os.environ, "PATH": f"{tools}:{Path(sys.executable).parent}:{os.environ['PATH']}"})
        assert host.returncode == 0, host.stdout[-2000:] + host.stderr[-2000:]
        uid = pwd.getpwnam(user).pw_uid
        for folder in (home, home / "tmp"):
            folder.mkdir()
            os.chown(folder, uid, uid)
        (base / "learner.py").write_text(_LEARNER)
        env = {"HOME": str(home), "USER": user, "LOGNAME": user, "TMPDIR": str(home / "tmp"),
               "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin", "COMPILERS_LOG": str(home / "compilers.log"),
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               caches.WARM_ENV: str(warm),
               # as the host's: torch reads CI into a default of its functorch config (error_on_custom_op_aliasing
               # = bool(os.getenv("CI")), torch/_functorch/config.py), and that config is part of AOTAutograd's
               # cache key; under CI=true (a CI machine) a learner without it missed every AOTAutograd entry
               **{k: v for k, v in os.environ.items() if k in ("CUDA_VISIBLE_DEVICES", "CI")}}
        # the learner runs this Python and imports this clone: folders on the way that others cannot enter (a
        # pyenv under /root, a clone in a mode-700 mktemp folder) are opened to them for the run, then closed
        with traversable(course_paths()):
            learner = subprocess.Popen(_as_user(user, [sys.executable, str(base / "learner.py")]), env=env,
                                       cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True, stdin=subprocess.DEVNULL)
            out, err = learner.communicate(timeout=600)
        assert learner.returncode == 0, out[-2000:] + err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["stages"] == [1]
        calls = (home / "compilers.log").read_text().splitlines() if (home / "compilers.log").exists() else []
        built = [c for c in calls if not _probe(c)]
        assert built == [], f"the learner compiled: {built[:3]}"
        ops = list(warm.glob("torch_extensions/*/deepspeed_shm_comm"))
        assert len(ops) == 1, ops
        mine = home / ".cache" / "teraflops" / "torch_extensions" / ops[0].parent.name / "deepspeed_shm_comm"
        assert (mine / ".ninja_log").read_bytes() == (ops[0] / ".ninja_log").read_bytes()  # ninja ran no step
        assert got["inductor"].get("fxgraph_cache_hit", 0) >= 7 and not got["inductor"].get("fxgraph_cache_miss")
        assert not got["inductor"].get("fxgraph_cache_bypass")
        print(f"learner: ZeRO run {got['zero_s']:.1f} s, compile_decode {got['compile_s']:.1f} s, "
              f"Inductor {got['inductor']}")
        inductor = Path(got["dirs"][0])
        assert inductor == home / ".cache" / "teraflops" / "inductor"
        theirs = {p.relative_to(warm / "compile" / "inductor") for p in (warm / "compile" / "inductor").rglob("*")
                  if p.is_file()}
        new = {p.relative_to(inductor) for p in inductor.rglob("*") if p.is_file()} - theirs
        assert {p for p in new if p.parts[0] != "locks"} == {Path(caches.SEEDED)}, sorted(new)[:5]
        headers = Path(got["headers"])
        assert headers.is_relative_to(home / "tmp")
        assert all(p.is_symlink() for p in headers.iterdir() if p.name != "locks")  # no header built
        assert all(stat.S_IMODE(p.lstat().st_mode) & 0o004 for p in warm.rglob("*") if not p.is_symlink())
    finally:
        if learner is not None and learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
            learner.wait()
        with suppress(KeyError, psutil.Error):
            uid = pwd.getpwnam(user).pw_uid
            for proc in psutil.process_iter(["uids"]):  # what the learner's run left: by pid, the user is ours
                if proc.info["uids"] and proc.info["uids"].real == uid:
                    proc.kill()
        subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_a_python_behind_a_folder_others_cannot_enter_is_named():
    import shutil
    import tempfile
    from pathlib import Path

    from teraflops.course import warmup

    base = Path(tempfile.mkdtemp(prefix="teraflops-closed-"))  # not under pytest's tmp_path: that is mode 700
    try:
        base.chmod(0o755)
        env = base / "home" / "me" / "venv" / "bin"
        env.mkdir(parents=True)
        (base / "home").chmod(0o755)
        (base / "home" / "me").chmod(0o700)  # a pyenv under a mode-700 /root, say
        assert warmup.closed_to_others([env / "python"]) == base / "home" / "me"
        (base / "home" / "me").chmod(0o711)  # others may pass through (not list): learners can run it
        assert warmup.closed_to_others([env / "python"]) is None
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_package_others_cannot_read_is_named_in_one_warning_line():
    """A clone in a mode-700 folder (``mktemp -d``, a home) imports for root, not for learners."""
    import shutil
    import tempfile
    from pathlib import Path

    from teraflops.course import warmup

    base = Path(tempfile.mkdtemp(prefix="teraflops-closed-"))  # not under pytest's tmp_path: that is mode 700
    try:
        base.chmod(0o755)
        package = base / "home" / "me" / "clone" / "helpers" / "teraflops"
        (package / "launch").mkdir(parents=True)
        for f in (package / "__init__.py", package / "launch" / "rank.py"):
            f.write_text("")
            f.chmod(0o644)
        for d in (base / "home", base / "home" / "me", base / "home" / "me" / "clone", package.parent, package,
                  package / "launch"):
            d.chmod(0o755)
        assert warmup.package_closed_to_others(package) is None and warmup.access_warnings([base], package) == []
        (base / "home" / "me").chmod(0o700)  # a clone in a home only its owner enters
        assert warmup.package_closed_to_others(package) == base / "home" / "me"
        line, = warmup.access_warnings([base], package)
        assert f"other users cannot enter {base / 'home' / 'me'}, on the way to the course's package" in line
        assert "\n" not in line and "cannot import teraflops" in line
        (base / "home" / "me").chmod(0o711)  # others may pass through: enough on the way
        assert warmup.package_closed_to_others(package) is None
        package.parent.chmod(0o711)  # but Python's import lists the folder it imports from
        assert warmup.package_closed_to_others(package) == package.parent
        assert warmup.access_warnings([base], package)[0].startswith(f"other users cannot read {package.parent},")
        package.parent.chmod(0o755)
        (package / "launch" / "rank.py").chmod(0o600)  # one module only its owner reads
        assert warmup.package_closed_to_others(package) == package / "launch" / "rank.py"
        (package / "launch" / "rank.py").chmod(0o644)
        (package / "__pycache__").mkdir(mode=0o700)  # bytecode others cannot read: Python reads the source
        assert warmup.package_closed_to_others(package) is None
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_warmup_prints_each_access_warning_as_one_line_before_building(monkeypatch, tmp_path, capsys):
    import argparse

    from teraflops.course import cli, warmup

    built = []
    monkeypatch.setattr(warmup, "access_warnings", lambda: ["other users cannot read /x/helpers, on the way to the "
                                                            "course's package: ..."])
    monkeypatch.setattr(warmup, "build_warm_cache", lambda dest: built.append("op") or tmp_path / "op")
    monkeypatch.setattr(warmup, "build_warm_aio", lambda dest: built.append("aio") or "skipped DeepSpeed's async_io op")
    monkeypatch.setattr(warmup, "build_compile_cache", lambda dest: built.append("compile") or ["Unit 4 decode"])
    assert cli._cmd_warmup(argparse.Namespace(dest=str(tmp_path))) == 0
    out = capsys.readouterr()
    assert out.err == "warning: other users cannot read /x/helpers, on the way to the course's package: ...\n"
    assert built == ["op", "aio", "compile"] and "compiled: Unit 4 decode" in out.out
    assert "skipped DeepSpeed's async_io op\n" in out.out
