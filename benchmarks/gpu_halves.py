"""A file too large for one call to a lent GPU machine, sent in two halves over two calls.

    python -m benchmarks.gpu_halves split FILE DIR_A DIR_B SHA_FILE   # here: the halves and the sha256
    python -m benchmarks.gpu_halves join DIR_A DIR_B SHA_FILE OUT      # there: the file, checked

What one ``device`` call sends (the working tree and its ``carry``) is at most 64 MiB, and the
SmolLM2-135M-Instruct GGUF is 98 MB. ``benchmarks/lent_gpu_prepare.sh`` splits it into ``.gpu_a``
and ``.gpu_b``; a first call carries ``.gpu_a`` and stashes it on the machine, a second call, made
before the machine goes back, carries ``.gpu_b`` and joins them (``benchmarks/lent_gpu.sh``).
``join`` fails with what is missing when the first half is not there (the machine went back
between the calls) or the joined bytes are not the file's (a half from another file).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

__all__ = ["split", "join", "HalfMissing"]

CHUNK = 1 << 20


class HalfMissing(RuntimeError):
    """A half is absent, or the joined file's sha256 is not the recorded one."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _half_name(name: str, i: int) -> str:
    return f"{name}.part{i:02d}"


def split(path: str | Path, dir_a: str | Path, dir_b: str | Path, sha_file: str | Path) -> str:
    """Write the first ``ceil(size / 2)`` bytes of ``path`` to ``dir_a/<name>.part00``, the rest to
    ``dir_b/<name>.part01``, and the whole file's sha256 to ``sha_file``; returns the sha256."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as src:
        for i, (d, n) in enumerate(((Path(dir_a), (size + 1) // 2), (Path(dir_b), size // 2))):
            d.mkdir(parents=True, exist_ok=True)
            with (d / _half_name(path.name, i)).open("wb") as dst:
                while n > 0 and (block := src.read(min(CHUNK, n))):
                    dst.write(block)
                    n -= len(block)
    digest = _sha256(path)
    Path(sha_file).write_text(f"{digest}  {path.name}\n")
    return digest


def join(dir_a: str | Path, dir_b: str | Path, sha_file: str | Path, out: str | Path) -> Path:
    """Join the halves that :func:`split` wrote into ``out`` and check its sha256 against
    ``sha_file``; returns ``out``. Raises :class:`HalfMissing` naming what is missing or wrong."""
    digest, name = Path(sha_file).read_text().split()
    halves = [Path(dir_a) / _half_name(name, 0), Path(dir_b) / _half_name(name, 1)]
    missing = [str(h) for h in halves if not h.is_file()]
    if missing:
        raise HalfMissing(f"missing {missing}: the first half comes from an earlier call on the same machine "
                          "(it goes back 30 s after a call), the second from this call's carry")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as dst:
        for h in halves:
            with h.open("rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    got = _sha256(out)
    if got != digest:
        out.unlink()
        raise HalfMissing(f"the joined {name} has sha256 {got[:12]}..., not {digest[:12]}...: halves of different files")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_halves", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("file")
    s.add_argument("dir_a")
    s.add_argument("dir_b")
    s.add_argument("sha_file")
    j = sub.add_parser("join")
    j.add_argument("dir_a")
    j.add_argument("dir_b")
    j.add_argument("sha_file")
    j.add_argument("out")
    args = p.parse_args(argv)
    if args.cmd == "split":
        print(split(args.file, args.dir_a, args.dir_b, args.sha_file))
        return 0
    try:
        print(join(args.dir_a, args.dir_b, args.sha_file, args.out))
    except HalfMissing as e:
        print(f"gpu_halves: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
