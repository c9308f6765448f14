"""A warm cache for a workshop: the host compiles once, every learner reads it (``teraflops warmup``).

Two things compile on a learner's first run, both JIT, both slow on a few cores:

* **DeepSpeed's CPU op** ``deepspeed_shm_comm``: every DeepSpeed run on CPU loads it (C++, 1-2 min on
  2 cores: :func:`teraflops.distributed.prepare_deepspeed_ops`).
* **torch.compile's kernels** (Unit 4, :func:`teraflops.decode.compile_decode` and the
  recompilation demo): Inductor's generated C++ (CPU) or Triton (GPU) kernels, and on a CPU a
  ~150 MB precompiled header of torch's kernel prelude (``torch/csrc/inductor/cpp_prefix.h``).

A cache shared *read-write* across Unix users does not work: torch takes lock files beside what it
builds (``torch.utils.cpp_extension.load``'s ``FileBaton`` in the op's folder,
``torch/utils/file_baton.py``; Inductor's ``FileLock`` under ``<cache>/locks`` and
``precompiled_headers/locks``, ``torch/_inductor/codecache.py``), which a learner cannot create in a
folder of another user. So the host builds into :func:`warm_dir` (``$TERAFLOPS_WARM_CACHE``, default
``/var/cache/teraflops``, made readable by all: :func:`teraflops.distributed.build_warm_cache` and
:func:`build_compile_cache`), and each learner's process copies what
it needs into the learner's own :func:`cache_dir`:

* the built op folder, without its lock (:func:`seed_op`, when a DeepSpeed run starts): copies keep
  modification times, so ninja finds every output up to date and compiles nothing. Ninja must be the
  same program on both sides: ninja 1.11 (Debian's) and 1.13 (the ``ninja`` wheel) write different
  ``.ninja_log`` formats (v5, v7) and each rebuilds all it finds in the other's ("build log version
  is too old; starting over", "command line changed"). The op's builds and the ranks therefore run
  the Python environment's ninja (:func:`with_ninja`) and the op's stamp names its version.
* Inductor's and Triton's caches (:func:`seed_compile_caches`, when ``teraflops`` is imported): the
  host's ``inductor/`` and ``triton/`` are merged into the learner's (``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR``, set to folders under :func:`cache_dir` unless the learner set them), and the
  precompiled headers are linked into torch's per-user header folder (:func:`header_dir`; only read
  by the compiler, so a symbolic link to the host's copy serves). Inductor's entries are keyed by
  content, not by where the cache lies, so the learner's first ``torch.compile`` of the same graph
  is a cache hit that builds nothing. ``torch.compiler.save_cache_artifacts`` (torch's portable
  cache) is not enough here: its Inductor artifacts carry the graphs' code but not the built C++
  kernels (``InductorCacheArtifact`` in ``torch/_inductor/codecache.py``), which a CPU then compiles.

What the host compiles is the course's compiles at this machine's sizes (:func:`compile_course`).
Host and learners must use the same Python environment (its paths are in every compile command)
and the same machine (Inductor's keys name its CPU's vector ISA and GPU); JupyterHub's single-user
servers do.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import suppress
from functools import cache
from pathlib import Path
from typing import Mapping

WARM_ENV = "TERAFLOPS_WARM_CACHE"
OP = "deepspeed_shm_comm"
COMPILE = "compile"  # warm_dir()/compile: inductor/, triton/, precompiled_headers/, STAMP
STAMP = "STAMP.json"  # written last by build_compile_cache: what was compiled, for which environment
SEEDED = ".teraflops-seeded"  # in the learner's inductor folder: the STAMP it was seeded from
_LOCKS = "locks"  # torch's lock folders (codecache.get_lock_dir, _HEADER_LOCK_DIR): never copied


def cache_dir() -> Path:
    """``$TERAFLOPS_CACHE`` or ``~/.cache/teraflops`` (created): compiled ops and other caches of this user."""
    path = Path(os.environ.get("TERAFLOPS_CACHE") or Path.home() / ".cache" / "teraflops")
    path.mkdir(parents=True, exist_ok=True)
    return path


def warm_dir() -> Path:
    """``$TERAFLOPS_WARM_CACHE`` or ``/var/cache/teraflops``: the host's read-only cache for learners."""
    return Path(os.environ.get(WARM_ENV) or "/var/cache/teraflops")


def env_key() -> str:
    """``py311-<10 hex digits of sys.prefix's SHA-1>``: one Python environment (compile commands name its paths)."""
    return f"py{sys.version_info[0]}{sys.version_info[1]}-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]}"


