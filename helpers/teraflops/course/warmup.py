"""``teraflops warmup``: the workshop host compiles the course once, into a cache every learner reads.

Where the warm cache lives and how a learner's process seeds its own caches from it is
:mod:`teraflops.caches`; this module builds it: DeepSpeed's CPU op (:func:`build_warm_cache`, with
:func:`teraflops.launch.ops.prepare_deepspeed_ops`) and the course's ``torch.compile`` kernels
(:func:`build_compile_cache` running :func:`compile_course` in a fresh process). Run it as root, in
the learners' Python environment and with their environment variables (torch reads a few into its
cache keys); :func:`access_warnings` says where learners could not run this Python
(:func:`closed_to_others`) or import the course (:func:`package_closed_to_others`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import teraflops
from teraflops import caches
from teraflops.caches import COMPILE, STAMP, WARM_ENV, readable_by_all, versions
from teraflops.compilation import decode, fused
from teraflops.errors import CourseError
from teraflops.launch.ops import AIO_BUILD, AioUnavailable, prepare_aio_op, prepare_deepspeed_ops
from teraflops.machine import triton_mode
from teraflops.model_definition import attention
from teraflops.sizing import preset


@contextmanager
def _warm_env(dest: Path):
    """This process's caches pointed at ``dest`` (``TERAFLOPS_CACHE``, the warm cache's variable; no
    ``TORCH_EXTENSIONS_DIR``) while the ops build, restored after."""
    saved = {k: os.environ.get(k) for k in ("TERAFLOPS_CACHE", "TORCH_EXTENSIONS_DIR", caches.WARM_ENV)}
    os.environ["TERAFLOPS_CACHE"], os.environ[caches.WARM_ENV] = str(dest), str(dest)
    os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_warm_cache(dest: Path | None = None) -> Path:
    """The op half of ``teraflops warmup`` (the other: :func:`build_compile_cache`):
    build DeepSpeed's CPU op into ``dest`` (default :func:`teraflops.caches.warm_dir`) and make it
    readable by all.

    Returns the op folder. Raises :class:`~teraflops.launch.ops.OpBuildFailed` if the build fails.
    """
    dest = Path(dest or caches.warm_dir())
    with _warm_env(dest):
        dest.mkdir(parents=True, exist_ok=True)
        ext = caches.extensions_dir()
        prepare_deepspeed_ops(cpu=True)
    (ext / caches.OP / "lock").unlink(missing_ok=True)
    caches.readable_by_all(dest)
    return ext / caches.OP


def build_warm_aio(dest: Path | None = None) -> str:
    """DeepSpeed's ``async_io`` op (Unit 5's NVMe offload, :func:`teraflops.launch.ops.prepare_aio_op`) built
    into ``dest`` as :func:`build_warm_cache` builds the comm op; learners' runs copy it in. Returns one line:
    what was built and where, or why it was skipped (no libaio: the fix).

    Raises :class:`~teraflops.launch.ops.OpBuildFailed` if the build fails.
    """
    dest = Path(dest or caches.warm_dir())
    with _warm_env(dest):
        dest.mkdir(parents=True, exist_ok=True)
        ext = caches.extensions_dir()
        try:
            seconds = prepare_aio_op()
        except AioUnavailable as e:
            return f"skipped DeepSpeed's async_io op (Unit 5's NVMe offload): {e}"
    for folder in AIO_BUILD.folders:
        (ext / folder / "lock").unlink(missing_ok=True)
    caches.readable_by_all(dest)
    took = f" in {seconds:.0f} s" if seconds else " (already built)"
    return f"built DeepSpeed's async_io op{took}: {ext / AIO_BUILD.folder}"


def compile_course() -> list[str]:
    """Run the course's ``torch.compile`` (and, on a GPU, Triton) compiles as its notebooks do on this
    machine, at the sizes :func:`teraflops.sizing.preset` picks here; returns what it compiled.

    * Unit 4 lecture (``notebooks/04_compilation.ipynb``): on a CPU one thread (its first cell),
      :func:`teraflops.compilation.decode.compile_decode` of :func:`teraflops.compilation.decode.decode_model` in fp32 at
      batch 1, then :func:`teraflops.compilation.decode.recompile_demo` for lengths (8, 9, 10) at each ``dynamic``.
    * On a GPU (Triton compiled, not interpreted): Unit 1's FlashAttention kernel at the preset's
      attention shapes and Unit 4's fused RMSNorm kernel at its default shape, fp32.

    Inductor's keys include the generated code, which depends on the thread count and sizes: a
    notebook that compiles differently misses the cache (``tests/test_workshop.py`` checks that the
    lecture still makes these calls).
    """
    import torch

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
            proc = subprocess.Popen([sys.executable, "-c", "from teraflops.course.warmup import _main; _main()"], env=env,
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
    (out / f"{STAMP}.tmp").write_text(json.dumps({"versions": versions(), "compiled": done, "at": time.time_ns()}))
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


def package_closed_to_others(package=None) -> Path | None:
    """The first path that keeps other users from importing the course's own package ``package``
    (default: the folder ``teraflops`` is imported from, ``teraflops.__file__``'s; an editable install
    points into the clone), else None: a folder on the way to it that others cannot enter
    (:func:`closed_to_others`), or the folder it is imported from, the package or a folder or file in it
    that others cannot read (listing a folder needs read and search permission; Python's import lists
    them). A clone in a mode-700 ``mktemp -d`` folder or a home directory, say. ``__pycache__`` is left
    out: Python falls back to the source where it cannot read the bytecode."""
    if package is None:
        package = Path(teraflops.__file__).parent
    package = Path(os.path.realpath(package))
    closed = closed_to_others([package])
    if closed is not None:
        return closed
    listable = stat.S_IROTH | stat.S_IXOTH
    inside = sorted(p for p in package.rglob("*") if "__pycache__" not in p.relative_to(package).parts)
    for path in [package.parent, package, *inside]:
        with suppress(OSError):
            mode = path.stat().st_mode
            if path.is_dir() and mode & listable != listable or path.is_file() and not mode & stat.S_IROTH:
                return path
    return None


def access_warnings(python=None, package=None) -> list[str]:
    """One line for each reason learners, running as other users, could not use what this warmup
    builds: a folder on the way to this Python (``python``: its real interpreter and ``sys.prefix``)
    that they cannot enter, a path of the course's package (``package``, :func:`package_closed_to_others`)
    that they cannot enter or read. Each names the folder or file and what to do."""
    out = []
    closed = closed_to_others(python)
    if closed is not None:
        out.append(f"other users cannot enter {closed}, on the way to this Python ({sys.executable}): learners' "
                   "kernels cannot run it. Hint: install the course's environment where every user can read it "
                   "(e.g. /opt/teraflops)")
    shut = package_closed_to_others(package)
    if shut is not None:
        verb = "enter" if shut.is_dir() and not shut.stat().st_mode & stat.S_IXOTH else "read"
        out.append(f"other users cannot {verb} {shut}, on the way to the course's package: learners cannot import "
                   "teraflops (an editable install points into the clone). Hint: clone the course where every user "
                   f"can read it (e.g. /opt/teraflops), or chmod o+rx the folders on the way")
    return out
