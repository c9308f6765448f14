"""A workshop on one machine (issue 20): clusters belong to their owners, a killed notebook takes its
run with it, a host's warm cache, builds that say why they failed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from teraflops import cluster as cl
from teraflops import ownership

REASON = cl.unavailable() if sys.platform == "linux" else "needs Linux"
NEEDS_NODES = pytest.mark.skipif(REASON is not None, reason=f"emulated nodes unavailable: {REASON}")
TRIALS = int(os.environ.get("TERAFLOPS_UP_TRIALS", "2"))  # 20 by hand: TERAFLOPS_UP_TRIALS=20


def _shell(*args: str) -> subprocess.Popen:
    """A shell that runs `teraflops cluster ARGS`, prints its exit code and stays (it owns the cluster)."""
    line = " ".join([sys.executable, "-m", "teraflops", "cluster", *args])
    return subprocess.Popen(["sh", "-c", f"{line}; echo rc=$?; exec sleep 120"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


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

    from teraflops import distributed, stale

    if launcher == "deepspeed":
        distributed.prepare_deepspeed_ops(cpu=True)
    script = tmp_path / "notebook.py"
    args = ["--timeout", "600"] + (["--deepspeed"] if launcher == "deepspeed" else [])
    script.write_text(
        "from teraflops.distributed import launch\n"
        f"launch('teraflops.workers.selftest', 2, {args!r}, launcher={launcher!r}, timeout=600,"
        " env={'TERAFLOPS_FAULT': 'hang:rank=1:step=1', 'CUDA_VISIBLE_DEVICES': ''})\n")
    before = set(glob.glob("/tmp/teraflops-launch-*"))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # another learner's run's owner
    other = f"/dev/shm/{stale.SHM_PREFIX}_{os.getuid()}_127.0.0.1_1_0"
    with open(other, "wb"):
        pass  # a buffer no launch of a dead owner made: it is left alone while mapped... or owned
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while True:
            folders = set(glob.glob("/tmp/teraflops-launch-*")) - before
            members = [p for f in folders for p in _members(f)]
            ranks = [p for p in members if "selftest" in " ".join(p.cmdline()) and "_rank.py" not in " ".join(p.cmdline())]
            shm = stale.shm_files() if launcher == "deepspeed" else ["-"]
            if len(ranks) >= 2 and [s for s in shm if str(s) != other]:
                break
            assert time.monotonic() < deadline and victim.poll() is None, "the run did not start"
            time.sleep(0.5)
        time.sleep(2)
        (folder,) = folders
        port = __import__("json").loads(open(f"{folder}/owner.json").read())["port"]
        os.kill(victim.pid, signal.SIGKILL)  # as a kernel killed by a restart: its finally never runs
        victim.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and (_members(folder) or os.path.exists(folder)):
            time.sleep(0.2)
        assert _members(folder) == [], f"still running 10 s after the kill: {[p.cmdline() for p in _members(folder)]}"
        assert not os.path.exists(folder)
        assert stale.shm_files(port) == []
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

    from teraflops import stale

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(stale, "SHM", tmp_path / "shm")
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
        (tmp_path / "shm" / f"{stale.SHM_PREFIX}_{uid}_127.0.0.1_{port}_0").write_bytes(b"x")
    removed = {p.name for p in stale.sweep()}
    assert "teraflops-launch-dead" in removed and f"{stale.SHM_PREFIX}_{uid}_127.0.0.1_41001_0" in removed
    assert (tmp_path / "teraflops-launch-live").exists()
    assert (tmp_path / "shm" / f"{stale.SHM_PREFIX}_{uid}_127.0.0.1_41002_0").exists()


def test_a_learner_copies_the_warm_op_without_its_lock(tmp_path, monkeypatch):
    from teraflops import warmup

    monkeypatch.setenv(warmup.WARM_ENV, str(tmp_path / "warm"))
    ext = tmp_path / "mine" / "torch_extensions" / "py311-abc"
    source = warmup.warm_op_dir(ext)
    source.mkdir(parents=True)
    (source / warmup._stamp_name()).touch()
    (source / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    (source / "lock").touch()
    os.utime(source / "deepspeed_shm_comm.so", (1e9, 1e9))
    assert warmup.seed_op(ext)
    copied = ext / warmup.OP
    assert (copied / "deepspeed_shm_comm.so").stat().st_mtime == 1e9  # ninja sees it up to date
    assert not (copied / "lock").exists() and not warmup.seed_op(ext)  # once


def test_a_cache_of_another_user_says_why_in_one_line(tmp_path, monkeypatch):
    from teraflops import warmup

    (tmp_path / warmup.OP).mkdir()
    monkeypatch.setattr(warmup.os, "access", lambda path, mode: False)
    why = warmup.unwritable_reason(tmp_path)
    assert "lock" in why and "TERAFLOPS_CACHE" in why and "\n" not in why


@pytest.mark.parametrize("code, words, not_words", [
    (-9, "killed by SIGKILL after 10 s", "900"), (None, "not done after 900 s", "killed by"),
])
def test_a_build_killed_elsewhere_says_so_and_no_compiler_hint_when_one_is_there(tmp_path, monkeypatch, code, words,
                                                                                 not_words):
    import shutil

    from teraflops import distributed, warmup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(distributed, "_build_once", lambda ext, log, timeout: (code, 10.0))
    monkeypatch.setattr(distributed, "_builds", lambda ext: [])
    monkeypatch.setattr(warmup, "seed_op", lambda ext: False)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    with pytest.raises(distributed.OpBuildFailed) as err:
        distributed.prepare_deepspeed_ops(cpu=True)
    assert words in str(err.value) and not_words not in str(err.value) and "g++" not in str(err.value)


def test_a_waiter_whose_other_build_died_builds_it_itself(tmp_path, monkeypatch):
    from teraflops import distributed, warmup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def build(ext, log, timeout):
        calls.append(1)
        log.write_text("ImportError: deepspeed_shm_comm.so: cannot open shared object file\n")
        return (1 if len(calls) == 1 else 0), 1.0

    monkeypatch.setattr(distributed, "_build_once", build)
    monkeypatch.setattr(distributed, "_builds", lambda ext: [4242] if not calls else [])
    monkeypatch.setattr(warmup, "seed_op", lambda ext: False)
    distributed.prepare_deepspeed_ops(cpu=True)
    assert len(calls) == 2
