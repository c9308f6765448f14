"""The ``teraflops`` command (also ``python -m teraflops``).

Subcommands::

    teraflops run [UNIT ...] [--out build] [--no-html] [--timeout S]
                                        execute lecture notebooks, print the summary table
    teraflops doctor                    versions, devices, compilers and what is skipped here
    teraflops grade NOTEBOOK            check a lab notebook's exercises
    teraflops labs build|check|refresh  generate labs/ from solutions/, check they agree, or
                                        (maintainers) re-execute notebooks keeping nbval-checked outputs

Exit codes: 0 success; 1 a notebook failed, a check failed or labs are out of sync;
2 a usage or course error, printed as one line ``error: ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import CourseError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
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

    grade = sub.add_parser("grade", help="grade a lab notebook")
    grade.add_argument("notebook", type=Path, metavar="NOTEBOOK")

    labs = sub.add_parser("labs", help="build labs from solutions, or check they are in sync")
    labs.add_argument("action", choices=["build", "check", "refresh"])
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from .machine import detect
    from .runner import format_summary, run_units

    results = run_units(args.units or None, out_dir=args.out, timeout_per_cell=args.timeout,
                        html=not args.no_html)
    print(format_summary(detect(), results))
    return 0 if all(r.ok for r in results) else 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor

    print(doctor())
    return 0


def _missing(feature: str, module: str, e: ImportError) -> CourseError:
    return CourseError(f"{feature} is not available: cannot import {module} ({e})")


def _cmd_grade(args: argparse.Namespace) -> int:
    if not args.notebook.is_file():
        raise CourseError(f"no such notebook: {args.notebook}")
    try:
        from .grading.core import grade_notebook
    except ImportError as e:
        raise _missing("teraflops grade", "teraflops.grading.core", e) from None
    table, all_passed = grade_notebook(args.notebook)
    print(table)
    return 0 if all_passed else 1


def _cmd_labs(args: argparse.Namespace) -> int:
    from .runner import course_root

    try:
        from .labs import build_labs, check_labs
    except ImportError as e:
        raise _missing("teraflops labs", "teraflops.labs", e) from None
    root = course_root()
    if args.action == "refresh":
        from .labs import refresh_all

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


_COMMANDS = {"run": _cmd_run, "doctor": _cmd_doctor, "grade": _cmd_grade, "labs": _cmd_labs}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``teraflops`` console script; returns the exit code."""
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
