"""tests/traversal.py, the helper that opens folders to a throw-away user for one test, leaves no mode
changed: not after the block, not after a failure inside it, not after a killed run (the next run)."""

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

import traversal


@pytest.fixture
def tree(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="teraflops-traversal-"))  # not pytest's tmp_path: the modes are the point
    monkeypatch.setattr(traversal, "GRANTS", base / "grants")
    base.chmod(0o755)
    (base / "closed" / "open" / "shut").mkdir(parents=True)
    (base / "closed").chmod(0o700)
    (base / "closed" / "open" / "shut").chmod(0o750)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_folders_on_the_way_are_entered_for_the_block_then_closed_again(tree):
    target = tree / "closed" / "open" / "shut" / "file.py"
    with traversal.traversable([target, tree / "closed"]):
        assert [_mode(tree / p) for p in ("closed", "closed/open", "closed/open/shut")] == [0o701, 0o755, 0o751]
        record, = traversal.GRANTS.glob(f"{os.getpid()}-*.json")
        assert json.loads(record.read_text()) == [[str(tree / "closed"), 0o700], [str(tree / "closed/open/shut"), 0o750]]
    assert [_mode(tree / p) for p in ("closed", "closed/open", "closed/open/shut")] == [0o700, 0o755, 0o750]
    assert not list(traversal.GRANTS.glob("*.json"))


def test_a_failure_inside_the_block_puts_the_modes_back(tree):
    with pytest.raises(RuntimeError), traversal.traversable([tree / "closed" / "open"]):
        raise RuntimeError("the test failed")
    assert _mode(tree / "closed") == 0o700 and not list(traversal.GRANTS.glob("*.json"))


def test_what_a_killed_run_changed_is_put_back_by_the_next_one(tree):
    traversal.GRANTS.mkdir()
    dead = 2**22 + 1  # above Linux's largest pid_max: no process has it
    (traversal.GRANTS / f"{dead}-x.json").write_text(json.dumps([[str(tree / "closed"), 0o700]]))
    (tree / "closed").chmod(0o701)  # as the killed run left it
    with traversal.traversable([]):
        assert _mode(tree / "closed") == 0o700
    assert not list(traversal.GRANTS.glob("*.json"))


def test_a_mode_changed_since_is_left_as_it_is(tree):
    with traversal.traversable([tree / "closed"]):
        (tree / "closed").chmod(0o755)  # someone opened it for good meanwhile
    assert _mode(tree / "closed") == 0o755


def test_course_paths_name_this_python_and_the_package_it_imports():
    import sys

    import teraflops

    paths = traversal.course_paths()
    assert Path(sys.executable) in paths and Path(teraflops.__file__).parent in paths
    assert traversal.ROOT / "helpers" in paths
