"""Ports on this machine: one the OS has free now, and whether a server could listen on one."""

from __future__ import annotations

import socket

from teraflops.errors import CourseError


def free_port(start: int | None = None, ip: str = "127.0.0.1") -> int:
    """A TCP port that nothing uses now at ``ip``: the one the OS picks (``start`` None: it binds port 0),
    else the first from ``start`` up that nothing listens on (a port a learner can type, e.g. 8888 for
    ``teraflops lab``; ``0.0.0.0`` is probed on 127.0.0.1).

    Raises:
        CourseError: no port free in ``start`` … ``start + 99``.
    """
    if start is None:
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]
    for port in range(start, start + 100):
        with socket.socket() as sock:
            if sock.connect_ex((ip if ip not in ("0.0.0.0", "") else "127.0.0.1", port)) != 0:
                return port
    raise CourseError(f"no free port in {start}-{start + 99}. Hint: pass --port with a free one")


def port_in_use(port: int) -> bool:
    """True if a server could not listen on ``port`` now (binds all addresses with ``SO_REUSEADDR``,
    as torch's TCPStore does, so a finished run's connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
        return False
