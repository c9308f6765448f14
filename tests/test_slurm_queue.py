"""The queue on a real Slurm (teraflops.slurm_queue) on emulated nodes.

The cluster tests need Linux, root, iproute2 and the Slurm, MUNGE, slurmdbd and MariaDB packages
(``teraflops.slurm.INSTALL``); they skip with the one-line reason elsewhere.
"""

import sys

import pytest

from teraflops import cluster as cl
from teraflops import slurm as sl

REASON = (cl.unavailable() or sl.unavailable(accounting=True)) if sys.platform == "linux" else "needs Linux"
NEEDS_ACCOUNTING = pytest.mark.skipif(REASON is not None, reason=f"Slurm with accounting unavailable: {REASON}")


@pytest.mark.slow
@NEEDS_ACCOUNTING
def test_fair_share_starts_the_light_accounts_job_first_though_submitted_second():
    from teraflops.slurm_queue import run_fair_share

    with cl.Cluster(2, slurm=sl.SlurmConfig(accounting=True)) as cluster:
        run = run_fair_share(cluster.slurm_)
    heavy, light = run.heavy, run.light
    assert run.light_first, f"starts {run.starts}, fair-share factors {run.priorities}, usage {run.usage}"
    assert run.starts[heavy] - run.starts[light] >= 1  # the heavy job waited for the light one's nodes
    # the history job is charged when it ends (AccountingStorageEnforce=limits; without it RawUsage
    # stayed 0), and the usage shown before the contested jobs ran adds the blocker's so far
    assert run.history_usage[heavy] > 0 and run.history_usage[light] == 0, run.history_usage
    assert run.usage[heavy] >= run.history_usage[heavy] and run.usage[light] == 0, run.shares
    assert run.priorities[light] > run.priorities[heavy], run.priorities
    assert run.waited_s < 10  # the restart's pass, not a PriorityCalcPeriod of a minute
