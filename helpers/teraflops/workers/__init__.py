"""Worker modules: programs one rank runs, started by :func:`teraflops.distributed.launch`."""
