"""The commit recorded with results says when the code differed from it; the source digest names the code itself."""
from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import sieve_attn._provenance as provenance


def _fake_git(head, status, head_code=0, status_code=0):
    def run(args, **kwargs):
        if args[1] == "rev-parse":
            return SimpleNamespace(returncode=head_code, stdout=head + "\n")
        return SimpleNamespace(returncode=status_code, stdout=status)
    return run


def test_clean_checkout_gives_the_commit(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("abc123", ""))
    assert provenance.git_commit() == "abc123"


def test_changed_tracked_files_mark_the_commit_dirty(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("abc123", " M sieve_attn/ops/merge.py\n"))
    assert provenance.git_commit() == "abc123-dirty"


def test_a_status_git_cannot_read_is_not_taken_for_clean(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("abc123", "", status_code=128))
    assert provenance.git_commit() == "abc123-unchecked"


def test_no_checkout_gives_none(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("", "", head_code=128))
    assert provenance.git_commit() is None

    def missing(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(subprocess, "run", missing)
    assert provenance.git_commit() is None


@pytest.mark.skipif(not (Path(provenance.__file__).parents[1] / ".git").exists(), reason="not run from a git checkout")
def test_this_checkout_names_a_commit():
    commit = provenance.git_commit()
    assert commit is not None and len(commit.split("-")[0]) == 40


def test_the_source_digest_follows_the_sources_and_only_them(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "ops" / "b.py").write_text("y = 2\n")
    first = provenance.source_digest(tmp_path)
    assert first.startswith("sha256:") and len(first) == 7 + 64
    (tmp_path / "notes.txt").write_text("not a source")
    (tmp_path / "ops" / "c.pyc").write_bytes(b"compiled")
    assert provenance.source_digest(tmp_path) == first
    (tmp_path / "ops" / "b.py").write_text("y = 3\n")
    changed = provenance.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "ops" / "b.py").rename(tmp_path / "b.py")  # same bytes at another path
    assert provenance.source_digest(tmp_path) not in (first, changed)


def test_the_package_digest_is_the_same_wherever_its_sources_lie(tmp_path):
    import shutil
    package = Path(provenance.__file__).parent
    copy = shutil.copytree(package, tmp_path / "elsewhere" / "sieve_attn", ignore=shutil.ignore_patterns("*.pyc"))
    assert provenance.source_digest() == provenance.source_digest(copy)
