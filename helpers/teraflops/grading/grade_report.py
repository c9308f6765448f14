"""A lab's grade: one row per exercise, as a table, JSON or JUnit XML (``teraflops grade``).

A report is written for a workshop host to gather (:meth:`GradeReport.write`): JSON, or JUnit XML in
the schema CI servers read (``testsuites``/``testsuite``/``testcase``/``failure``, as pytest's
``--junitxml`` writes it, https://docs.pytest.org/en/stable/how-to/output.html#creating-junitxml-format-files),
both naming the learner, the Unix user the grading ran as. The standard library only: the command
line checks an ``--out`` path (:func:`check_out_path`) before the grader imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from teraflops.errors import CourseError
from teraflops.tables import table

__all__ = ["GradeRow", "GradeReport", "FORMATS", "check_out_path", "current_user"]

FORMATS = {".json": "JSON", ".xml": "JUnit XML"}  # --out FILE's suffix -> what is written


def check_out_path(path: str | Path) -> Path:
    """``path`` as a report file to write, checked before any grading starts.

    Raises:
        CourseError: an empty path or a folder, a suffix other than ``.json`` / ``.xml``, a parent that
            does not exist or is not a folder, or a folder this user cannot write in.
    """
    text = str(path)
    path = Path(path)
    if not text.strip() or path.is_dir() or not path.name or path.name in (".", ".."):
        raise CourseError(f"--out {text!r}: that is a folder, not a report file. "
                          f"Hint: --out {Path(text or '.') / 'grades.json'}")
    if path.suffix.lower() not in FORMATS:
        raise CourseError(f"--out {path}: a report is .json (JSON) or .xml (JUnit XML), not "
                          f"'{path.suffix or 'no suffix'}'. Hint: --out {path.with_suffix('.json')}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise CourseError(f"--out {path}: {parent} is a file, not a folder. Hint: write the report elsewhere, "
                          f"e.g. --out {path.name}")
    if not parent.is_dir():
        raise CourseError(f"--out {path}: no folder {parent}. Hint: mkdir -p {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CourseError(f"--out {path}: you cannot write in {parent}. Hint: write it in a folder of yours "
                          f"(your home), and have the host copy it from there")
    return path


@dataclass(frozen=True)
class GradeRow:
    """One exercise's result: its label (``Exercise 1 (...)``), ``status`` and, unless it passed, why."""

    exercise: str
    status: str  # "passed", "failed", "not attempted"
    detail: str = ""


@dataclass(frozen=True)
class GradeReport:
    """One graded lab: the notebook's file name, one row per exercise of its unit (in order), the unit,
    and the learner, the Unix user it ran as."""

    notebook: str
    rows: tuple[GradeRow, ...]
    unit: int | None = None
    learner: str = ""  # the Unix user the notebook ran as (:func:`current_user`)

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.rows)

    @property
    def all_passed(self) -> bool:
        return bool(self.rows) and self.passed == len(self.rows)

    def table(self) -> str:
        """Exercise and result in a table; the reason for each failure on its own line below it."""
        body = [(r.exercise, r.status + (f" [{i}]" if r.detail else "")) for i, r in enumerate(self.rows, 1)]
        notes = [f"[{i}] {r.detail}" for i, r in enumerate(self.rows, 1) if r.detail]
        return "\n".join([self.notebook, table(body, ["exercise", "result"]), *notes,
                          f"score: {self.passed}/{len(self.rows)}"])

    def as_json(self) -> dict:
        """``teraflops grade --json``: ``{"notebook", "unit", "learner", "checks": [{"name", "passed",
        "message"}], "passed", "total"}``; ``message`` is the failure's reason, ``"not attempted"``, or ``""``."""
        checks = [{"name": r.exercise, "passed": r.status == "passed",
                   "message": r.detail or ("" if r.status == "passed" else r.status)} for r in self.rows]
        return {"notebook": self.notebook, "unit": self.unit, "learner": self.learner, "checks": checks,
                "passed": self.passed, "total": len(self.rows)}

    def as_junit(self) -> str:
        """JUnit XML: one ``testsuite`` (named learner/notebook, with ``learner`` and ``unit`` properties),
        one ``testcase`` per exercise (classname ``<learner>.<notebook stem>``); a failed or unattempted
        exercise has a ``failure`` whose ``message`` is the reason (``type`` ``ExerciseFailed`` or
        ``NotAttempted``, the check's exception). ``tests`` minus ``failures`` is the score."""
        from xml.etree import ElementTree as ET

        stem = Path(self.notebook).stem
        suite = ET.Element("testsuite", name=f"{self.learner}/{self.notebook}", tests=str(len(self.rows)),
                           failures=str(len(self.rows) - self.passed), errors="0", skipped="0")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="learner", value=self.learner)
        ET.SubElement(props, "property", name="unit", value="" if self.unit is None else str(self.unit))
        for r in self.rows:
            case = ET.SubElement(suite, "testcase", classname=f"{self.learner}.{stem}", name=r.exercise)
            if r.status != "passed":
                kind = "NotAttempted" if r.status == "not attempted" else "ExerciseFailed"
                ET.SubElement(case, "failure", message=r.detail or r.status, type=kind)
        suites = ET.Element("testsuites")
        suites.append(suite)
        ET.indent(suites)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def write(self, path: str | Path) -> Path:
        """Write the report to ``path``: JSON (:meth:`as_json`) for ``.json``, JUnit XML (:meth:`as_junit`)
        for ``.xml``; to a temporary file beside it, then renamed, so a host gathering reports never
        reads half a file.

        Raises:
            CourseError: as :func:`check_out_path`.
        """
        path = check_out_path(path)
        text = (json.dumps(self.as_json(), ensure_ascii=False, indent=1) + "\n"
                if path.suffix.lower() == ".json" else self.as_junit())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def current_user() -> str:
    """The Unix user this process runs as: its effective uid's name in the password database (the uid
    itself where it has no entry), not ``$USER``, which a kept environment (``sudo -E``, ``su -m``)
    leaves as the caller's. Where there are no uids (Windows), the login name."""
    if not hasattr(os, "geteuid"):
        import getpass

        return getpass.getuser()
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without an entry (some containers)
        return str(os.geteuid())
