"""Rendezvous that listens on one address: loopback on one machine, the node's own address on a cluster.

Every process group of the course meets in a TCPStore (``torch.distributed.TCPStore``, a key-value
server): torchrun's static rendezvous (``MASTER_ADDR``, ``static_tcp_rendezvous.py``), the c10d
rendezvous backend and the store it shares with the ranks (``c10d_rendezvous_backend.py``,
``dynamic_rendezvous.py``) and ``init_process_group("env://")`` in a rank (``torch/distributed/
rendezvous.py``; how DeepSpeed's launcher starts ranks). Whatever host it is given, the store's
server listens on the wildcard address ``::``, every interface, IPv4 and IPv6 (torch's
``UvTcpServer::makeWithPort`` in ``torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp``, and
``Socket::listen`` in ``socket.cpp`` for the older backend). Measured here before this module: a
two-rank launch's torchrun agent listened on ``[::]:port``, and with DeepSpeed's launcher rank 0 did.
On a workshop machine on a network anyone who reaches it could then talk to a learner's store, join
its process group or disturb it.

TCPStore can take a socket that is already bound and listening instead (``master_listen_fd``, the
file descriptor; its docstring in ``torch/csrc/distributed/c10d/init.cpp``; the libuv backend, the
default, since pytorch PR #150215, torch 2.8 release notes). :func:`install` replaces
``torch.distributed.TCPStore`` in this process with a subclass whose server, when its host is a
loopback address (``127.0.0.1``, ``::1``, ``localhost``) or one of :data:`LISTEN_ENV`'s addresses
(an emulated or real node's own address, set by :func:`teraflops.launch.launcher.launch` and by the
sbatch script, :mod:`teraflops.launch.sbatch`), listens on exactly that address and port. The store closes
the socket when it goes (measured: no listener and no open descriptor is left after ``del store``).
Any other host, a port that is taken (torch's own server of this process on that port is then
reused, ``multi_tenant``, or torch raises its usual "address already in use"), or a store given its
own ``master_listen_fd`` is left to torch as before.

:func:`install` must run in every process that can host a store: the torchrun agent and each
rank. ``python -m teraflops.launch.loopback MODULE ARGS`` is ``python -m MODULE ARGS`` with it installed
first: what launch runs for torchrun (``MODULE`` = ``torch.distributed.run``) and, in
``launch/scripts/rank_wrapper.py``, for each rank. The other sockets of a run follow the interface named for
them: gloo's pairs ``GLOO_SOCKET_IFNAME``, NCCL's bootstrap and socket transport
``NCCL_SOCKET_IFNAME`` (both ``lo`` on one machine, :mod:`teraflops.launch.placement`).
"""

from __future__ import annotations

import ipaddress
import os
import runpy
import socket
import sys
from typing import Sequence

from teraflops.errors import CourseError

LISTEN_ENV = "TERAFLOPS_LISTEN_ADDRS"  # comma-separated node addresses a store may listen on, besides loopback
_PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
           "master_listen_fd", "use_libuv")  # TCPStore.__init__'s parameters, in order (torch/_C/_distributed_c10d.pyi)
_BACKLOG = 16384  # torch's libuv listener backlog (DEFAULT_BACKLOG, TCPStoreLibUvBackend.cpp); the kernel caps it
_MARK = "_teraflops_one_address"


def allowed(environ=None) -> tuple[str, ...]:
    """The node addresses in ``$TERAFLOPS_LISTEN_ADDRS`` (``environ``, default ``os.environ``)."""
    text = (os.environ if environ is None else environ).get(LISTEN_ENV, "")
    return tuple(a for a in text.replace(" ", ",").split(",") if a)


