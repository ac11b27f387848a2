"""``benchmarks.gpu_halves``: a file over one device call's size limit travels in two halves."""

from __future__ import annotations

import os

import pytest

from benchmarks.gpu_halves import HalfMissing, join, main, split


@pytest.mark.parametrize("size", [0, 1, 7, 3 << 20 | 5])
def test_split_then_join_gives_the_file_back(tmp_path, size):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(size))
    digest = split(src, tmp_path / "a", tmp_path / "b", tmp_path / "sha")
    a, b = (tmp_path / "a" / "model.gguf.part00").stat().st_size, (tmp_path / "b" / "model.gguf.part01").stat().st_size
    assert a + b == size and a - b in (0, 1)  # two halves, each under the limit when the whole is under twice it
    out = join(tmp_path / "a", tmp_path / "b", tmp_path / "sha", tmp_path / "there" / "model.gguf")
    assert out.read_bytes() == src.read_bytes() and len(digest) == 64


def test_join_names_a_missing_first_half_and_refuses_halves_of_another_file(tmp_path, capsys):
    for name, data in (("x", b"abcdefgh"), ("y", b"ABCDEFGH")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data)
        split(tmp_path / name / "m.gguf", tmp_path / name / "a", tmp_path / name / "b", tmp_path / name / "sha")
    # the machine went back between the calls: no first half there
    assert main(["join", str(tmp_path / "gone"), str(tmp_path / "x" / "b"), str(tmp_path / "x" / "sha"),
                 str(tmp_path / "out.gguf")]) == 1
    assert "missing" in capsys.readouterr().err and not (tmp_path / "out.gguf").exists()
    with pytest.raises(HalfMissing, match="halves of different files"):
        join(tmp_path / "y" / "a", tmp_path / "x" / "b", tmp_path / "x" / "sha", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
