"""The commit recorded with results says when the code differed from it."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import sieve_attn._provenance as provenance


def _fake_git(head, status, head_code=0):
    def run(args, **kwargs):
        if args[1] == "rev-parse":
            return SimpleNamespace(returncode=head_code, stdout=head + "\n")
        return SimpleNamespace(returncode=0, stdout=status)
    return run


def test_clean_checkout_gives_the_commit(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("abc123", ""))
    assert provenance.git_commit() == "abc123"


def test_changed_tracked_files_mark_the_commit_dirty(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("abc123", " M sieve_attn/ops/merge.py\n"))
    assert provenance.git_commit() == "abc123-dirty"


def test_no_checkout_gives_none(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_git("", "", head_code=128))
    assert provenance.git_commit() is None

    def missing(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(subprocess, "run", missing)
    assert provenance.git_commit() is None


def test_this_checkout_names_a_commit():
    commit = provenance.git_commit()
    assert commit is None or len(commit.split("-")[0]) == 40
