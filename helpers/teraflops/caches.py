"""A warm cache for a workshop: the host compiles once, every learner reads it (``teraflops warmup``).

Two things compile on a learner's first run, both JIT, both slow on a few cores:

* **DeepSpeed's CPU op** ``deepspeed_shm_comm``: every DeepSpeed run on CPU loads it (C++, 1-2 min on
  2 cores: :func:`teraflops.launch.ops.prepare_deepspeed_ops`).
* **torch.compile's kernels** (Unit 4, :func:`teraflops.compilation.decode.compile_decode` and the
  recompilation demo): Inductor's generated C++ (CPU) or Triton (GPU) kernels, and on a CPU a
  ~150 MB precompiled header of torch's kernel prelude (``torch/csrc/inductor/cpp_prefix.h``).

A cache shared *read-write* across Unix users does not work: torch takes lock files beside what it
builds (``torch.utils.cpp_extension.load``'s ``FileBaton`` in the op's folder,
``torch/utils/file_baton.py``; Inductor's ``FileLock`` under ``<cache>/locks`` and
``precompiled_headers/locks``, ``torch/_inductor/codecache.py``), which a learner cannot create in a
folder of another user. So the host builds into :func:`warm_dir` (``$TERAFLOPS_WARM_CACHE``, default
``/var/cache/teraflops``, made readable by all: :func:`teraflops.course.warmup.build_warm_cache` and
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
import stat
import subprocess
import sys
import tempfile
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


def extensions_dir() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else one folder per Python environment under :func:`cache_dir`: where
    torch JIT-builds C++ ops (DeepSpeed's CPU comm op, :mod:`teraflops.launch.ops`).

    torch's JIT build is keyed by its compile command, which names the environment's paths: two
    virtual environments sharing a folder would rebuild the op in turn, inside a launch's ranks.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return cache_dir() / "torch_extensions" / env_key()


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


def versions() -> dict[str, str]:
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
    if not isinstance(meta, dict) or meta.get("versions") != versions():
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
