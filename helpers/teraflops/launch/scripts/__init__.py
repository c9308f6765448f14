"""Scripts a launch starts by path, without importing the package (which would import torch there too):
the wrapper each rank runs in (``rank_wrapper.py``), a launch's watchdog (``watchdog.py``), and the
process identity both use (``proc_identity.py``, imported from this folder, ``sys.path[0]``)."""
