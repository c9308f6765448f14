"""Unit 3 · Runtime orchestration: why are 30 % of my GPUs idle? Stragglers, their detection and the
tail at scale, elastic restart from checkpoints, and the cluster queue (simulated in
:mod:`.queue_sim`, real Slurm in :mod:`.slurm_queue`).
"""
