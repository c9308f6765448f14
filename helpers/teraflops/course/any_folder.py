"""The course from any folder: a space-free path to this Python environment for native builds.

Two builds the course drives through torch split a path at its spaces: DeepSpeed's CPU op
(``torch.utils.cpp_extension``, pytorch issue #122476) and Inductor's C++ build of ``torch.compile`` on
a CPU (pytorch PR #191010). Both hand the linker torch's library folder unquoted
(``-L<venv>/lib/python3.11/site-packages/torch/lib``), so a virtual environment inside a folder named
``my course`` fails with ``OpBuildFailed`` or ``ld: cannot find``. Home folders and synced drives with
spaces are common on laptops.

The fix here: Python keeps the path it was started from. A virtual environment started through a
symbolic link reports the link as ``sys.prefix`` (CPython's ``getpath`` looks for ``pyvenv.cfg`` beside
the executable *as invoked*), so torch's ``__file__``, and every path the builds derive from it, go
through the link. :func:`space_free_prefix` makes such a link (``<cache>/links/<hash>`` -> ``sys.prefix``)
and :func:`reexec` restarts the current command through it, before torch is imported: the ``teraflops``
command (:mod:`teraflops.course.cli`), and pytest (the repository's ``conftest.py``). The kernels and
ranks they start inherit ``sys.executable``, so they run through the link too. A Jupyter server opened
by hand does not; :func:`problem` is the one line that :mod:`teraflops.course.doctor` and the notebooks'
setup cell print then.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

from teraflops import caches

__all__ = ["UNSAFE", "ENV", "unsafe", "torch_location", "needs_link", "space_free_prefix", "reexec", "problem"]

# characters a build command splits or a shell reads: whitespace, quotes, and the shell's own
UNSAFE = re.compile(r"[\s'\"$`\\;&|<>()*?#!]")
ENV = "TERAFLOPS_SPACE_FREE"  # set by reexec: this process already runs through the link (no loop)


def unsafe(path: str | os.PathLike) -> bool:
    """Whether a build command would split ``path`` or a shell read a character of it."""
    return bool(UNSAFE.search(str(path)))


def torch_location() -> str | None:
    """torch's package folder as Python would import it (its spec, without importing torch); None
    when torch is not installed."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else None


def needs_link(prefix: str | None = None, torch_dir: str | None = None) -> bool:
    """Whether torch's folder has an unsafe character that a link to ``prefix`` (default
    ``sys.prefix``) removes: torch lies inside the environment and only the environment's own path
    is unsafe."""
    prefix = sys.prefix if prefix is None else prefix
    torch_dir = torch_location() if torch_dir is None else torch_dir
    if not torch_dir or not unsafe(torch_dir) or not unsafe(prefix):
        return False
    inside = os.path.relpath(torch_dir, prefix)
    return not inside.startswith("..") and not unsafe(inside)


def _link_folder() -> Path:
    """Where links live: ``<cache>/links`` when the course's cache folder is itself safe, else a
    folder of this user's under the temporary folder."""
    home = caches.cache_dir() / "links"
    if not unsafe(home):
        return home
    return Path(tempfile.gettempdir()) / f"teraflops-links-{os.getuid()}"


def space_free_prefix(prefix: str | None = None, folder: Path | None = None) -> Path:
    """A symbolic link with a safe path to ``prefix`` (default ``sys.prefix``), made if needed:
    ``<folder>/<12 hex digits of the prefix's SHA-1>``. Replaces a link that points elsewhere.

    Raises:
        OSError: the link cannot be made (a read-only cache folder, say).
    """
    prefix = sys.prefix if prefix is None else prefix
    folder = _link_folder() if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / hashlib.sha1(prefix.encode()).hexdigest()[:12]
    if os.path.islink(link) and os.readlink(link) == prefix:
        return link
    tmp = folder / f".{link.name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(prefix, tmp)
    os.replace(tmp, link)  # atomic: another process making the same link meanwhile is harmless
    return link


def reexec(argv: list[str]) -> None:
    """Restart this process as ``<link>/<python> argv...`` when :func:`needs_link`, once (``$TERAFLOPS_SPACE_FREE``
    marks the restarted process); returns without doing anything otherwise, or when no link can be
    made (then :func:`problem` says why). Call it before torch is imported."""
    if os.environ.get(ENV) or not needs_link():
        return
    inside = os.path.relpath(sys.executable, sys.prefix)
    if inside.startswith(".."):
        return
    try:
        link = space_free_prefix()
    except OSError:
        return
    exe = str(link / inside)
    os.environ[ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe, *argv])


def problem(prefix: str | None = None, torch_dir: str | None = None) -> str | None:
    """One line when this Python's torch lies in a folder that native builds split, else None: what
    breaks, and the fix."""
    prefix = sys.prefix if prefix is None else prefix
    torch_dir = torch_location() if torch_dir is None else torch_dir
    if not torch_dir or not unsafe(torch_dir):
        return None
    cause = (f"torch lies in a folder with a space or shell character ({torch_dir}): DeepSpeed's op build and "
             f"torch.compile on CPU split it (upstream PyTorch bug)")
    if needs_link(prefix, torch_dir):
        return (cause + "; `teraflops` commands and pytest run through a space-free link by themselves, a Jupyter "
                "opened by hand does not: start it with `teraflops lab`, or make the venv in a folder without spaces")
    return cause + "; make the virtual environment in a folder without spaces"
