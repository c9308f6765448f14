"""Unit 3 §5′: placement groups and fragmentation, from Ray's side.

A job that needs several GPUs asks Ray for a **placement group**: a list of *bundles* (here one
``{"GPU": 1}`` each) reserved atomically, all or none, with a *strategy*
(https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html):

* ``STRICT_PACK``: every bundle on one node (what tensor parallelism over NVLink needs);
* ``PACK``: on as few nodes as possible, spilling over when one node cannot hold them;
* ``SPREAD``: over different nodes where possible, on the same node otherwise;
* ``STRICT_SPREAD``: every bundle on a different node.

A group that cannot be placed now stays **PENDING** (Ray's GCS retries it as resources free up); it
never holds part of what it asked for. So free GPUs scattered one per node are useless to a
``STRICT_PACK`` job of two: the same fragmentation as Slurm's stranded GPUs (§5's simulation and the
real Slurm queue), seen from Ray.

:func:`placeable` is the decision, on the free GPUs per node (pure, the tests' subject). :func:`run`
shows it on an up Ray cluster (:class:`teraflops.nodes.cluster.Cluster` with 3 nodes × 2 fake GPUs,
:mod:`teraflops.nodes.ray`): one GPU taken on every node by a one-bundle group pinned there
(``{"GPU": 1, "node:<address>": 0.01}``: Ray's per-node resource), then a 2-GPU ``STRICT_PACK`` group
(pending: 3 GPUs free, at most one per node), a 2-GPU ``SPREAD`` group (placed at once, on two
nodes), and, after the ``SPREAD`` group and the filler of node 1 are removed, the ``STRICT_PACK``
group placed on node 1. Every state is read from Ray's GCS (``ray.util.placement_group_table``,
``ray.available_resources``-per-node via ``ray.state``), and ``ray status``'s demand line is quoted
while the group waits. The driver runs inside node 0 (``python -m
teraflops.orchestration.placement_groups``), as any Ray driver on the cluster.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass

from teraflops.errors import CourseError
from teraflops.nodes.ray import ray_command
from teraflops.tables import table

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
WAIT_S = 3.0  # how long the driver lets a group try before calling it pending (Ray places a fitting one in ms)


class PlacementError(CourseError, RuntimeError):
    """The placement-group demo could not run or read Ray's answer; one line with a hint."""


def _check_request(strategy: str, bundles: int, free: dict) -> None:
    if strategy not in STRATEGIES:
        raise PlacementError(f"unknown strategy {strategy!r}. Hint: one of {', '.join(STRATEGIES)}.")
    if bundles < 1 or any(v < 0 for v in free.values()):
        raise PlacementError(f"bundles must be ≥ 1 and free GPUs ≥ 0, got {bundles}, {free}. "
                             "Hint: placeable('SPREAD', 2, {'a': 1, 'b': 1}).")


def placeable(strategy: str, bundles: int, free: dict[str, int]) -> list[str] | None:
    """Where Ray can place ``bundles`` one-GPU bundles with ``strategy`` on ``free`` GPUs per node (node →
    whole free GPUs): the node of each bundle, or None when the group must wait (PENDING).

    STRICT_PACK needs one node with ``bundles`` free; STRICT_SPREAD ``bundles`` nodes with one free each;
    PACK and SPREAD place whenever the total suffices (PACK filling the freest node first, SPREAD one per
    node round-robin over the nodes with room). Which node Ray picks among equals is its own choice: the
    tests and the lecture compare whether a group is placed and how many nodes it uses, not node names.
    """
    _check_request(strategy, bundles, free)
    left = dict(free)
    if strategy == "STRICT_PACK":
        node = max((n for n in left if left[n] >= bundles), key=lambda n: left[n], default=None)
        return None if node is None else [node] * bundles
    if strategy == "STRICT_SPREAD":
        nodes = [n for n in sorted(left, key=lambda n: -left[n]) if left[n] >= 1][:bundles]
        return nodes if len(nodes) == bundles else None
    if sum(left.values()) < bundles:
        return None
    out: list[str] = []
    while len(out) < bundles:
        if strategy == "PACK":
            node = max(left, key=lambda n: left[n])
            take = min(left[node], bundles - len(out))
            out += [node] * take
            left[node] -= take
        else:  # SPREAD: one per node with room, round after round
            for node in [n for n in sorted(left) if left[n] > 0][:bundles - len(out)]:
                out.append(node)
                left[node] -= 1
    return out


@dataclass(frozen=True)
class Step:
    """One moment of the demo: what was done, each group's state (``PENDING``/``CREATED``/``REMOVED``) and
    nodes (addresses of its bundles, empty while pending), free GPUs per node after it, and the decision
    :func:`placeable` predicted for the group just asked for (``None`` = pending; [] when nothing asked)."""

    what: str
    groups: dict
    free: dict
    predicted: list | None


