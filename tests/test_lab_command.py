"""``teraflops lab``: JupyterLab on the course folder, loopback only, URL with its token, stops cleanly."""

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from teraflops.course import cli
from teraflops.launch.ports import free_port


def test_lab_command_is_loopback_and_allow_root_only_as_root(tmp_path):
    cmd = cli.lab_command(tmp_path, 8899, "abc")
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--IdentityProvider.token=abc" in cmd
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--no-browser" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)


def _listening(processes):
    """The listening sockets of ``processes``, skipping any that ended since they were listed (JupyterLab
    starts short-lived helpers, e.g. its kernel-spec and extension probes)."""
    for p in processes:
        try:
            yield from (c for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN)
        except psutil.NoSuchProcess:
            continue


@pytest.mark.slow
def test_teraflops_lab_starts_prints_its_url_listens_on_loopback_and_stops_on_ctrl_c():
    port = free_port(18950)
    # Ctrl-C's default action in the child, whatever this runner ignores (pytest started in the background
    # of a script, `cmd &`, runs with SIGINT ignored, and an ignored signal stays ignored across exec)
    proc = subprocess.Popen([sys.executable, "-m", "teraflops", "lab", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "/lab?token=" in line:
                break
        url = re.search(r"http://\S+/lab\?token=(\w+)", "".join(lines))
        assert url, "".join(lines)
        assert url.group(0).startswith(f"http://127.0.0.1:{port}/lab?token=")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={url.group(1)}", timeout=10) as r:
            assert r.status == 200
        server = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        listening = {c.laddr.ip for c in _listening(server) if c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=180)  # a hang guard
        assert proc.returncode == 0 and "JupyterLab stopped" in out
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in server), "JupyterLab left running"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):  # JupyterLab runs in its own session
                child.kill()
            proc.kill()
            proc.wait()
