"""The launch machinery: multi-process runs started with torchrun, the DeepSpeed launcher or a Slurm
batch job (:mod:`.launcher`), where ranks go (:mod:`.placement`), the typed wire format between a
notebook and its ranks (:mod:`.wire`), loopback-only rendezvous (:mod:`.loopback`), a dead launch's
leftovers (:mod:`.leftovers`), the batch script (:mod:`.sbatch`) and the launcher's self-test
(:mod:`.selftest`).
"""
