"""A warm cache for a workshop: the host compiles once, every learner reads it (``teraflops warmup``).

On CPU every DeepSpeed run needs the ``deepspeed_shm_comm`` C++ op (JIT-built, 1-2 min on 2 cores:
:func:`teraflops.distributed.prepare_deepspeed_ops`). A cache shared *read-write* across Unix users
does not work: ``torch.utils.cpp_extension.load`` takes a lock file in the op's folder on every load
(``FileBaton``, ``torch/utils/file_baton.py``), which a learner cannot create in a folder of another
user. So the host builds into :func:`warm_dir` (``$TERAFLOPS_WARM_CACHE``, default
``/var/cache/teraflops``, made readable by all; :func:`teraflops.distributed.build_warm_cache`), and a learner's first run copies the built op
folder (without the lock) into the learner's own :func:`teraflops.distributed.cache_dir`; ninja
then finds every output up to date (copies keep modification times) and compiles nothing.

The op folder is per Python environment (its path is in the compile command): host and learners
must use the same environment (JupyterHub's single-user servers do).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import suppress
from pathlib import Path

WARM_ENV = "TERAFLOPS_WARM_CACHE"
OP = "deepspeed_shm_comm"


def warm_dir() -> Path:
    """``$TERAFLOPS_WARM_CACHE`` or ``/var/cache/teraflops``: the host's read-only cache for learners."""
    return Path(os.environ.get(WARM_ENV) or "/var/cache/teraflops")


def _stamp_name() -> str:
    import importlib.metadata as md

    return f".built-deepspeed{md.version('deepspeed')}-torch{md.version('torch')}"


def warm_op_dir(ext: Path) -> Path:
    """The warm cache's op folder for extensions folder ``ext`` (same environment key)."""
    return warm_dir() / "torch_extensions" / ext.name / OP


def seed_op(ext: Path) -> bool:
    """Copy the warm cache's built op into ``ext`` (a learner's extensions folder) if it lacks one.

    Returns True if copied. Nothing happens when the warm cache has no built op for this environment
    and these versions, or ``ext`` already has one. The copy goes to a temporary folder first and is
    renamed into place, so two runs of one learner at once see all of it or none.
    """
    source, target = warm_op_dir(ext), ext / OP
    if not (source / _stamp_name()).exists() or (target / _stamp_name()).exists() or source == target:
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
    return (target / _stamp_name()).exists()


def readable_by_all(root: Path) -> None:
    """Add read permission (and search, on folders and executables) for group and others to ``root`` and all below it."""
    for path in [root, *root.rglob("*")]:
        with suppress(OSError):
            mode = path.stat().st_mode
            path.chmod(mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH |
                       ((stat.S_IXGRP | stat.S_IXOTH) if path.is_dir() or mode & stat.S_IXUSR else 0))


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
