"""Process identity without torch: imported by the torch-free scripts ``rank_wrapper.py`` and
``watchdog.py`` (from their own folder) and by :mod:`teraflops.launch.leftovers`."""


def proc_start(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot; man ``proc(5)``), or None:
    with the pid, it names a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
