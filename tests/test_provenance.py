"""The commit recorded with results says when the code differed from it."""
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
