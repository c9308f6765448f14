"""Unit 2 · Parallelization: are my GPUs exchanging information efficiently? Model-state memory,
DeepSpeed ZeRO 0-3 run for real against the paper, stale gradients and all-reduce overlap.
"""
