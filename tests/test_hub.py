"""A JupyterHub for a workshop: the README's ``jupyterhub_config.py`` on loopback, two throw-away
Unix users who log in with their passwords (PAM), both servers started through the hub's REST API, Lab 3's
first check run in both learners' kernels at the same time (the shipped lab's code: not attempted; the
solution's: passed), and each learner's notebook, saved through their own server, graded as that learner
(``teraflops grade --out``, the README's step 4) into a JUnit report naming them.

Needs Linux, root (``useradd``), JupyterHub (the test extra) and configurable-http-proxy (npm; ``.ci/run``
installs it); elsewhere it skips and says which is missing. The users, their homes and every process of
theirs are removed afterwards, also when the test fails (and what a killed run left, by the next run).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from http.cookiejar import CookieJar
from pathlib import Path
from urllib import error, parse, request

import nbformat
import psutil
import pytest
from traversal import course_paths, traversable

from teraflops.course import setup_cell

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- hub-config: tests/test_hub.py runs the next block -->"
LAB = "03_orchestration.ipynb"
PREFIX = "tfhub"  # throw-away users are tfhub<pid of the test process><a|b>
STEP_S = 120  # the most one step may take (a server's start, a cell, a grading) before the test fails


def _proxy_command() -> str | None:
    """configurable-http-proxy on PATH, else in npm's global prefix (``npm install -g`` puts it there)."""
    found = shutil.which("configurable-http-proxy")
    if found or not shutil.which("npm"):
        return found
    prefix = subprocess.run(["npm", "prefix", "-g"], capture_output=True, text=True, timeout=30).stdout.strip()
    candidate = Path(prefix) / "bin" / "configurable-http-proxy"
    return str(candidate) if prefix and candidate.is_file() else None


def _unavailable() -> str | None:
    if sys.platform != "linux":
        return "needs Linux (Unix users, PAM)"
    if os.geteuid() != 0:
        return "needs root: it creates two throw-away Unix users (useradd)"
    if not (shutil.which("useradd") and shutil.which("userdel") and shutil.which("chpasswd")):
        return "needs useradd, userdel and chpasswd (Debian's passwd package)"
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "JupyterHub is not installed: pip install -e '.[test]' (the test extra has it)"
    if _proxy_command() is None:
        return ("configurable-http-proxy not found (on PATH or in npm's global prefix): "
                "npm install -g configurable-http-proxy (.ci/run installs it)")
    return None


def hub_config() -> str:
    """The README's ``jupyterhub_config.py``: the python block after the ``hub-config`` mark."""
    readme = (ROOT / "docs" / "workshop.md").read_text()
    assert MARK in readme, f"docs/workshop.md has no '{MARK}' mark before the hub's configuration"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(MARK):], re.S)
    assert block, "no ```python block after the hub-config mark in docs/workshop.md"
    return textwrap.dedent(block.group(1))


def test_the_readme_hub_config_is_the_one_a_host_needs():
    """The settings this test and a host rely on are in the README's block (read, not run, here)."""
    config = hub_config()
    compile(config, "jupyterhub_config.py", "exec")
    for setting in ('bind_url = "http://127.0.0.1:', 'authenticator_class = "pam"', 'spawner_class = "localprocess"',
                    "c.Authenticator.allowed_users", 'default_url = "/lab"'):
        assert setting in config, setting


# --- throw-away users -------------------------------------------------------------------------------------

