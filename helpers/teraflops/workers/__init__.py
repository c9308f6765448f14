"""Rank programs: what one rank of a launch runs (``python -m teraflops.workers.NAME --spec PATH``,
started by :func:`teraflops.launch.launcher.launch`). Each reads its Spec with
:func:`teraflops.launch.rank.read_spec` and hands back a Result with
:func:`teraflops.launch.rank.write_result`; what they share is :mod:`.common`."""
