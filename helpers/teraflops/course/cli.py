"""The ``teraflops`` command (also ``python -m teraflops``).

Subcommands::

    teraflops run [UNIT ...] [--out build] [--no-html] [--timeout S]
                                        execute lecture notebooks, print the summary table, write
                                        the report card (build/report_card.html)
    teraflops doctor                    versions, devices, compilers and what is skipped here
    teraflops preflight [--only CHECK]  every GPU path at small sizes, before a session (exit 0 if all pass)
    teraflops preflight --list          the checks, the GPUs each needs and whether only with --full; runs none
    teraflops lab [--port P] [--ip A]   start JupyterLab on the course folder, on loopback by default,
                                        and print its URL with the token
    teraflops grade NOTEBOOK [--unit N] [--json] [--out FILE.json|FILE.xml]
                                        check a lab notebook's exercises (any file name); --out writes
                                        the report (JSON or JUnit XML, naming the learner) for a host
    teraflops bench attention [...]     Triton FlashAttention vs SDPA on this machine, as ratios
    teraflops labs build|check|refresh  generate labs/ from solutions/, check they agree, or
                                        (maintainers) re-execute notebooks keeping nbval-checked outputs
    teraflops site [--build build] [--out build/site]
                                        the course site: the executed lectures, the labs and the report
                                        card as static HTML, offline (Sphinx + MyST-NB)
    teraflops setup-cells [--check]     (maintainers) write every notebook's setup cell and Colab/Binder
                                        links from pyproject's Source, or check they are current
    teraflops cluster up|down|status [--nodes K] [--rate MB/s] [--slurm [--scheduler fifo|backfill]
                                        [--accounting] [--gpus-per-node N]] [--ray]
                                        emulated nodes on this machine (root, Linux), optionally with a
                                        Slurm cluster and/or a Ray cluster on them: make them, remove
                                        every leftover (also after a crash), or list them with their
                                        Slurm daemons and Ray processes
    teraflops cluster exec [--name N] [--node I] -- CMD ...
                                        run CMD as on node I (default 0, Slurm's login node) with the
                                        cluster's SLURM_CONF: sinfo, squeue, sbatch, srun, sacct
                                        (and RAY_ADDRESS: ray status)
    teraflops triage TRACE [--waits WAITS.json] [--peak-flops F --bandwidth B] [--launch-floor S]
                                        compute-, memory-, overhead- or communication-bound, or
                                        waiting on a straggler? from a torch.profiler trace
    teraflops demo [MODE ...] [--warm] [--out DIR] [--record DIR] [--fallback DIR] [--scale S]
                                        one failure mode per command, for a talk: one large figure
                                        and one sentence of verdict each (attention, zero, straggler,
                                        compile, interconnect, triage; default all)

Exit codes: 0 success; 1 a notebook failed (a cell, or a measurement contradicting the lecture's
story: teraflops.course.stories), a check failed or labs are out of sync;
2 a usage or course error, printed as one line ``error: ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from teraflops.errors import CourseError
from teraflops.course import any_folder

__all__ = ["main", "build_parser", "lab_command"]


def build_parser() -> argparse.ArgumentParser:
    from teraflops.nodes.slurm import INSTALL, SCHEDULERS  # the standard library only

    parser = argparse.ArgumentParser(
        prog="teraflops",
        description="Tensors to Teraflops: run, check and grade the course on this machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="execute lecture notebooks headless and summarise them")
    run.add_argument("units", nargs="*", type=int, metavar="UNIT",
                     help="unit numbers to run, e.g. 1 3 (default: all)")
    run.add_argument("--out", default="build",
                     help="folder for executed notebooks and HTML (default: build)")
    run.add_argument("--no-html", action="store_true", help="do not write HTML renderings")
    run.add_argument("--timeout", type=int, default=600, metavar="S",
                     help="seconds a single cell may run (default: 600)")

    sub.add_parser("doctor", help="report versions, devices and what is skipped on this machine")

    preflight = sub.add_parser("preflight", help="exercise every GPU path at small sizes before a session "
                                                 "(a table of checks; exit 0 only if all pass)")
    preflight.add_argument("--out", default="build/preflight", help="folder for results.json (default: build/preflight)")
    preflight.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names as in the table)")
    preflight.add_argument("--full", action="store_true", help="also each unit's GPU-preset launches and the memory "
                                                              "check (GPU-only ones skipped on a CPU, with the reason)")
    preflight.add_argument("--list", action="store_true", help="print the checks (name, GPUs needed, --full only, "
                                                              "what each does here, what it covers) and run none")

    lab = sub.add_parser("lab", help="start JupyterLab on the course folder (loopback only by default)")
    lab.add_argument("--port", type=int, default=8888, help="port (default: 8888, or the next free one)")
    lab.add_argument("--ip", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it)")

    grade = sub.add_parser("grade", help="grade a lab notebook")
    grade.add_argument("notebook", type=Path, metavar="NOTEBOOK")
    grade.add_argument("--timeout", type=int, default=120, metavar="S",
                       help="seconds a single cell may run before it is interrupted (default: 120)")
    grade.add_argument("--unit", type=int, metavar="N",
                       help="the lab's unit (default: the notebook's metadata, else its NN_ file-name prefix)")
    grade.add_argument("--json", action="store_true",
                       help='print one JSON object {"notebook", "unit", "learner", "checks": [{"name", "passed", '
                            '"message"}], "passed", "total"} instead of the table')
    grade.add_argument("--out", type=Path, metavar="FILE",
                       help="also write the report to FILE: FILE.json (the --json object) or FILE.xml (JUnit XML, "
                            "one testcase per exercise), for a workshop host to gather")

    bench = sub.add_parser("bench", help="benchmark the course's Triton FlashAttention against SDPA")
    bench.add_argument("what", choices=["attention"])
    bench.add_argument("--seq-len", type=int, nargs="+", help="default: the largest of this machine's preset")
    bench.add_argument("--batch", type=int)
    bench.add_argument("--heads", type=int)
    bench.add_argument("--head-dim", type=int)
    bench.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="default: the preset's (fp32 on CPU)")
    bench.add_argument("--naive", action="store_true", help="include naive attention")

    labs = sub.add_parser("labs", help="build labs from solutions, or check they are in sync")
    labs.add_argument("action", choices=["build", "check", "refresh"])

    cluster = sub.add_parser("cluster", help="emulated nodes on this machine (optionally running Slurm): "
                                             "up, down (yours and leftovers), status, exec")
    actions = cluster.add_subparsers(dest="action", metavar="ACTION", required=True)
    name_help = "the cluster's name (letters, digits): default cli<pid of your login shell>"
    owner_help = ("the process that owns your clusters (default: your login session's leader, the shell of your "
                  "terminal, as `ps -o sess` shows; also under sudo, timeout, make or a script), e.g. --owner $$")
    up = actions.add_parser("up", help="make K nodes (owned by your login session), optionally with Slurm on them",
                            description="Make K emulated nodes (network namespaces on one bridge), owned by "
                                        "your login session (its leader: your terminal's shell). With --slurm also "
                                        "start a Slurm cluster on them: munged and slurmctld on node 0 (the login "
                                        "node), one slurmd per node, and with "
                                        "--accounting MariaDB and slurmdbd; they keep running after this command "
                                        "returns, until `teraflops cluster down`. With --ray a Ray cluster: "
                                        "its head on node 0, a worker node on every other, 2 fake GPUs each, "
                                        "on the nodes' addresses only, dashboard off.")
    up.add_argument("--name", help=name_help)
    up.add_argument("--owner", type=int, metavar="PID", help=owner_help)
    up.add_argument("--nodes", type=int, default=2, metavar="K", help="how many nodes (default: 2)")
    up.add_argument("--rate", type=float, metavar="MB/s",
                    help="each node's link rate in MB/s (1e6 bytes/s) (default: unshaped)")
    up.add_argument("--slurm", action="store_true",
                    help=f"also run Slurm on the nodes (needs its packages: {INSTALL})")
    up.add_argument("--scheduler", choices=sorted(SCHEDULERS),
                    help="with --slurm: backfill (sched/backfill, the default) or fifo (sched/builtin)")
    up.add_argument("--accounting", action="store_true",
                    help="with --slurm: also MariaDB + slurmdbd (sacct, accounts teama and teamb, fair share)")
    up.add_argument("--gpus-per-node", type=int, metavar="N",
                    help="with --slurm: fake GPUs (GRES gpu) per node, 1-8, and as many CPUs (default: 2)")
    up.add_argument("--ray", action="store_true",
                    help="also run Ray on the nodes: head on node 0, one worker node per other node "
                         "(needs ray[train]: pip install -e '.[ray]')")
    down = actions.add_parser("down", help="remove your clusters and leftovers of owners that are gone",
                              description="Stop every process on your clusters' nodes (Slurm daemons and job "
                                          "processes included, Ray's too, by PID: never `ray stop`) and remove the nodes, the switch, the links and "
                                          "the Slurm files; also what owners that are gone left.")
    down.add_argument("--name", help="also your cluster of this name (default: those your login session owns)")
    down.add_argument("--owner", type=int, metavar="PID", help=owner_help)
    down.add_argument("--all", action="store_true",
                      help="every cluster, also other owners' live ones (the host's command)")
    actions.add_parser("status", help="list each cluster: owner, nodes, jobs, Slurm daemons (name, pid, node)")
    ex = actions.add_parser("exec", help="run CMD as on a node (default: node 0, Slurm's login node)",
                            description="Run CMD on node I of a cluster as a user logged in there: in its network "
                                        "namespace (with Slurm also with its hostname, node<I>, and the cluster's "
                                        "SLURM_CONF; with Ray its RAY_ADDRESS), in your current directory; stdin, stdout and the exit code "
                                        "pass through. "
                                        "Example: teraflops cluster exec -- sbatch --wrap 'srun hostname'",
                            usage="teraflops cluster exec [-h] [--name N] [--node I] [--owner PID] -- CMD ...")
    ex.add_argument("--name", metavar="N",
                    help="the cluster (default: yours, cli<pid of your login shell>, else the only Slurm or Ray "
                         "cluster up)")
    ex.add_argument("--owner", type=int, metavar="PID", help=owner_help)
    ex.add_argument("--node", type=int, default=0, metavar="I", help="the node (default: 0, the login node)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                    help="the command and its arguments, after -- (sinfo, squeue, sbatch, srun, scancel, sacct)")

    warm = sub.add_parser("warmup", help="the workshop host: build DeepSpeed's CPU and async_io ops and the course's "
                                         "torch.compile kernels once, into a cache every learner reads")
    warm.add_argument("--dest", type=Path, help="default: $TERAFLOPS_WARM_CACHE or /var/cache/teraflops")

    triage = sub.add_parser("triage", help="is a profiled step compute-, memory-, overhead- or communication-bound?")
    triage.add_argument("trace", type=Path, metavar="TRACE",
                        help="Chrome trace of torch.profiler with record_shapes=True (.json or .json.gz)")
    triage.add_argument("--waits", type=Path, metavar="WAITS.json",
                        help="seconds each rank spent in the step's collectives: [ranks] or [steps][ranks]")
    triage.add_argument("--peak-flops", type=float, metavar="F", help="FLOP/s, with --bandwidth (default: measured here)")
    triage.add_argument("--bandwidth", type=float, metavar="B", help="bytes/s, with --peak-flops")
    triage.add_argument("--launch-floor", type=float, metavar="S", help="seconds per op (default: measured here)")
    _add_reading_parsers(sub)

    # --- teraflops demo ---
    from teraflops.course.demo import MODES as DEMO_MODES  # the standard library only at import

    demo = sub.add_parser("demo", help="each failure mode in one command, for a talk: a large figure and a verdict",
                          description="Run failure modes of the course live, each ending in one large figure "
                                      "(PNG and SVG under --out) and one sentence of verdict computed from what it "
                                      "measured. Modes: " + ", ".join(DEMO_MODES) + " (default: all).")
    demo.add_argument("modes", nargs="*", metavar="MODE",
                      help="some of: " + ", ".join(DEMO_MODES))
    demo.add_argument("--warm", action="store_true", help="before the talk: build DeepSpeed's op, the compiled "
                                                          "decode step and the font cache, then run no mode")
    demo.add_argument("--out", type=Path, default=Path("build/demo"), help="folder for the figures (default: build/demo)")
    demo.add_argument("--record", type=Path, metavar="DIR", help="also record each run (MODE.json, .png, .svg) "
                                                                "in DIR, for --fallback")
    demo.add_argument("--fallback", type=Path, metavar="DIR", help="when a live mode fails, show the run recorded in DIR")
    demo.add_argument("--scale", default="room", help="figure scale: room (default, 1.6), laptop (1) or a number "
                                                      "(teraflops.plots)")
    return parser


# --- reading and opening the course anywhere (setup cells, the course site) -------------

def _add_reading_parsers(sub) -> None:
    cells = sub.add_parser("setup-cells", help="write each notebook's setup cell and Colab/Binder links from "
                           "pyproject's Source (labs: teraflops labs build), or --check they are current")
    cells.add_argument("--check", action="store_true", help="report notebooks whose setup cells are out of date")
    site = sub.add_parser("site", help="static HTML of the lectures as `teraflops run` executed them, the labs "
                          "and the report card, built offline (Sphinx + MyST-NB)")
    site.add_argument("--build", type=Path, default=Path("build"), metavar="DIR", help="the run's folder (default build)")
    site.add_argument("--out", type=Path, metavar="DIR", help="where the site goes (default DIR/site)")


def _cmd_setup_cells(args: argparse.Namespace) -> int:
    from teraflops.course import setup_cell
    from teraflops.course.runner import course_root

    root = course_root()
    if args.check:
        problems = setup_cell.stale(root)
        for problem in problems:
            print(problem)
        if not problems:
            print("setup cells current in notebooks/ and solutions/")
        return 1 if problems else 0
    changed = setup_cell.write_all(root)
    for path in changed:
        print(f"wrote {path}")
    print(f"{len(changed)} notebook(s) changed; run `teraflops labs build` for the labs")
    return 0


def _cmd_site(args: argparse.Namespace) -> int:
    from teraflops.course import site

    print(f"site: {site.build(args.build, args.out)}")
    return 0


def _cmd_triage(args: argparse.Namespace) -> int:
    """Verdict, evidence and where to act for one profiled step (teraflops.triage.verdict)."""
    from teraflops.triage.verdict import TriageError, triage

    given = [x for x in (args.peak_flops, args.bandwidth, args.launch_floor) if x is not None]
    if (args.peak_flops is None) != (args.bandwidth is None) or any(not x > 0 for x in given):
        raise TriageError("--peak-flops and --bandwidth go together, and they and --launch-floor must be > 0. "
                          "Hint: e.g. --peak-flops 989.5e12 --bandwidth 3.35e12 for an H100 SXM, or neither")
    ceilings = None
    if args.peak_flops is not None:
        import torch

        from teraflops.ceilings import Ceilings

        ceilings = Ceilings(args.peak_flops, args.bandwidth, torch.float32, "given", 0, 0)
    result = triage(args.trace, waits=args.waits, ceilings=ceilings, launch_floor=args.launch_floor)
    print(result.summary())
    print(result.table())
    return 0


# --- teraflops demo ---
def _cmd_demo(args: argparse.Namespace) -> int:
    """The talk's modes (teraflops.course.demo); exit 1 if a mode's numbers did not tell its story."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # figures go to files: no window to open
    from teraflops import plots
    from teraflops.course import demo

    plots.scale(args.scale)  # a bad scale: one line, before minutes of work
    modes = demo.check_modes(args.modes) if args.modes else demo.MODES
    if args.warm:
        demo.warm()
        return 0
    results = demo.run_modes(modes, out=args.out, record_to=args.record, fallback=args.fallback, scale=args.scale,
                             echo=lambda line: print(line, flush=True))
    return 0 if len(results) == len(modes) and all(r.story for r in results) else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from teraflops.machine import detect
    from teraflops.course.runner import format_summary, run_units

    results = run_units(args.units or None, out_dir=args.out, timeout_per_cell=args.timeout,
                        html=not args.no_html)
    print(format_summary(detect(), results))
    if results:
        from teraflops.course import report_card

        print(f"report card: {report_card.write(detect(), results, args.out)}")
    # a failed cell or a story the measurements contradict fails the run; "can't tell" does not
    return 0 if all(r.status != "FAILED" for r in results) else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    """Ratios in one run, on this machine: Triton kernel vs SDPA (vs naive), plus the measured ceilings."""
    import torch

    from teraflops import ceilings, sizing
    from teraflops.model_definition import attention
    from teraflops.machine import detect

    p, m = sizing.preset(), detect()
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype] if args.dtype else p.attention.dtype
    b, h, d = args.batch or p.attention.batch, args.heads or p.attention.heads, args.head_dim or p.attention.head_dim
    seq_lens = tuple(args.seq_len or p.attention.seq_lens[-1:])
    impls = (("naive",) if args.naive else ()) + ("sdpa", "triton")
    print(m.summary())
    print(ceilings.measure_ceilings(dtype=dtype if m.device == "cuda" else None))
    q = torch.randn(b, h, seq_lens[0], d, device=m.device, dtype=dtype)
    print(f"(B, H, d) = ({b}, {h}, {d}), {str(dtype).replace('torch.', '')}; SDPA backend: {attention.sdpa_backend(q, q, q)}")
    results = attention.attention_sweep(seq_lens, b, h, d, dtype, m.device, impls=impls, min_run_time=p.min_run_time)
    print(attention.sweep_table(results, b, h, d, q.element_size()))
    by = {(r.impl, r.seq_len): r for r in results}
    for n in seq_lens:
        tri, ref = by[("triton", n)], by[("sdpa", n)]
        if tri.seconds and ref.seconds:
            print(f"N={n}: Triton/SDPA throughput = {ref.seconds / tri.seconds:.3g}×")
    return 0


