"""``python -m teraflops ...``: the same as the ``teraflops`` command."""

from teraflops.course.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
