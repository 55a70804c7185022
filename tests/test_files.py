"""Files written whole or not at all."""

from __future__ import annotations

import pytest

from hybridpar.io.files import atomic_write, atomic_write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = atomic_write_text(tmp_path / "a.txt", "old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_directory_is_written_whole_and_a_failed_one_removed(tmp_path):
    def tree(tmp):
        tmp.mkdir()
        (tmp / "x").write_text("1")

    done = atomic_write(tmp_path / "d", tree)
    assert (done / "x").read_text() == "1"

    def broken(tmp):
        tree(tmp)
        raise ValueError("stop")

    with pytest.raises(ValueError):
        atomic_write(tmp_path / "e", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
