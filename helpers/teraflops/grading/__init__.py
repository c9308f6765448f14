"""Autograding: check functions (one module per unit, on :mod:`.core`) and the ``teraflops grade``
runner (:mod:`.grader`) and its report, a table, JSON or JUnit XML (:mod:`.report`).

The only seam between grader and learner: a check function takes the learner's function (or
value) and nothing else, runs it on generated inputs, and compares with the package's reference.
"""
