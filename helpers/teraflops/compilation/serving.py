"""A real model server: Triton Inference Server (through PyTriton) serving the Unit 4 decode model.

:class:`Server` starts Triton Inference Server (https://github.com/triton-inference-server/server; started
from Python by PyTriton, https://github.com/triton-inference-server/pytriton, which ships ``tritonserver``
and its Python backend in the ``nvidia-pytriton`` wheel) in a process of its own
(:mod:`teraflops.workers.serve_decode`), serving two models of the same weights:

* ``decode_batched``: Triton's **dynamic batcher** (``dynamic_batching { max_queue_delay_microseconds }``,
  https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/user_guide/model_configuration.html#dynamic-batcher):
  requests that wait together, up to ``max_batch``, run as one execution; the oldest waits at most the
  queue delay for company.
* ``decode_single``: no batcher: each request is its own execution (what a server without batching does).

**The request** is one whole short generation (``prompt_len`` token ids in, ``new_tokens`` greedy tokens out:
a prefill, then decode steps on a static KV cache). Triton's dynamic batcher batches *requests*: a batch
starts and ends together, so batching single decode steps would need the server to keep each sequence's KV
cache between requests (Triton's sequence batcher, or continuous batching as vLLM does it). Whole
generations of equal length are what request-level batching serves honestly; their cost (each decode
step reads every weight whatever the batch) is exactly what batching amortises.

**Lifecycle** (like every run of the course, :mod:`teraflops.launch.leftovers`): the server's folder
``$TMPDIR/teraflops-launch-serve-*`` (``owner.json``, the Spec, logs, PyTriton's workspace) and a second
one in ``/dev/shm`` are bound over ``/tmp`` and ``/dev/shm`` in a private mount namespace
(``unshare --mount``; ``--user --map-root-user`` when not root; the folders of ``/tmp`` the server runs
from, a clone or venv there, are carried into it: :func:`kept_under_tmp`), so everything Triton writes there (its
Python backend unpacks each model to ``/tmp/folderXXXXXX`` and ``/tmp/python_env_XXXXXX`` whatever
``TMPDIR`` says; its shared-memory regions) lands in folders that are the server's own and go with it.
It listens on 127.0.0.1 only (the workshop's loopback rule); its statistics API wants an access token
(``ServeSpec.token``, header ``triton-access-token``). A watchdog in a session of its own
(``launch/scripts/watchdog.py``) stops it and removes both folders once the kernel is gone (SIGKILL
included); the server also stops itself when its owner is gone, and :func:`teraflops.launch.leftovers.sweep`
removes what a dead owner left.
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import platform
import secrets
import signal
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from contextlib import suppress
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from teraflops.compilation.batching import BatchLatency
from teraflops.errors import CourseError
from teraflops.launch import leftovers, processes, wire
from teraflops.launch.ports import free_port
from teraflops.launch.scripts.proc_identity import proc_start
from teraflops.sizing import preset
from teraflops.teardown import uninterruptible

BATCHED, SINGLE = "decode_batched", "decode_single"
PREFIX = "teraflops-launch-serve-"  # a launch folder: teraflops.launch.leftovers.sweep knows it
SHM_ROOT = Path("/dev/shm")
GLIBC_FLOOR = (2, 35)  # nvidia-pytriton 0.7.0's wheel tag: manylinux_2_35_x86_64
PACKAGES = ("nvidia-pytriton", "tritonclient")
STOP_GRACE_S = 5.0  # Triton unloads its models and exits in ~2 s here (exit_timeout_secs=1)


class ServingError(CourseError, RuntimeError):
    """The server cannot start or stopped: one line, why, and the fix."""


@dataclass(frozen=True)
class ServeSpec:
    """What the server process is asked to serve (``spec.json``, read by :mod:`teraflops.workers.serve_decode`).

    Attributes:
        preset: the sizing preset whose decode model is served (:func:`teraflops.compilation.decode.decode_model`).
        prompt_len, new_tokens: one request's prompt (int64 token ids) and generated tokens.
        max_batch: the largest batch Triton runs (``max_batch_size``).
        queue_delay_us: the dynamic batcher's ``max_queue_delay_microseconds`` (``decode_batched`` only).
        instances: model instances per model (Triton's ``instance_group`` count): executions that may run at once.
        threads: torch threads of the server process.
        http_port, grpc_port, metrics_port: on 127.0.0.1.
        token: the access token of Triton's restricted APIs (statistics, model control).
        owner_pid, owner_start: the notebook-side process (``/proc/<pid>/stat`` field 22): gone, the server stops.
        folder: the server's folder as the server sees it (``/tmp`` in its namespace).
        latency_batches, latency_reps: the batch sizes at which the server times one request's work, and repeats.
    """

    preset: str
    prompt_len: int
    new_tokens: int
    max_batch: int
    queue_delay_us: int
    instances: int
    threads: int
    http_port: int
    grpc_port: int
    metrics_port: int
    token: str
    owner_pid: int
    owner_start: str
    folder: str
    latency_batches: tuple[int, ...]
    latency_reps: int = 3


@dataclass(frozen=True)
class ServeReady:
    """What the server reports once it serves (``ready.json``).

    Attributes:
        pid: the server process (Triton's ``tritonserver`` and its backend stubs are its children).
        ready_s: seconds from the program's start to serving (model build, latency timing, Triton start).
        batch_sizes, batch_seconds: median seconds of one batched generation at each batch size, timed in the
            server process before Triton started (the model alone, without Triton's own cost per execution).
        device: where the model runs. threads: torch threads.
    """

    pid: int
    ready_s: float
    batch_sizes: tuple[int, ...]
    batch_seconds: tuple[float, ...]
    device: str
    threads: int


# --------------------------------------------------------------------------- can it run here?

def glibc() -> tuple[int, int] | None:
    """This machine's glibc version ``(major, minor)`` (``platform.libc_ver``), or None without glibc."""
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    major, minor = (int(x) for x in version.split(".")[:2])
    return major, minor


def why_not() -> str | None:
    """One line on why the server cannot run here (not Linux x86-64, glibc older than 2.35, the ``serving``
    extra or ``unshare`` missing), or None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return (f"Triton Inference Server (PyTriton) needs Linux on x86-64; this is {sys.platform} on "
                f"{platform.machine()}")
    g = glibc()
    if g is None or g < GLIBC_FLOOR:
        have = "no glibc" if g is None else f"glibc {g[0]}.{g[1]}"
        return f"PyTriton's wheel needs glibc >= {GLIBC_FLOOR[0]}.{GLIBC_FLOOR[1]}; this machine has {have}"
    for package in PACKAGES:
        try:
            metadata.version(package)
        except metadata.PackageNotFoundError:
            return f"{package} is not installed. Fix: pip install -e \".[serving]\""
    if shutil.which("unshare") is None:
        return "the server runs in a private mount namespace and `unshare` (util-linux) is missing"
    return _mount_namespace_once()


def mount_namespace_error(run=subprocess.run) -> str | None:
    """One line on why this process cannot make the server's private mount namespace (``unshare
    --mount --propagation private``, with ``--user --map-root-user`` when not root), tried on ``true``;
    None when it can. In Docker or Kubernetes without ``CAP_SYS_ADMIN`` (the default) it fails with
    EPERM although ``unshare`` is installed."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    try:
        got = run(["unshare", *user, "--mount", "--propagation", "private", "true"], capture_output=True, text=True,
                  timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare --mount` could not run here ({e})"
    if got.returncode == 0:
        return None
    said = (got.stderr or "").strip().splitlines()[-1:] or [f"exit status {got.returncode}"]
    return (f"the server needs a private mount namespace and `unshare --mount` fails here ({said[0]}): a container "
            "without CAP_SYS_ADMIN (Docker, Kubernetes). Fix: run on the host, or start the container with "
            "--cap-add SYS_ADMIN")


@functools.lru_cache(maxsize=1)
def _mount_namespace_once() -> str | None:
    return mount_namespace_error()


def check() -> None:
    """Raise :class:`ServingError` (one line, :func:`why_not`) unless the server can run here."""
    reason = why_not()
    if reason:
        raise ServingError(reason)


# --------------------------------------------------------------------------- the server

def _libdir_env() -> dict:
    """``LD_LIBRARY_PATH`` with this interpreter's ``LIBDIR`` first: Triton's Python backend stub loads
    ``libpython3.X.so``, and without this it takes the system's (Debian's 3.11.2 under a pyenv 3.11.7:
    model load fails with ``'_thread.RLock' object has no attribute '_recursion_count'``)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    rest = os.environ.get("LD_LIBRARY_PATH", "")
    return {"LD_LIBRARY_PATH": os.pathsep.join(x for x in (libdir, rest) if x)}


def kept_under_tmp() -> list[str]:
    """The top-level folders of ``/tmp`` that the server needs to see through its private ``/tmp``: those
    holding this Python environment, the course package or the working folder (a clone in a
    ``mktemp -d`` folder, a venv under ``/tmp``). Each is bound into the private ``/tmp`` before it goes
    over the real one (:meth:`Server._start`), so the server runs from where the learner installed it."""
    tmp = os.path.realpath("/tmp")
    found = set()
    for path in (sys.prefix, __file__, os.getcwd()):
        real = os.path.realpath(path)
        if real.startswith(tmp + os.sep):
            found.add(os.path.relpath(real, tmp).split(os.sep, 1)[0])
    return sorted(found)


class Server:
    """Triton Inference Server serving the decode model, on 127.0.0.1; a context manager (``with Server() as s``).

    Args:
        queue_delay_ms: the dynamic batcher's ``max_queue_delay`` (ms, ≥ 0) for ``decode_batched``.
        max_batch: the largest batch (≥ 1; default the preset's largest decode batch, at most 32).
        instances: model instances per model (≥ 1).
        new_tokens, prompt_len: one request (default 4 prompt tokens, 8 new: mostly decode steps, the phase that
            batching makes nearly free).
        p: the sizing preset (default :func:`teraflops.sizing.preset`).
        timeout: seconds the start may take.

    Attributes (once started): ``url`` (``127.0.0.1:port``, HTTP), ``grpc_url``, ``metrics_url``, ``token``,
    ``ready`` (a :class:`ServeReady`), ``folder``, ``spec``.

    Raises:
        ServingError: it cannot run here (:func:`why_not`), a bad setting, or the server did not come up
            within ``timeout`` (its last log line).
    """

    def __init__(self, queue_delay_ms: float = 2.0, max_batch: int | None = None, instances: int = 1, *,
                 new_tokens: int = 8, prompt_len: int = 4, p=None, timeout: float = 90.0):
        self.p = p or preset()
        if not isinstance(queue_delay_ms, (int, float)) or isinstance(queue_delay_ms, bool) or not 0 <= queue_delay_ms <= 1e4:
            raise ServingError(f"queue_delay_ms must be a number of milliseconds in [0, 10000]; got {queue_delay_ms!r}")
        max_batch = min(32, max(self.p.decode.batches)) if max_batch is None else max_batch
        for name, value in (("max_batch", max_batch), ("instances", instances), ("new_tokens", new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ServingError(f"{name} must be an integer >= 1; got {value!r}")
        self.prompt_len = prompt_len
        if self.prompt_len + new_tokens > self.p.decode.max_seq_len:
            raise ServingError(f"prompt_len {self.prompt_len} + new_tokens {new_tokens} exceeds the model's "
                               f"max_seq_len {self.p.decode.max_seq_len}")
        self.queue_delay_ms, self.max_batch, self.instances = float(queue_delay_ms), max_batch, instances
        self.new_tokens, self.timeout = new_tokens, timeout
        self.proc = self.watchdog = self.folder = self.shm = self.ready = self.spec = None

    # -- start
    def start(self) -> "Server":
        """Start the server and wait until it serves; on any failure (or Ctrl-C) nothing of it is left."""
        check()
        leftovers.sweep()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)
        return self

    def _start(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.shm = SHM_ROOT / self.folder.name
        self.shm.mkdir(mode=0o700)
        http, grpc, metrics = free_port(), free_port(), free_port()
        for folder in (self.folder, self.shm):
            leftovers.record(folder, http)
        me = os.getpid()
        batches = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= self.max_batch)
        batches += () if self.max_batch in batches else (self.max_batch,)
        self.spec = ServeSpec(preset=self.p.name, prompt_len=self.prompt_len, new_tokens=self.new_tokens,
                              max_batch=self.max_batch, queue_delay_us=int(round(self.queue_delay_ms * 1e3)),
                              instances=self.instances, threads=1 if self.p.device == "cpu" else 4,
                              http_port=http, grpc_port=grpc, metrics_port=metrics, token=secrets.token_urlsafe(16),
                              owner_pid=me, owner_start=proc_start(me), folder="/tmp", latency_batches=batches)
        wire.write(self.spec, self.folder / "spec.json")
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        # the folders of /tmp the server runs from are bound into its own folder first, which then goes over
        # /tmp with them (--rbind carries them); in the machine's view they stay empty folders of the server's
        keep = kept_under_tmp()
        inner = ('own=$1 shm=$2 k=$3; shift 3; while [ "$k" -gt 0 ]; do mkdir -p "$own/$1" && '
                 'mount --bind "/tmp/$1" "$own/$1" || exit 1; shift; k=$((k - 1)); done; '
                 'mount --rbind "$own" /tmp && mount --bind "$shm" /dev/shm && cd /tmp && exec "$@"')
        cmd = ["unshare", *user, "--mount", "--propagation", "private", "sh", "-c", inner, "sh",
               str(self.folder), str(self.shm), str(len(keep)), *keep, sys.executable, "-m", "teraflops.workers.serve_decode",
               "--spec", "/tmp/spec.json"]
        env = {**os.environ, **_libdir_env(), **leftovers.owner_env(), wire.RESULTS_ENV: str(self.folder)}
        with open(self.folder / "server.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.watchdog = leftovers.start_watchdog(self.folder, http, [self.proc.pid], also=[self.shm])
        deadline = time.monotonic() + self.timeout
        while not (self.folder / "ready.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                what = (f"exited with status {self.proc.returncode}" if self.proc.returncode is not None
                        else f"was not ready within {self.timeout:g} s")
                raise ServingError(f"the Triton server {what}: {self._last_line()} Log: {self.folder / 'server.log'}")
            time.sleep(0.2)
        self.ready = wire.read(ServeReady, self.folder / "ready.json")

    def _last_line(self) -> str:
        try:
            lines = [x for x in (self.folder / "server.log").read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no log)"
        errors = [x for x in lines if "Error" in x or "error" in x]
        return (errors or lines or ["(empty log)"])[-1].strip()[:300]

    # -- addresses
    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.spec.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.spec.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.metrics_port}/metrics"

    @property
    def token(self) -> str:
        return self.spec.token

    @property
    def latency(self):
        """The per-batch latency the server measured in its own process, as a
        :class:`teraflops.compilation.batching.BatchLatency` (what the SimPy model is driven with)."""
        return BatchLatency(self.ready.batch_sizes, self.ready.batch_seconds,
                            label=f"one generation ({self.prompt_len} prompt + {self.new_tokens} new tokens), "
                                  f"timed in the server process ({self.ready.device}, {self.ready.threads} thread)")

    # -- talking to it
    def infer(self, prompts) -> "object":
        """Send ``prompts`` (int64 ``(n, prompt_len)``, NumPy) to ``decode_batched`` as one request over HTTP;
        returns the generated tokens, int64 ``(n, new_tokens)``."""
        import numpy as np
        import tritonclient.http as http  # lazy: the serving extra

        prompts = np.ascontiguousarray(prompts, dtype=np.int64)
        with http.InferenceServerClient(self.url) as client:
            inp = http.InferInput("prompt", list(prompts.shape), "INT64")
            inp.set_data_from_numpy(prompts)
            return client.infer(BATCHED, [inp]).as_numpy("tokens")

    def metrics(self) -> dict[str, dict[str, float]]:
        """Triton's Prometheus counters from the metrics endpoint, per model: ``nv_inference_request_success``,
        ``nv_inference_count`` (requests' batch entries), ``nv_inference_exec_count`` (executions),
        ``nv_inference_queue_duration_us``, ``nv_inference_compute_infer_duration_us``, ..."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        return parse_metrics(text)

    # -- stop
    def stop(self) -> None:
        """Stop the server (SIGTERM to the server program; after ``STOP_GRACE_S`` SIGTERM, then SIGKILL, to every
        process of it) and remove its folders;
        safe to call again, finished even through more Ctrl-Cs."""
        uninterruptible(self._stop)
        atexit.unregister(self.stop)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server program first: it stops Triton in order
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S)
        if self.proc is not None or self.folder is not None:
            processes.stop(self.proc, self.folder)  # then whatever is left of it: SIGTERM, SIGKILL
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
        for folder in (self.folder, self.shm):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"serving on {self.url}" if self.ready and self.proc and self.proc.poll() is None else "not running"
        return (f"Server(queue_delay_ms={self.queue_delay_ms:g}, max_batch={self.max_batch}, "
                f"instances={self.instances}, new_tokens={self.new_tokens}; {state})")


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{model: {metric: value}}`` from Prometheus text (lines ``name{model="m",version="1"} value``); lines
    without a ``model`` label are left out."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels, _, value = rest.rpartition("}")
        fields = dict(kv.split("=", 1) for kv in labels.split(",") if "=" in kv)
        model = fields.get("model", "").strip('"')
        if model:
            try:
                out.setdefault(model, {})[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return out


def leftover_paths() -> list[str]:
    """This machine's server folders now (``$TMPDIR`` and ``/dev/shm``): what the tests expect gone."""
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")) + glob.glob(str(SHM_ROOT / (PREFIX + "*"))))