# ---- ninja -----------------------------------------------------------------------------------


def ninja_dir() -> str | None:
    """The folder of this Python environment's ninja: the ``ninja`` wheel's ``BIN_DIR`` (a DeepSpeed
    dependency); None without the wheel."""
    try:
        import ninja
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    return folder if folder and os.access(os.path.join(folder, "ninja"), os.X_OK) else None


def with_ninja(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :func:`ninja_dir` first on ``PATH``: torch's JIT builds run ``ninja`` from ``PATH``
    (``_run_ninja_build`` in ``torch/utils/cpp_extension.py``), so this picks which one."""
    out, folder = dict(env), ninja_dir()
    if folder:
        rest = env.get("PATH", os.defpath).split(os.pathsep)  # no PATH: what exec would search
        out["PATH"] = os.pathsep.join([folder, *[p for p in rest if p and p != folder]])
    return out


@cache
def ninja_version() -> str:
    """Version of the ninja :func:`with_ninja` runs: the ``ninja`` wheel's, else ``ninja --version`` of
    the one on ``PATH`` ("none" if there is none)."""
    if ninja_dir():
        import importlib.metadata as md

        with suppress(md.PackageNotFoundError):
            return md.version("ninja")
    exe = shutil.which("ninja")
    if exe is None:
        return "none"
    with suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
        found = re.match(r"\d+(\.\d+)*", out.strip())  # "1.13.2.git.kitware.jobserver-pipe-1": 1.13.2
        return found.group(0) if found else "unknown"
    return "unknown"


# ---- DeepSpeed's CPU op ------------------------------------------------------------------------


def op_stamp() -> str:
    """Name of the file that marks a finished build of the op: DeepSpeed's, torch's and ninja's versions."""
    import importlib.metadata as md

    return f".built-deepspeed{md.version('deepspeed')}-torch{md.version('torch')}-ninja{ninja_version()}"


def warm_op_dir(ext: Path) -> Path:
    """The warm cache's op folder for extensions folder ``ext`` (same environment key)."""
    return warm_dir() / "torch_extensions" / ext.name / OP


def seed_op(ext: Path) -> bool:
    """Copy the warm cache's built op into ``ext`` (a learner's extensions folder) if it lacks one.

    Returns True if copied. Nothing happens when the warm cache has no built op for this environment
    and these versions, or ``ext`` already has one. The copy goes to a temporary folder first and is
    renamed into place, so two runs of one learner at once see all of it or none.
    """
    source, target, built = warm_op_dir(ext), ext / OP, op_stamp()
    if not (source / built).exists() or (target / built).exists() or source == target:
        return False
    ext.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{OP}-seed-", dir=ext))
    try:
        shutil.copytree(source, scratch / OP, ignore=shutil.ignore_patterns("lock"))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)  # an unbuilt or half-built folder of our own
        with suppress(OSError):
            os.rename(scratch / OP, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return (target / built).exists()


def readable_by_all(root: Path) -> None:
    """Add read permission (and search, on folders and executables) for group and others to ``root`` and all below it."""
    for path in [root, *root.rglob("*")]:
        with suppress(OSError):
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                continue
            path.chmod(mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH |
                       ((stat.S_IXGRP | stat.S_IXOTH) if stat.S_ISDIR(mode) or mode & stat.S_IXUSR else 0))


def unwritable_reason(ext: Path) -> str | None:
    """Why a shared ``TERAFLOPS_CACHE`` cannot be used by this user, in one line; None if it can."""
    op = ext / OP
    for path in (op, ext):
        if path.exists():
            if not os.access(path, os.W_OK | os.X_OK):
                import pwd

                try:
                    who = pwd.getpwuid(path.stat().st_uid).pw_name
                except KeyError:
                    who = f"uid {path.stat().st_uid}"
                return (f"{path} belongs to {who} and you cannot write there, and torch takes a lock file in "
                        f"the op's folder on every load. Hint: give each learner their own TERAFLOPS_CACHE "
                        f"(the default ~/.cache/teraflops is); a host shares a built op with `teraflops warmup` "
                        f"(learners then copy it from ${WARM_ENV}).")
            return None
    return None


# ---- torch.compile's caches ------------------------------------------------------------------


def header_dir() -> Path:
    """Where this process's torch keeps Inductor's precompiled headers, whatever ``TORCHINDUCTOR_CACHE_DIR`` says.

    ``_HEADER_DIR = default_cache_dir()/precompiled_headers`` (``torch/_inductor/codecache.py``), with
    ``default_cache_dir()`` = ``$TMPDIR/torchinductor_<user>`` (``torch/_inductor/runtime/cache_dir_utils.py``,
    the same user name and characters replaced). Computed here without importing torch (an import of
    ``teraflops`` stays cheap); ``tests/test_workshop.py`` checks it against torch's.
    """
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)) / "precompiled_headers"


