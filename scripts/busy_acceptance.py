"""The busy-machine acceptance beside the hog, run once by hand: a benchmark against real load, not a test
(CI runs a shorter widget version in tests/test_busy_widgets.py; preflight's triage judgment, busy or
against ceilings that are not trusted, is tested on given verdicts in tests/test_busy_verdicts.py).

    PYTHONPATH=helpers python scripts/busy_acceptance.py --widget-runs 20 --preflight-runs 10

Each widget run executes tests/test_busy_widgets.py's runner test (``--widget-cells`` widget cells
beside the hog); each preflight run is ``teraflops preflight --only triage`` beside the hog. Prints
one line per run and a tally; exits 1 on a stalled widget run or a wrong preflight verdict (a FAIL line:
a wrong verdict that neither the load nor the ceilings' trust explained; an inconclusive "??" line says
which of them it rests on).
``--plain`` runs the widget test with jupyter_client's own client (the stall before the fix).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hog import hog  # noqa: E402

WIDGET_TEST = "tests/test_busy_widgets.py::test_many_widget_cells_beside_a_hog_never_wait_out_the_timeout"


def widget_runs(runs: int, env: dict) -> int:
    """Run the widget test ``runs`` times (it starts its own hog); the number that failed."""
    bad = 0
    for i in range(runs):
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-o", "addopts=-p no:cacheprovider",
                              WIDGET_TEST], cwd=ROOT, env=env, capture_output=True, text=True)
        bad += out.returncode != 0
        stalls = [ln.strip() for ln in out.stdout.splitlines() if "waited" in ln][:2]
        print(f"widgets {i + 1}: {'ok' if out.returncode == 0 else 'FAIL'} in {time.monotonic() - start:.0f} s "
              f"{stalls or ''}", flush=True)
    return bad


def preflight_runs(runs: int, env: dict) -> dict:
    """``teraflops preflight --only triage`` ``runs`` times beside the hog: ok / inconclusive / WRONG counts."""
    tally: dict[str, int] = {}
    with hog(), tempfile.TemporaryDirectory(prefix="busy-acceptance-") as out_dir:
        for i in range(runs):
            out = subprocess.run([sys.executable, "-m", "teraflops", "preflight", "--only", "triage", "--out", out_dir],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.split()[:2] in (["ok", "triage"], ["??", "triage"],
                                                                                     ["FAIL", "triage"])),
                        out.stdout[-200:]).strip()
            kind = "ok" if line.startswith("ok") else "inconclusive" if line.startswith("??") else "WRONG"
            tally[kind] = tally.get(kind, 0) + 1
            print(f"preflight {i + 1}: {kind}: {line}", flush=True)
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widget-runs", type=int, default=20)
    ap.add_argument("--widget-cells", type=int, default=60)
    ap.add_argument("--preflight-runs", type=int, default=10)
    ap.add_argument("--plain", action="store_true", help="jupyter_client's own AsyncKernelClient (before the fix)")
    args = ap.parse_args()
    env = {**os.environ, "TERAFLOPS_BUSY_WIDGET_CELLS": str(args.widget_cells)}
    if args.plain:
        env["TERAFLOPS_BUSY_CLIENT"] = "plain"
    bad = widget_runs(args.widget_runs, env)
    tally = preflight_runs(args.preflight_runs, env)
    print(f"widget runs failed: {bad}/{args.widget_runs}; preflight triage: {tally}")
    return 1 if bad or tally.get("WRONG") else 0


if __name__ == "__main__":
    sys.exit(main())