def listen_address(host: str, nodes: Sequence[str] = ()) -> tuple[int, str] | None:
    """``(family, address)`` a store server for ``host`` listens on: the first address ``host``
    resolves to (``getaddrinfo``) that is a loopback address or one of ``nodes``; None if none is
    (a host this module leaves to torch) or it does not resolve."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, addr in found:
        ip = addr[0]
        try:
            loopback = ipaddress.ip_address(ip).is_loopback
        except ValueError:
            continue
        if loopback or ip in nodes:
            return family, ip
    return None


def listener(host: str, port: int, nodes: Sequence[str] | None = None) -> socket.socket | None:
    """A TCP socket listening on exactly :func:`listen_address` of ``host`` and ``port`` (0: one the
    OS picks), with ``SO_REUSEADDR`` as torch's own listener has it; None where that address is
    None or cannot be bound (``port`` taken: torch's own code then decides, as without this module).
    ``nodes`` default: :func:`allowed`."""
    found = listen_address(host, allowed() if nodes is None else nodes)
    if found is None:
        return None
    family, ip = found
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        return None
    return sock


def _bound(base):
    """``base`` (torch's TCPStore) with a server that listens on one address (see the module docstring)."""

    class TCPStore(base):
        __doc__ = (f"torch's TCPStore whose server listens on its host's address only when that is a loopback "
                   f"or node address (teraflops.launch.loopback).\n\n{base.__doc__ or ''}")

        def __init__(self, *args, **kwargs):
            params = {**dict(zip(_PARAMS, args)), **kwargs}
            sock = None
            if params.get("is_master") and params.get("master_listen_fd") is None and "host_name" in params:
                sock = listener(str(params["host_name"]), int(params.get("port", 0)))
            if sock is None:
                super().__init__(*args, **kwargs)
                return
            inode = os.fstat(sock.fileno()).st_ino
            params.update(port=sock.getsockname()[1], master_listen_fd=sock.detach())  # the store owns it now
            try:
                super().__init__(**params)
            except BaseException:
                fd = params["master_listen_fd"]
                try:  # still our socket (torch failed before taking it): close it, or it keeps the port
                    if os.fstat(fd).st_ino == inode:
                        os.close(fd)
                except OSError:
                    pass
                raise

    setattr(TCPStore, _MARK, True)
    TCPStore.__module__, TCPStore.__qualname__ = __name__, "TCPStore"
    return TCPStore


TORCH_FLOOR = (2, 8)  # master_listen_fd served by the libuv TCPStore backend (pytorch PR #150215, torch 2.8)


def check_torch(version: str | None = None) -> None:
    """Raise if this torch (``torch.__version__``, or ``version``) is older than :data:`TORCH_FLOOR`:
    before 2.8 the default (libuv) TCPStore ignores a pre-bound ``master_listen_fd``, so every launch
    would hang at its rendezvous instead of failing.

    Raises:
        CourseError: one line naming the version and the fix.
    """
    if version is None:
        import torch  # lazy: the launcher's command-line path imports no torch until it launches

        version = torch.__version__
    parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    if parts < TORCH_FLOOR:
        raise CourseError(f"torch {version} is older than the course's floor, torch "
                          f"{'.'.join(map(str, TORCH_FLOOR))}: its TCPStore would leave every launch hanging at the "
                          "rendezvous (pytorch PR #150215). Hint: pip install torch==2.13.0")


def install() -> None:
    """Make every TCPStore server this process creates from now on listen on one address (module
    docstring). Replaces ``torch.distributed.TCPStore`` and the name in the ``torch.distributed``
    modules already imported that hold it (``from torch.distributed import TCPStore``); idempotent.
    Imports ``torch.distributed``.

    Raises:
        CourseError: torch older than :data:`TORCH_FLOOR` (:func:`check_torch`)."""
    import torch.distributed as dist

    check_torch()

    base = dist.TCPStore
    if getattr(base, _MARK, False):
        return
    bound = _bound(base)
    for name, module in list(sys.modules.items()):
        if (name == "torch.distributed" or name.startswith("torch.distributed.")) and \
                getattr(module, "TCPStore", None) is base:
            module.TCPStore = bound


def installed() -> bool:
    """True if :func:`install` ran in this process (``torch.distributed.TCPStore`` is the bound one)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and getattr(getattr(dist, "TCPStore", None), _MARK, False)


def run_module(argv: Sequence[str]) -> None:
    """``python -m argv[0] argv[1:]`` in this process, with :func:`install` done first."""
    if not argv:
        raise SystemExit("usage: python -m teraflops.launch.loopback MODULE [ARGS...]")
    install()
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    from teraflops.launch import loopback  # lazy: under -m this file is __main__; one module object keeps install's state

    loopback.run_module(sys.argv[1:])
