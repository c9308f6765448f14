"""Emulated nodes: a cluster on one machine (network namespaces joined by shaped links,
:mod:`.cluster`) and the real Slurm that runs on them (:mod:`.slurm`)."""