def learner_compile_dirs() -> tuple[Path, Path]:
    """(Inductor's, Triton's) cache folders of this user once seeded: ``$TORCHINDUCTOR_CACHE_DIR`` and
    ``$TRITON_CACHE_DIR`` if set, else ``inductor/`` and ``triton/`` under :func:`cache_dir`."""
    inductor, triton = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")
    base = None if inductor and triton else cache_dir()
    return Path(inductor or base / "inductor"), Path(triton or base / "triton")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"env": env_key()}
    for name in ("torch", "triton"):
        with suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def _merge(source: Path, target: Path) -> int:
    """Copy every file below ``source`` that ``target`` lacks (modes and times kept; lock folders left
    out); each file lands whole (a copy to a temporary name, renamed). Returns the number copied."""
    copied = 0
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d != _LOCKS]
        into = target / Path(folder).relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in files:
            if (into / name).exists():
                continue
            scratch = into / f".{name}.{os.getpid()}.seed"
            shutil.copy2(Path(folder) / name, scratch)
            os.replace(scratch, into / name)
            copied += 1
    return copied


def _link_headers(source: Path, target: Path) -> None:
    """A symbolic link in ``target`` to each precompiled header in ``source`` that ``target`` lacks."""
    if not source.is_dir():
        return
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not os.path.lexists(target / path.name):
            with suppress(FileExistsError):  # another process of ours linked it first
                os.symlink(path, target / path.name)


def seed_compile_caches() -> bool:
    """Seed this user's Inductor and Triton caches from the host's (:func:`build_compile_cache`) and point torch at them.

    Called when ``teraflops`` is imported. Without a warm cache this is one failed ``open`` and
    nothing changes. With one (for this environment and these torch/Triton versions), it sets
    ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (unless set) to :func:`learner_compile_dirs`
    and, once per host warm-up, copies the host's entries in and links its precompiled headers into
    :func:`header_dir`. Returns True if it copied. A cache it cannot write to is warned about (one
    line) and left alone: torch then compiles as usual.
    """
    warm = warm_dir() / COMPILE
    try:
        stamp = (warm / STAMP).read_text()
        meta = json.loads(stamp)
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("versions") != _versions():
        return False
    try:
        inductor, triton = learner_compile_dirs()
        seeded = inductor / SEEDED
        copied = False
        if not (seeded.exists() and seeded.read_text() == stamp):
            _merge(warm / "inductor", inductor)
            _merge(warm / "triton", triton)
            _link_headers(warm / "precompiled_headers", header_dir())
            scratch = inductor / f"{SEEDED}.{os.getpid()}"
            scratch.write_text(stamp)
            os.replace(scratch, seeded)
            copied = True
    except OSError as e:
        warnings.warn(f"the host's warm compile cache ({warm}) was not copied: {e}. Hint: your own cache "
                      f"(TERAFLOPS_CACHE, default ~/.cache/teraflops) must be yours to write; torch.compile "
                      f"now compiles as usual, once.", stacklevel=2)
        return False
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    os.environ.setdefault("TRITON_CACHE_DIR", str(triton))
    return copied


