"""Text as token windows (:mod:`sieve_attn.data.text`): the files a folder gives, how they are read, the windows'
arguments, and the files held back for validation."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sieve_attn.data.text import hold_back, text_files, token_windows


class Chars:
    """One token per character, no separator token."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_a_folder_gives_its_text_files_and_none_under_a_name_that_starts_with_a_dot(tmp_path):
    for name in ("a.py", "notes/b.txt", "README", ".git/HEAD", ".git/objects/ab/cdef", ".hidden.txt", "sub/.env",
                 "image.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert text_files(tmp_path) == [tmp_path / "README", tmp_path / "a.py", tmp_path / "notes" / "b.txt"]
    assert text_files(tmp_path / ".git") == [tmp_path / ".git" / "HEAD", tmp_path / ".git" / "objects" / "ab" / "cdef"]
    assert text_files(tmp_path / ".hidden.txt") == [tmp_path / ".hidden.txt"]  # named itself: read


def test_an_empty_path_is_refused_rather_than_read_as_the_working_directory():
    with pytest.raises(ValueError, match="text: expected a file or folder, got ''"):
        text_files("")


def test_text_is_read_as_utf8_whatever_the_locale(tmp_path):
    """The windows, and so a run's data digest, must not depend on the machine: Python reads files in the locale's
    encoding unless told otherwise (here ASCII: the C locale without UTF-8 mode)."""
    path = tmp_path / "cafe.txt"
    path.write_bytes("café\n".encode() + b"\xff")  # 6 characters as UTF-8 with the invalid byte replaced
    code = ("from sieve_attn.data.text import token_windows\n"
            "class Chars:\n"
            "    eos_token_id = None\n"
            "    def __call__(self, text): return {'input_ids': [ord(c) for c in text]}\n"
            f"print(token_windows(Chars(), [{str(path)!r}], 6).tolist())")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str([[ord(c) for c in "café\n\ufffd"]])


def test_token_windows_refuses_a_context_or_count_below_1_and_may_give_fewer_windows(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x" * 10)
    with pytest.raises(ValueError, match=r"context: expected an int in \[1, inf\], got 0"):
        token_windows(Chars(), [path], 0)
    with pytest.raises(ValueError, match=r"max_windows: expected an int in \[1, inf\], got 0"):
        token_windows(Chars(), [path], 2, 0)
    assert token_windows(Chars(), [path], 4, 100).shape == (2, 4)
    with pytest.raises(ValueError, match="text: expected at least 11 tokens, got 10"):
        token_windows(Chars(), [path], 11)


def test_a_file_named_twice_is_not_trained_on_where_it_is_held_back(tmp_path):
    a, b = tmp_path / "dup" / "a.txt", tmp_path / "dup" / "b.txt"
    a.parent.mkdir()
    a.write_text("x" * 20)
    b.write_text("y" * 30)
    # `--train-text dup dup/a.txt` lists a.txt twice; the last copy is held back, so neither may be trained on.
    train, validation = hold_back(Chars(), [a, b, a], context=8, windows=2)
    assert train == [b] and validation.tolist() == [[ord("x")] * 8] * 2
    with pytest.raises(ValueError, match="validation_windows: expected fewer windows than the training text holds"):
        hold_back(Chars(), [a, a], context=8, windows=1)
