"""Unit 6 · Triage, the capstone: is this workload compute-, memory-, overhead- or communication-bound,
or waiting? The verdict from a profile (:mod:`.verdict`), the workloads it is tried on, and rank
traces.
"""
