"""Atomic writes: a file or directory is the old one or the new one, never half of either, and no temp is left."""

import pytest

from wingspan.files import atomic_directory, atomic_file, write_text_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "a.txt"
    write_text_atomically(path, "old")
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in path.parent.iterdir()] == ["a.txt"]
    write_text_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["a.txt"]


def test_a_directory_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "export"
    with atomic_directory(target) as tmp:
        (tmp / "weights").write_text("1")
    with pytest.raises(KeyboardInterrupt), atomic_directory(target) as tmp:
        (tmp / "weights").write_text("2")
        raise KeyboardInterrupt
    assert (target / "weights").read_text() == "1"
    with atomic_directory(target) as tmp:
        (tmp / "config").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["config"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
