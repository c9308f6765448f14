"""The kernel client the course executes notebooks with: no message waits out a timeout unseen.

nbclient talks to the kernel through jupyter_client's ``AsyncKernelClient``, whose channels wait for
a message with one ``zmq.asyncio`` poll as long as the whole timeout (the cell's 600 s for the
``execute_reply`` on the shell channel). pyzmq's asyncio poll is woken by the socket's file
descriptor, which libzmq signals *edge-triggered*: it says "something changed, look at
``ZMQ_EVENTS``", and any operation on the socket that processes its pending commands clears the
signal even when a message is left unread (pyzmq docs, "zmq.FD": "the ZMQ_FD is edge-triggered";
libzmq ``zmq_getsockopt(3)``, ZMQ_FD). When that happens the poll sleeps through a message that
has arrived, until its timer fires and a last non-blocking check finds the message: the cell ends
exactly one timeout late, with no error. Widget cells make this likely: ``ipywidgets.interactive``
sends a burst of ``comm_open``/``comm_msg`` messages on IOPub while the ``execute_reply`` arrives on
the shell channel, and under load the two interleave (seen as 598 s and 600 s stalls on
``gradient_sync_widget``; upstream: nbclient issue #312 and PR #311, nbconvert #2029).

:class:`SlicedKernelClient` keeps nbclient's logic and timeouts and only changes how long a single
poll may sleep: a channel's ``get_msg(timeout)`` polls in slices of :data:`POLL_SLICE` seconds until
its timeout, and each slice ends with that non-blocking check, so a missed wake-up costs at most one
slice instead of the cell's timeout. :func:`teraflops.launch.notebook.make_client` installs it for
``teraflops run``, ``grade`` and ``labs refresh``. (nbval, which runs the solutions under pytest,
uses jupyter_client's blocking client: its synchronous ``zmq_poll`` reads ``ZMQ_EVENTS`` itself and
does not miss the message; ``tests/test_busy_widgets.py`` runs both beside a hog.)
"""

from __future__ import annotations

import time
from queue import Empty

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from traitlets import Type

__all__ = ["POLL_SLICE", "SlicedChannel", "SlicedKernelClient", "CLIENT_CLASS"]

POLL_SLICE = 0.25  # s: the longest one poll sleeps; a missed wake-up costs at most this


class SlicedChannel(AsyncZMQSocketChannel):
    """An asyncio ZMQ channel whose :meth:`get_msg` waits in :data:`POLL_SLICE` slices."""

    async def get_msg(self, timeout: float | None = None) -> dict:  # type: ignore[override]
        """The next message, waiting at most ``timeout`` seconds (``None``: no limit).

        Raises:
            queue.Empty: no message came within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = POLL_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await super().get_msg(timeout=min(POLL_SLICE, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class SlicedKernelClient(AsyncKernelClient):
    """jupyter_client's ``AsyncKernelClient`` with :class:`SlicedChannel` for every ZMQ channel."""

    shell_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    iopub_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    stdin_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    control_channel_class = Type(SlicedChannel)  # type: ignore[assignment]


CLIENT_CLASS = f"{__name__}.SlicedKernelClient"  # a kernel manager's ``client_class`` (a dotted name)