def compile_course() -> list[str]:
    """Run the course's ``torch.compile`` (and, on a GPU, Triton) compiles as its notebooks do on this
    machine, at the sizes :func:`teraflops.sizing.preset` picks here; returns what it compiled.

    * Unit 4 lecture (``notebooks/04_compilation.ipynb``): on a CPU one thread (its first cell),
      :func:`teraflops.decode.compile_decode` of :func:`teraflops.decode.decode_model` in fp32 at
      batch 1, then :func:`teraflops.decode.recompile_demo` for lengths (8, 9, 10) at each ``dynamic``.
    * On a GPU (Triton compiled, not interpreted): Unit 1's FlashAttention kernel at the preset's
      attention shapes and Unit 4's fused RMSNorm kernel at its default shape, fp32.

    Inductor's keys include the generated code, which depends on the thread count and sizes: a
    notebook that compiles differently misses the cache (``tests/test_workshop.py`` checks that the
    lecture still makes these calls).
    """
    import torch

    from . import decode
    from .machine import triton_mode
    from .sizing import preset

    p, done = preset(), []
    if p.device == "cpu":
        torch.set_num_threads(1)  # as the Unit 4 lecture's first cell
    model = decode.decode_model(p, dtype=torch.float32)
    decode.compile_decode(model, model.new_cache(1))
    done.append(f"Unit 4 compile_decode (preset {p.name}, batch 1, fp32)")
    for dynamic in (False, None, True):
        decode.recompile_demo(seq_lens=(8, 9, 10), dynamic=dynamic)
    done.append("Unit 4 recompile_demo (lengths 8, 9, 10; dynamic False, None, True)")
    if p.device == "cuda" and triton_mode() == "compiled":
        from . import attention, fused

        a = p.attention
        for n in a.seq_lens:  # the lecture's attention_sweep calls it so
            q = torch.randn(a.batch, a.heads, n, a.head_dim, device="cuda", dtype=a.dtype)
            attention.IMPL_FUNCS["triton"](q, q, q)
        done.append(f"Unit 1 FlashAttention (Triton) at N={', '.join(map(str, a.seq_lens))}")
        x = torch.randn(16384, 4096, device="cuda")
        fused.rmsnorm_triton(x, torch.ones(4096, device="cuda"))
        done.append("Unit 4 rmsnorm_triton (16384 × 4096, fp32)")
        torch.cuda.synchronize()
    return done


def build_compile_cache(dest: Path, timeout: float = 1800) -> list[str]:
    """The compile half of ``teraflops warmup``: run :func:`compile_course` in a fresh process with its
    caches in ``dest/compile``, make them readable by all and write the STAMP learners look for
    (last); returns what it compiled.

    The process's ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` are ``dest/compile/inductor``
    and ``dest/compile/triton``; its ``TMPDIR`` is a scratch folder, from which the precompiled
    headers (:func:`header_dir`) move to ``dest/compile/precompiled_headers``. The old STAMP is
    removed first, so learners never seed from a half-built cache.

    Raises:
        CourseError: the compiles failed (the log's last line) or took over ``timeout`` s.
    """
    from .errors import CourseError

    out = Path(dest) / COMPILE
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out))
    log = out / "warmup.log"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor"), "TRITON_CACHE_DIR": str(out / "triton"),
           "TMPDIR": str(scratch), WARM_ENV: str(dest)}  # WARM_ENV: its import seeds nothing (no STAMP)
    proc = None
    try:
        with open(log, "wb") as f:  # a session of its own: Inductor's compile workers go with it
            proc = subprocess.Popen([sys.executable, "-c", "from teraflops.warmup import _main; _main()"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            proc.wait(timeout=timeout)
        lines = log.read_text(errors="replace").strip().splitlines()
        if proc.returncode != 0:
            raise CourseError(f"the course's compiles failed: {lines[-1] if lines else f'exit {proc.returncode}'}. "
                              f"Hint: `teraflops doctor` checks the compiler; the whole log is {log}")
        for headers in scratch.glob("torchinductor_*/precompiled_headers"):
            (out / "precompiled_headers").mkdir(exist_ok=True)
            for path in headers.iterdir():
                if path.is_file():
                    os.replace(path, out / "precompiled_headers" / path.name)
    except subprocess.TimeoutExpired as e:
        raise CourseError(f"the course's compiles were not done after {timeout:g} s. Hint: run it again; the "
                          f"log is {log}") from e
    finally:
        if proc is not None and proc.poll() is None:  # a timeout or an interrupt: its whole session goes
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    done = [ln[len("compiled: "):] for ln in lines if ln.startswith("compiled: ")]
    (out / f"{STAMP}.tmp").write_text(json.dumps({"versions": _versions(), "compiled": done, "at": time.time_ns()}))
    readable_by_all(out)
    os.replace(out / f"{STAMP}.tmp", out / STAMP)  # last: learners seed from a whole cache or none
    return done


def _main() -> None:  # build_compile_cache's process
    for line in compile_course():
        print("compiled:", line, flush=True)


def closed_to_others(paths=None) -> Path | None:
    """The first folder on the way to this Python (its real interpreter and ``sys.prefix``; or ``paths``)
    that other users cannot enter (no search permission for others), else None: learners' kernels, run
    as their own users, cannot start this Python then (a pyenv under a mode-700 ``/root``, say)."""
    import sys

    for target in paths or (os.path.realpath(sys.executable), sys.prefix):
        target = Path(target)
        for folder in [*reversed(target.parents), target]:
            with suppress(OSError):
                if folder.is_dir() and not folder.stat().st_mode & stat.S_IXOTH:
                    return folder
    return None
