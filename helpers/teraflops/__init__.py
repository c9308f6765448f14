"""Tensors to Teraflops: helpers for a course on GPU engineering for LLMs.

Importing the package decides how Triton runs on this machine (compiled on a GPU, the
interpreter on CPU) before any kernel is defined; see :mod:`teraflops.machine`.
"""

import os as _os

from .machine import configure_triton as _configure_triton

# Kineto (torch.profiler's backend) prints two "USDT ... profiler_start/stop" lines to stderr on
# every profile, which the course profiles often; level 6 keeps its log quiet. Must be set before
# the first profile of the process. A value the user set is kept.
_os.environ.setdefault("KINETO_LOG_LEVEL", "6")

_configure_triton()

from .machine import Machine, detect  # noqa: E402
from .errors import install_notebook_hooks as _install_notebook_hooks  # noqa: E402

_install_notebook_hooks()  # an unfinished lab exercise reads as one line in a notebook

__version__ = "0.1.0"
__all__ = ["Machine", "detect", "__version__"]
