"""Tensors to Teraflops: helpers for a course on GPU engineering for LLMs.

Importing the package is cheap (it imports neither torch nor Triton, so the ``teraflops`` command
answers at once), yet Triton still runs the right way on this machine: how it runs (compiled on a
GPU, the interpreter on CPU, :func:`teraflops.machine.configure_triton`) is decided before Triton is
first imported, by an import hook, so ``TRITON_INTERPRET`` is set before any ``@triton.jit``
decorator runs. If torch or Triton is already imported, it is decided at once. Where a workshop
host ran ``teraflops warmup``, the import also seeds this user's torch.compile caches from the
host's (:func:`teraflops.caches.seed_compile_caches`; without one it costs one failed ``open``).
Figures take the course's scale (:mod:`teraflops.plots`, ``TERAFLOPS_FIG_SCALE``) once Matplotlib is
imported, by a second hook.
"""

import importlib.abc as _abc
import os as _os
import sys as _sys

# Kineto (torch.profiler's backend) prints two "USDT ... profiler_start/stop" lines to stderr on
# every profile, which the course profiles often; level 6 keeps its log quiet. Must be set before
# the first profile of the process. A value the user set is kept.
_os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class _ConfigureTritonFirst(_abc.MetaPathFinder):
    """Runs ``configure_triton`` when ``triton`` is about to be imported, then lets the usual
    finders import it (PEP 451: a finder returning None passes the import on)."""

    busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" and not type(self).busy:
            type(self).busy = True
            try:
                from teraflops.machine import configure_triton

                configure_triton()
            finally:
                type(self).busy = False
                if self in _sys.meta_path:
                    _sys.meta_path.remove(self)
        return None


if "TRITON_INTERPRET" not in _os.environ:
    if "triton" in _sys.modules or "torch" in _sys.modules:  # cheap now, or too late to wait
        from teraflops.machine import configure_triton as _configure_triton

        _configure_triton()
    elif not any(isinstance(f, _ConfigureTritonFirst) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _ConfigureTritonFirst())

class _StyleFiguresAfterImport(_abc.MetaPathFinder):
    """Applies the course's figure scale (:func:`teraflops.plots.style`) right after ``matplotlib`` is
    imported: the usual finders find it, and its loader's ``exec_module`` is wrapped to style it once run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "matplotlib":
            return None
        _sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _style_or_warn()

        spec.loader.exec_module = exec_module
        return spec


def _style_or_warn() -> None:
    """Style figures; a bad ``TERAFLOPS_FIG_SCALE`` warns (one line) rather than breaking an import."""
    from teraflops.errors import CourseError
    from teraflops.plots import style

    try:
        style()
    except CourseError as e:
        import warnings

        warnings.warn(str(e), stacklevel=3)


if "matplotlib" in _sys.modules:
    _style_or_warn()
elif not any(isinstance(f, _StyleFiguresAfterImport) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _StyleFiguresAfterImport())

from teraflops.errors import install_notebook_hooks as _install_notebook_hooks  # noqa: E402

_install_notebook_hooks()  # an unfinished lab exercise reads as one line in a notebook

from teraflops.caches import seed_compile_caches as _seed_compile_caches  # noqa: E402

_seed_compile_caches()  # a workshop host's `teraflops warmup`: torch.compile finds its kernels built

__version__ = "0.1.0"
__all__ = ["Machine", "detect", "__version__"]


def __getattr__(name):  # PEP 562: teraflops.detect without importing machine (and torch) up front
    if name in ("Machine", "detect"):
        from teraflops import machine

        return getattr(machine, name)
    raise AttributeError(f"module 'teraflops' has no attribute {name!r}")