def lab_command(root: Path, port: int, token: str, ip: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    """The ``jupyter lab`` command line of ``teraflops lab`` (and the browser tests): serve ``root`` on
    ``ip:port`` with ``token``, no browser opened (on a server there is none; the URL is printed),
    ``--allow-root`` only when running as root (JupyterLab refuses root without it)."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.ip={ip}", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd + list(extra)


def wait_for_lab(proc, url: str, token: str, timeout: float = 60.0) -> None:
    """Return once JupyterLab at ``url`` (``http://host:port``) answers its status API, or raise
    :class:`CourseError` with its last line of output if it exits or does not answer in ``timeout`` s."""
    import time
    import urllib.request

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise CourseError(f"JupyterLab exited with code {proc.returncode} before it answered. "
                              "Hint: its own message is printed above")
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise CourseError(f"JupyterLab did not answer at {url} within {timeout:g} s")


def _cmd_lab(args: argparse.Namespace) -> int:
    """Run JupyterLab on the course folder until Ctrl-C (or SIGTERM), then stop it and return."""
    import secrets
    import signal
    import subprocess

    from teraflops.course.runner import course_root
    from teraflops.launch.ports import free_port

    root, token = course_root(), secrets.token_hex(24)
    port = free_port(args.port, args.ip)
    host = "127.0.0.1" if args.ip in ("0.0.0.0", "") else args.ip
    # its own session: Ctrl-C reaches this process only, which stops JupyterLab without its y/n prompt
    proc = subprocess.Popen(lab_command(root, port, token, args.ip), stdin=subprocess.DEVNULL,
                            start_new_session=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        wait_for_lab(proc, f"http://{host}:{port}", token)
        print(f"JupyterLab serves {root} at:\n    http://{host}:{port}/lab?token={token}\n"
              "open the lecture in notebooks/, then the lab in labs/; stop with Ctrl-C", flush=True)
        proc.wait()
        return 0 if proc.returncode in (0, -signal.SIGTERM) else 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.terminate()  # JupyterLab shuts its kernels down on SIGTERM
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print("JupyterLab stopped", flush=True)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from teraflops.course.doctor import doctor

    print(doctor())
    return 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    from teraflops.course import preflight

    if args.list:
        print(preflight.listing(gpus=preflight.machine.detect().gpu_count))
        return 0
    return preflight.main(args.out, only=args.only, full=args.full)


def _cmd_grade(args: argparse.Namespace) -> int:
    if not args.notebook.is_file():  # at once: the grader imports torch (seconds on a busy machine)
        raise CourseError(f"no such notebook: {args.notebook}")
    if args.out is not None:  # at once too, not after minutes of grading
        from teraflops.grading.grade_report import check_out_path

        check_out_path(args.out)
    print(f"grading {args.notebook} (starting a kernel) ...", file=sys.stderr, flush=True)
    from teraflops.grading.grader import grade

    report = grade(args.notebook, timeout=args.timeout, unit=args.unit)
    if args.json:
        import json

        print(json.dumps(report.as_json(), ensure_ascii=False))
    else:
        print(report.table())
    if args.out is not None:
        print(f"wrote {report.write(args.out)}", file=sys.stderr)
    return 0 if report.all_passed else 1


def _cmd_labs(args: argparse.Namespace) -> int:
    from teraflops.course.runner import course_root

    from teraflops.course.labs import build_labs, check_labs

    root = course_root()
    if args.action == "refresh":
        from teraflops.course.labs import refresh_all

        for path in refresh_all(root):
            print(f"wrote {path}")
        return 0
    if args.action == "build":
        written = build_labs(root)
        for path in written:
            print(f"wrote {path}")
        print(f"{len(written)} lab notebook(s) written")
        return 0
    problems = check_labs(root)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print("labs in sync with solutions")
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from teraflops.caches import WARM_ENV, warm_dir
    from teraflops.course.warmup import access_warnings, build_compile_cache, build_warm_aio, build_warm_cache

    for line in access_warnings():
        print(f"warning: {line}", file=sys.stderr)
    dest = args.dest or warm_dir()
    op = build_warm_cache(dest)
    aio = build_warm_aio(dest)
    compiled = build_compile_cache(dest)
    print(f"built DeepSpeed's CPU op: {op}")
    print(aio)
    for what in compiled:
        print(f"compiled: {what}")
    print(f"all in {dest}, readable by all; learners' runs copy it into their own caches and compile nothing")
    if Path(dest).resolve() != warm_dir().resolve() or os.environ.get(WARM_ENV):
        print(f"learners find it only with {WARM_ENV}={dest} in their environment (JupyterHub: "
              f"c.Spawner.environment = {{{WARM_ENV!r}: {str(dest)!r}}})")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    from teraflops.nodes import ownership_policy as policy

    caller = policy.resolve_caller(getattr(args, "owner", None))  # the login session's leader (or --owner): it owns what `up` makes
    return {"up": _cluster_up, "down": _cluster_down, "status": _cluster_status, "exec": _cluster_exec}[args.action](
        args, caller)


def _cluster_up(args: argparse.Namespace, caller: int) -> int:
    from teraflops import ownership
    from teraflops.nodes import cluster as cl
    from teraflops.nodes import ownership_policy as policy
    from teraflops.nodes import slurm as slurm_mod

    slurm_options = [flag for flag, given in (("--scheduler", args.scheduler is not None),
                                              ("--accounting", args.accounting),
                                              ("--gpus-per-node", args.gpus_per_node is not None)) if given]
    if slurm_options and not args.slurm:
        raise cl.ClusterError(f"{' and '.join(slurm_options)} set up Slurm, which --slurm starts. "
                              f"Hint: teraflops cluster up --slurm {' '.join(slurm_options)} ...")
    if args.gpus_per_node is not None and not 1 <= args.gpus_per_node <= 8:
        raise cl.ClusterError(f"--gpus-per-node is the fake GPUs each node declares, 1 to 8; got {args.gpus_per_node}. "
                              "Hint: --gpus-per-node 2 (each node also gets that many CPUs).")
    config = slurm_mod.SlurmConfig(scheduler=args.scheduler or "backfill", accounting=args.accounting,
                                   gpus_per_node=2 if args.gpus_per_node is None else args.gpus_per_node) \
        if args.slurm else False
    if args.rate is not None and not 0.01 <= args.rate <= cl.MAX_RATE / 1e6:
        raise cl.ClusterError(f"--rate is in MB/s (1e6 bytes/s), between 0.01 and {cl.MAX_RATE / 1e6:g}; got {args.rate:g}. "
                              "Hint: --rate 25 makes 25 MB/s = 200 Mbit/s links.")
    made = policy.up_for(caller, args.nodes, cl.Link(rate=None if args.rate is None else args.rate * 1e6),
                         name=args.name, slurm=config, ray=args.ray)
    print(made.describe())
    print(f"cluster {made.name!r}, owner {ownership.describe(ownership.read(made.name))}; run a command on node i "
          f"with: teraflops cluster exec --node i -- <command>; remove with: teraflops cluster down")
    if made.slurm_ is not None:
        print(f"slurm: {made.slurm_.config.describe()}; daemons: " +
              ", ".join(f"{d['name']} ({slurm_mod.host(policy.node_index(d['namespace']))})"
                        for d in made.slurm_.daemons()))
        print("try: teraflops cluster exec -- sinfo   (squeue, sbatch --wrap 'srun hostname', scancel, sacct)")
    if made.ray_ is not None:
        print(f"ray: head {made.ray_.address}; {made.ray_.config.describe()}; {len(made.ray_.processes())} Ray processes")
        print("try: teraflops cluster exec -- ray status")
    return 0


def _cluster_down(args: argparse.Namespace, caller: int) -> int:
    from teraflops import ownership
    from teraflops.nodes import cluster as cl
    from teraflops.nodes import ownership_policy as policy

    done = policy.down_for(caller, name=args.name, all=args.all)
    print(f"removed {len(done.removed)} namespace(s)" + (": " + ", ".join(done.removed) if done.removed else ""))
    if done.processes:
        print(f"stopped {done.processes} process(es) on them" +
              (f", {len(done.daemons)} of them Slurm daemons ({', '.join(sorted(set(done.daemons)))})"
               if done.daemons else ""))
    if done.skipped:
        print("left running (other owners'; --all removes them): " +
              ", ".join(f"{d.name} of {ownership.describe(d.owner)}" for d in done.skipped))
    if done.failed:
        raise cl.ClusterError(f"could not remove {', '.join(done.failed)}. Hint: removing namespaces needs root (sudo).")
    return 0


def _cluster_status(args: argparse.Namespace, caller: int) -> int:
    from teraflops import ownership
    from teraflops.nodes import ownership_policy as policy

    lines = []
    for row in policy.status_rows():
        others = f", {len(row.daemons)} of them Slurm daemons" if row.daemons else ""
        lines.append(f"{row.name or '(leftover)':<20}  owner: {ownership.describe(row.owner):<28}  nodes: {row.nodes}  "
                     f"running jobs: {row.jobs} ({row.processes} processes{others})")
        if row.slurm is not None:
            lines.append(f"  slurm: {row.slurm.describe()}; teraflops cluster exec --name {row.name} -- sinfo")
        if row.ray is not None:
            lines.append(f"  ray: {row.ray.describe()}; teraflops cluster exec --name {row.name} -- ray status")
        lines += [f"    {d.name:<10} pid {d.pid:<8} {d.host}" for d in row.daemons]
    print("\n".join(lines) or "no emulated nodes")
    return 0


def _cluster_exec(args: argparse.Namespace, caller: int) -> int:
    """Run ``args.cmd`` on a node, stdin/stdout/stderr passed through; the command's exit code (128 + N
    when signal N ended it, as a shell reports). A cluster taken down meanwhile is named in one line."""
    import signal
    import subprocess
    import time

    from teraflops.nodes import cluster as cl
    from teraflops.nodes import ownership_policy as policy

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    if not cmd:
        raise cl.ClusterError("no command to run. Hint: put it after --, e.g. teraflops cluster exec -- sinfo")
    if args.node < 0:
        raise cl.ClusterError(f"--node is a node index from 0 (the login node), got {args.node}.")
    reason = cl.unavailable()
    if reason:
        raise cl.ClusterError(reason + ".")
    target = policy.joined(policy.exec_target(caller, args.name))
    if args.node >= target.nodes:
        raise cl.ClusterError(f"cluster {target.name!r} has nodes 0-{target.nodes - 1}, got --node {args.node}.")
    argv = target.slurm_.login(args.node, os.getcwd()) if target.slurm_ is not None else \
        target.ray_.login(args.node) if target.ray_ is not None else \
        ["nsenter", f"--net=/run/netns/{target.node_name(args.node)}"]  # nodes without Slurm: the node's namespace
    started = time.time()
    try:
        proc = subprocess.Popen(argv + cmd)
    except OSError as e:
        raise cl.ClusterError(f"could not run nsenter ({e}). Hint: it is part of util-linux.") from e
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's (srun's own handling)
    try:
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    gone = target.taken_down(since=started) if code != 0 else None
    if gone:
        print(f"error: {gone}", file=sys.stderr)
    return 128 - code if code < 0 else code


_COMMANDS = {"run": _cmd_run, "preflight": _cmd_preflight, "bench": _cmd_bench, "doctor": _cmd_doctor,
             "lab": _cmd_lab, "grade": _cmd_grade, "labs": _cmd_labs, "cluster": _cmd_cluster, "warmup": _cmd_warmup,
             "triage": _cmd_triage, "demo": _cmd_demo, "setup-cells": _cmd_setup_cells, "site": _cmd_site}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``teraflops`` console script; returns the exit code. From the command line,
    a Python environment in a folder with a space restarts once through a space-free link first
    (:mod:`teraflops.course.any_folder`), so the builds the commands drive work from any folder."""
    if argv is None:
        any_folder.reexec(["-m", "teraflops.course.cli", *sys.argv[1:]])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _COMMANDS[args.command](args)
    except CourseError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