def _uid(name: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _processes_of(uid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective):
            found.append(proc)
    return found


def _remove_user(name: str) -> None:
    """Every process of ``name`` killed (by pid), then the user and its home removed."""
    uid = _uid(name)
    if uid is None:
        return
    for _ in range(3):  # a server that is stopping may still start a child: look again
        procs = _processes_of(uid)
        if not procs:
            break
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
    subprocess.run(["userdel", "-r", "-f", name], capture_output=True, timeout=30)
    home = Path("/home") / name
    if home.exists():
        shutil.rmtree(home, ignore_errors=True)


def _sweep_dead_runs() -> None:
    """The throw-away users of a killed run of this test (its pid no longer alive) go first (the modes it
    changed are put back by :func:`traversal.traversable` itself)."""
    import pwd

    for entry in pwd.getpwall():
        m = re.fullmatch(rf"{PREFIX}(\d+)[ab]", entry.pw_name)
        if m and not psutil.pid_exists(int(m.group(1))):
            _remove_user(entry.pw_name)


@pytest.fixture
def learners():
    """Two throw-away Unix users, each with a password, a home only they can read and a copy of labs/;
    yields {name: password}. Removed afterwards, processes and homes included, pass or fail. Skips, saying
    what is missing, where this cannot run."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    _sweep_dead_runs()
    names = [f"{PREFIX}{os.getpid()}{s}" for s in "ab"]
    users = {}
    try:
        for name in names:
            _remove_user(name)  # a pid reused from an earlier, killed run
            subprocess.run(["useradd", "-m", "-d", f"/home/{name}", "-s", "/bin/sh", name], check=True,
                           capture_output=True, timeout=30)
            users[name] = secrets.token_urlsafe(12)
            subprocess.run(["chpasswd"], input=f"{name}:{users[name]}\n", text=True, check=True,
                           capture_output=True, timeout=30)
            home = Path("/home") / name
            os.chmod(home, 0o700)
            shutil.copytree(ROOT / "labs", home / "labs")
            subprocess.run(["chown", "-R", f"{name}:", str(home / "labs")], check=True, timeout=30)
        with traversable(course_paths()):  # the learners' servers run this Python and import this course
            yield users
    finally:
        for name in names:
            _remove_user(name)
        left = [n for n in names if _uid(n) is not None or (Path("/home") / n).exists()]
        assert not left, f"throw-away users or homes left behind: {left}"


# --- the hub ----------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(base: str, token: str, method: str, path: str, body=None) -> tuple[int, dict]:
    """One REST call with the host's token: (HTTP status, JSON body or {})."""
    data = None if body is None else json.dumps(body).encode()
    req = request.Request(base + path, data=data, method=method,
                          headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text.strip() else {}
    except error.HTTPError as e:
        return e.code, {"message": e.read().decode(errors="replace")[:300]}


class _NoRedirect(request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the 302 itself is the answer


def _login(base: str, user: str, password: str) -> tuple[int, set[str]]:
    """A browser's login through the hub's form: (status of the POST, cookie names set)."""
    jar = CookieJar()
    opener = request.build_opener(request.HTTPCookieProcessor(jar), _NoRedirect)
    opener.open(base + "/hub/login", timeout=30).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = parse.urlencode({"username": user, "password": password, "_xsrf": xsrf}).encode()
    try:
        with opener.open(request.Request(base + "/hub/login", data=form), timeout=60) as r:
            status = r.status
    except error.HTTPError as e:
        status = e.code
    return status, {c.name for c in jar}


def _terminate_with_parent() -> None:
    """In the hub's process before it runs: SIGTERM when the test's process dies (a killed pytest), so the
    hub stops its servers and proxy itself (Linux's PR_SET_PDEATHSIG, man 2 prctl)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextmanager
def _hub(tmp: Path, users, token: str):
    """JupyterHub from the README's configuration, on free loopback ports, a service ``host`` holding
    ``token``; yields the public URL. Stopped afterwards (SIGTERM stops the servers and the proxy; what
    is left is killed), its log printed if it failed."""
    port, api_port = _free_port(), _free_port()
    config = tmp / "jupyterhub_config.py"
    config.write_text(hub_config() + textwrap.dedent(f"""
        # the test's own: free ports, its users, files in its folder, a token for the host's REST calls
        c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
        c.JupyterHub.hub_port = {_free_port()}
        c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
        c.ConfigurableHTTPProxy.command = [{_proxy_command()!r}]
        c.ConfigurableHTTPProxy.pid_file = {str(tmp / "proxy.pid")!r}
        c.Authenticator.allowed_users = {set(users)!r}
        c.JupyterHub.db_url = "sqlite:///{tmp / 'jupyterhub.sqlite'}"
        c.JupyterHub.cookie_secret_file = {str(tmp / "cookie_secret")!r}
        c.JupyterHub.services = [{{"name": "host", "api_token": {token!r}}}]
        c.JupyterHub.load_roles = [{{"name": "host", "services": ["host"],
                                     "scopes": ["list:users", "read:users", "admin:servers", "access:servers"]}}]
        """))
    pythonpath = [str(ROOT / "helpers"), *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout's package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    log_path = tmp / "hub.log"
    with open(log_path, "w") as log:
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=tmp, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=_terminate_with_parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STEP_S
        while True:
            assert hub.poll() is None, f"JupyterHub exited ({hub.returncode}):\n{log_path.read_text()[-3000:]}"
            try:
                with request.urlopen(base + "/hub/api/", timeout=5) as r:
                    if r.status == 200:
                        break
            except (error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"JupyterHub not up in {STEP_S} s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        yield base
    except BaseException:
        print(f"--- JupyterHub's log (last 4000 characters) ---\n{log_path.read_text()[-4000:]}")
        raise
    finally:
        if hub.poll() is None:
            os.killpg(hub.pid, signal.SIGTERM)
            try:
                hub.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(hub.pid, signal.SIGKILL)
                hub.wait()
        try:  # the proxy runs in the hub's session; its pid file names it
            os.killpg(hub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file = tmp / "proxy.pid"
        if pid_file.exists() and pid_file.read_text().strip().isdigit():
            pid = int(pid_file.read_text())
            try:
                if "configurable-http-proxy" in " ".join(psutil.Process(pid).cmdline()):
                    psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


def _ready(base: str, token: str, user: str) -> bool:
    status, model = _call(base, token, "GET", f"/hub/api/users/{user}")
    assert status == 200, (status, model)
    server = model.get("servers", {}).get("")
    return bool(server and server.get("ready"))


# --- a learner's kernel, driven as JupyterLab drives it ---------------------------------------------------

async def _run_cells(base: str, token: str, user: str, cells: list[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """Start a kernel in ``user``'s server (REST), run ``cells`` one by one over its websocket (the Jupyter
    messaging protocol, https://jupyter-client.readthedocs.io/en/stable/messaging.html: an
    ``execute_request`` on the shell channel; ``stream`` and ``error`` messages on iopub until the
    kernel is ``idle`` again); per cell (printed text, [(ename, evalue)])."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    status, kernel = await asyncio.to_thread(_call, base, token, "POST", f"/user/{user}/api/kernels",
                                             {"name": "python3"})
    assert status == 201, (user, status, kernel)
    session = uuid.uuid4().hex
    ws = await websocket_connect(HTTPRequest(
        f"ws{base[4:]}/user/{user}/api/kernels/{kernel['id']}/channels?session_id={session}",
        headers={"Authorization": f"token {token}"}))
    results = []
    try:
        for code in cells:
            msg_id = uuid.uuid4().hex
            ws.write_message(json.dumps({
                "header": {"msg_id": msg_id, "username": user, "session": session, "msg_type": "execute_request",
                           "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": False}}))
            texts, errors = [], []
            while True:
                raw = await asyncio.wait_for(ws.read_message(), STEP_S)
                assert raw is not None, f"{user}'s kernel websocket closed"
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    texts.append(content["text"])
                elif kind == "error":
                    errors.append((content["ename"], content["evalue"]))
                elif kind == "status" and content["execution_state"] == "idle":
                    break
            results.append(("".join(texts), errors))
    finally:
        ws.close()
    return results


def _exercise_cells(notebook: Path) -> tuple[str, str, str]:
    """(setup, exercise, check): the notebook's first code cell after the generated setup cell, the cell defining the function its first
    check cell checks, and that check cell."""
    code = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code" and not setup_cell.is_setup(c)]
    check = next(c for c in code if re.search(r"\bcheck\.\w+\(", c.source))
    name = re.search(r"\bcheck\.(\w+)\(", check.source).group(1)
    exercise = next(c for c in code if re.search(rf"^def {name}\(", c.source, re.M))
    return code[0].source, exercise.source, check.source


def _first_check_notebook(exercise: str) -> nbformat.NotebookNode:
    """Lab 3 up to its first check cell, with ``exercise`` as the exercise's cell: a learner's try."""
    nb = nbformat.read(ROOT / "labs" / LAB, as_version=4)
    cut = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and re.search(r"\bcheck\.\w+\(", c.source))
    nb.cells = nb.cells[:cut + 1]
    _, lab_exercise, _ = _exercise_cells(ROOT / "labs" / LAB)
    next(c for c in nb.cells if c.source == lab_exercise).source = exercise
    return nb


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard (the suite's default), not a budget: its phases' times are printed
def test_two_learners_run_a_labs_first_check_at_once_through_jupyterhub(learners, tmp_path):
    started = time.monotonic()
    alice, bob = users = list(learners)
    token = secrets.token_hex(24)
    setup, lab_exercise, check = _exercise_cells(ROOT / "labs" / LAB)
    _, solution, _ = _exercise_cells(ROOT / "solutions" / LAB)
    assert solution != lab_exercise

    phases = {}
    with _hub(tmp_path, users, token) as base:
        phases["hub up"] = time.monotonic() - started
        # PAM: a learner's own password logs in, someone else's does not
        status, cookies = _login(base, alice, learners[alice])
        assert status == 302 and "jupyterhub-hub-login" in cookies, (status, cookies)
        assert _login(base, bob, learners[alice])[0] == 403

        # the host starts every learner's server through the REST API, all at once
        for user in users:
            status, body = _call(base, token, "POST", f"/hub/api/users/{user}/server")
            assert status in (201, 202), (user, status, body)
        deadline = time.monotonic() + STEP_S
        while not all(_ready(base, token, u) for u in users):
            assert time.monotonic() < deadline, f"the learners' servers were not ready in {STEP_S} s"
            time.sleep(0.5)
        phases["servers ready"] = time.monotonic() - started

        # in both servers at the same time: who am I, then the lab's code and the solution's, each checked
        def cells(other: str) -> list[str]:
            probe = ("import os, pwd\nprint(pwd.getpwuid(os.getuid()).pw_name, os.getcwd(), "
                     f"os.path.isfile('labs/{LAB}'), os.access('/home/{other}', os.R_OK))")
            return [probe, setup, lab_exercise, check, solution, check]

        async def both():
            async def one(user, other):
                t0 = time.monotonic()
                out = await _run_cells(base, token, user, cells(other))
                return out, (t0, time.monotonic())
            return await asyncio.gather(one(alice, bob), one(bob, alice))

        runs = asyncio.run(both())
        for user, (out, _) in zip(users, runs):
            # its own user, home and labs copy; the other learner's home closed to it
            assert out[0] == (f"{user} /home/{user} True False\n", []), out[0]
            assert not out[1][1], f"{user}'s setup cell failed: {out[1]}"
            not_attempted, passed = out[3], out[5]
            assert [e for e, _ in not_attempted[1]] == ["NotAttempted"], not_attempted
            assert re.match(r"Exercise 1 \(.*\): not attempted", not_attempted[1][0][1]), not_attempted
            assert not passed[1] and re.search(r"✓ Exercise 1 \(.*\): passed", passed[0]), passed
        (a0, a1), (b0, b1) = (span for _, span in runs)
        assert max(a0, b0) < min(a1, b1), "the two learners' kernels did not run at the same time"
        phases["checks run"] = time.monotonic() - started

        # each learner saves a try through their own server (as JupyterLab does): alice's solved, bob's not
        for user, exercise in ((alice, solution), (bob, lab_exercise)):
            content = json.loads(nbformat.writes(_first_check_notebook(exercise)))
            status, body = _call(base, token, "PUT", f"/user/{user}/api/contents/labs/mine.ipynb",
                                 {"type": "notebook", "format": "json", "content": content})
            assert status in (200, 201), (user, status, body)

    phases["hub stopped"] = time.monotonic() - started

    # the README's step 4: each notebook graded as its learner, from a folder they cannot enter, at once
    gradings = {u: subprocess.Popen(["runuser", "-u", u, "--", sys.executable, "-m", "teraflops", "grade",
                                     f"/home/{u}/labs/mine.ipynb", "--out", f"/home/{u}/mine.xml"],
                                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=dict(os.environ, PYTHONPATH=str(ROOT / "helpers")))
                for u in users}
    for user, proc in gradings.items():
        out = proc.communicate(timeout=STEP_S)[0]
        assert proc.returncode == 1, out  # the lab's other exercises have no check cell in a first try
        report = Path(f"/home/{user}/mine.xml")
        assert report.owner() == user, "the report is written by the learner"
        suite = ET.parse(report).getroot().find("testsuite")
        assert {p.get("name"): p.get("value") for p in suite.iter("property")} == {"learner": user, "unit": "3"}
        first = suite.find("testcase")
        assert first.get("classname") == f"{user}.mine" and first.get("name").startswith("Exercise 1 (")
        failure = first.find("failure")
        if user == alice:
            assert failure is None, ET.tostring(first)
        else:
            assert failure is not None and failure.get("type") == "NotAttempted", ET.tostring(first)
    phases["graded"] = time.monotonic() - started
    print("JupyterHub test, seconds since start: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
