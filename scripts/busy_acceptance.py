"""Issue 29's acceptance beside the hog, run once by hand (CI runs shorter versions in
tests/test_busy_widgets.py and tests/test_busy_verdicts.py).

    python scripts/busy_acceptance.py --widget-runs 20 --preflight-runs 10

Each widget run executes tests/test_busy_widgets.py's runner test (``TERAFLOPS_BUSY_WIDGET_CELLS``
widget cells beside the hog); each preflight run is ``teraflops preflight --only triage`` beside the hog.
Prints one line per run and a tally. ``--plain`` runs the widget test with jupyter_client's own client
(the stall before the fix).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hog import hog  # noqa: E402


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
    bad = 0
    for i in range(args.widget_runs):  # the test starts its own hog (module fixture)
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-o", "addopts=-p no:cacheprovider",
                              "tests/test_busy_widgets.py::test_many_widget_cells_beside_a_hog_never_wait_out_the_timeout"],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        bad += out.returncode != 0
        tail = [ln for ln in out.stdout.splitlines() if "STALLED" in ln or "waited" in ln][:2]
        print(f"widgets {i + 1}: {'ok' if out.returncode == 0 else 'FAIL'} {time.monotonic() - t:.0f} s {tail}", flush=True)
    tally = {}
    with hog():
        for i in range(args.preflight_runs):
            out = subprocess.run([sys.executable, "-m", "teraflops", "preflight", "--only", "triage",
                                  "--out", f"/tmp/busy-acceptance-preflight-{os.getpid()}"],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if " triage " in ln), out.stdout[-200:])
            kind = "ok" if line.startswith("ok") else "inconclusive" if line.startswith("??") else "WRONG"
            tally[kind] = tally.get(kind, 0) + 1
            print(f"preflight {i + 1}: {kind}: {line.strip()}", flush=True)
    print(f"widget runs failed: {bad}/{args.widget_runs}; preflight: {tally}")
    return 1 if bad or tally.get("WRONG") else 0


if __name__ == "__main__":
    sys.exit(main())
