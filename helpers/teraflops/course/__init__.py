"""Running the course: the ``teraflops`` command (:mod:`.cli`), headless lectures (:mod:`.runner`) and
their report card, labs generated from solutions (:mod:`.labs`), ``doctor``, ``preflight`` and
``warmup``.
"""