@dataclass(frozen=True)
class PlacementRun:
    """The demo's steps in order, and ``ray status``'s lines about demands while the packed group waited."""

    steps: list
    status_pending: str

    def step(self, what: str) -> Step:
        return next(s for s in self.steps if s.what.startswith(what))

    def packed_waited_then_placed(self) -> bool:
        """STRICT_PACK pending while the free GPUs were one per node, created on one node once a node freed up."""
        asked, freed = self.step("ask STRICT_PACK"), self.step("free node")
        return (asked.groups["STRICT_PACK"]["state"] == "PENDING"
                and freed.groups["STRICT_PACK"]["state"] == "CREATED"
                and len(set(freed.groups["STRICT_PACK"]["nodes"])) == 1)

    def spread_placed_at_once(self) -> bool:
        s = self.step("ask SPREAD")
        return s.groups["SPREAD"]["state"] == "CREATED" and len(set(s.groups["SPREAD"]["nodes"])) == 2

    def predictions_match(self) -> bool:
        """Every asked group's state and number of nodes as :func:`placeable` predicted."""
        for s in self.steps:
            name = s.what.split()[1] if s.what.startswith("ask ") else None
            if name is None:
                continue
            g = s.groups[name]
            if (s.predicted is None) != (g["state"] == "PENDING"):
                return False
            if s.predicted is not None and len(set(s.predicted)) != len(set(g["nodes"])):
                return False
        return True


def table_of(r: PlacementRun) -> str:
    """One row per step: the action, free GPUs per node after it, each demo group's state and nodes."""
    rows = []
    for s in r.steps:
        groups = "; ".join(f"{k}: {v['state'].lower()}" + (f" on {', '.join(sorted(set(v['nodes'])))}" if v["nodes"] and v["state"] != "REMOVED" else "")
                           for k, v in s.groups.items() if k in ("STRICT_PACK", "SPREAD"))
        rows.append((s.what, " ".join(f"{n}:{g:g}" for n, g in sorted(s.free.items())), sum(s.free.values()),
                     groups or "—"))
    return table(rows, ["step", "free GPUs per node", "free in all", "2-GPU groups"])


# ---- the driver (inside node 0, with RAY_ADDRESS) ----------------------------------------------------------------


def _free_gpus(ray) -> dict[str, float]:
    """Free GPUs per live node address, from the GCS (Ray's per-node available resources)."""
    from ray._private.state import state  # the same table ``ray status`` and ray.available_resources() read

    ids = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    per_node = state.available_resources_per_node()
    return {addr: float(per_node.get(nid, {}).get("GPU", 0.0)) for nid, addr in ids.items()}


def _groups(ray, handles: dict) -> dict:
    from ray.util import placement_group_table

    ids = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    out = {}
    for name, pg in handles.items():
        t = placement_group_table(pg)
        nodes = [ids.get(v, v) for _, v in sorted(t.get("bundles_to_node_id", {}).items()) if v.strip("f0")]
        out[name] = {"state": t.get("state", "?"), "nodes": nodes}
    return out


def drive(wait_s: float = WAIT_S) -> dict:
    """The demo on the cluster at ``RAY_ADDRESS`` (module docstring); its :class:`PlacementRun` as a dict."""
    import ray  # lazy: only in the driver, inside a node
    from ray.util import placement_group, remove_placement_group

    ray.init(log_to_driver=False)
    steps, handles, status = [], {}, ""

    def record(what, predicted):
        time.sleep(0.5)  # the GCS's resource view follows a placement within its report period
        steps.append({"what": what, "groups": _groups(ray, handles), "free": _free_gpus(ray), "predicted": predicted})

    try:
        nodes = sorted(_free_gpus(ray))
        for i, addr in enumerate(nodes):  # one GPU taken on every node: the fragmented cluster
            handles[f"filler{i}"] = pg = placement_group([{"GPU": 1, f"node:{addr}": 0.01}], strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=60)
        record("take 1 GPU on every node", [])
        for strategy in ("STRICT_PACK", "SPREAD"):
            free = {n: int(g) for n, g in _free_gpus(ray).items()}
            predicted = placeable(strategy, 2, free)
            handles[strategy] = pg = placement_group([{"GPU": 1}, {"GPU": 1}], strategy=strategy)
            pg.wait(wait_s)
            if strategy == "STRICT_PACK":
                done = subprocess.run([*ray_command(), "status"], capture_output=True, text=True, timeout=60)
                status = "\n".join(x for x in done.stdout.splitlines() if "GPU" in x and ("{" in x or "*" in x))
            record(f"ask {strategy} 2 × 1 GPU", predicted)
        remove_placement_group(handles["SPREAD"])
        remove_placement_group(handles["filler1"])
        handles.pop("filler1")
        ready = handles["STRICT_PACK"].wait(60)
        record("free node 1 (remove SPREAD and node 1's filler)" + ("" if ready else ": still pending"), None)
    finally:
        for pg in handles.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - removed already
                pass
    return {"steps": steps, "status_pending": status}


def run(cluster, timeout: float = 180) -> PlacementRun:
    """The demo on ``cluster`` (up, with Ray and at least 1 fake GPU per node; its Ray stays up).

    Raises:
        PlacementError: the driver failed or did not answer within ``timeout`` s (quoting its last lines).
    """
    try:
        done = cluster.ray_.exec([sys.executable, "-m", __name__], timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PlacementError(f"the placement-group driver did not finish within {timeout:g} s. Hint: a busy "
                             "machine starts Ray drivers slowly; run it again when the load is lower.") from None
    found = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not found:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-500:]
        raise PlacementError(f"the placement-group driver failed (exit {done.returncode}): {tail}")
    data = json.loads(found[-1])
    return PlacementRun([Step(**s) for s in data["steps"]], data["status_pending"])


def main(argv: list[str] | None = None) -> None:
    """Run :func:`drive` and print its result as one JSON line."""
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--wait", type=float, default=WAIT_S)
    args = a.parse_args(argv)
    print(json.dumps(drive(args.wait)))


if __name__ == "__main__":
    main()
