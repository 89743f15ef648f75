"""IdSet: a compact set of string ids, for job files of millions of lines.

A Python ``set`` of ids costs ~100 bytes an id (the string, its slot); a 10-million-line
job would hold a gigabyte just to remember which ids it has seen. IdSet keeps each id as
a 64-bit hash, 8 bytes, in sorted ``array('Q')`` runs, with the newest ids in a small
``set`` of ints that is sorted into a run when it fills. Runs of similar size are merged
(Timsort merges two sorted runs in one linear pass), so there are O(log n) runs and a
lookup is a few binary searches.

The hash is the first 8 bytes of BLAKE2b of the id's UTF-8: stable across processes
and machines, so a set can be saved beside an output (klotski/io/progress.py) and read back
by a rerun — Python's own ``hash()`` is salted per process and could not be. Two
different ids collide with probability about n²/2⁶⁵ (3·10⁻⁶ for 10 million ids).
Callers only ever turn a collision into "already seen" — an error record or a skipped
write — never into a second record.

Standard library only (klotski.io.jobs and klotski.io.output import it); numpy, when present,
only sorts a saved set faster.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from hashlib import blake2b

PENDING = 1 << 15  # ids kept as Python ints before they are sorted into a run


def id_hash(rid: str) -> int:
    # surrogatepass: a JSON id may hold a lone surrogate ("\\ud800"), which plain UTF-8 refuses
    return int.from_bytes(blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class IdSet:
    def __init__(self, ids=()):
        self._runs: list[array] = []
        self._new: set[int] = set()
        self._len = 0
        for rid in ids:
            self.add(rid)

    @classmethod
    def from_hashes(cls, hashes: array) -> "IdSet":
        """A set holding `hashes` (an array('Q'), e.g. read back from a file), in one sort."""
        s = cls()
        if len(hashes):
            run = _sorted(hashes)
            keep = array("Q", (h for i, h in enumerate(run) if i == 0 or run[i - 1] != h)) \
                if _has_repeats(run) else run
            s._runs, s._len = [keep], len(keep)
        return s

    def add(self, rid: str) -> bool:
        """Add `rid`; False when it (or an id with the same hash) was already there."""
        return self.add_hash(id_hash(rid))

    def add_hash(self, h: int) -> bool:
        # (inlined lookups: this runs once per job line and once per output record)
        new = self._new
        if h in new:
            return False
        for run in self._runs:
            i = bisect_left(run, h)
            if i < len(run) and run[i] == h:
                return False
        new.add(h)
        self._len += 1
        if len(new) >= PENDING:
            self._flush()
        return True

    def __contains__(self, rid: str) -> bool:
        return self.has_hash(id_hash(rid))

    def has_hash(self, h: int) -> bool:
        if h in self._new:
            return True
        for run in self._runs:
            i = bisect_left(run, h)
            if i < len(run) and run[i] == h:
                return True
        return False

    def hashes(self):
        """Every hash in the set (no order promised)."""
        for run in self._runs:
            yield from run
        yield from self._new

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        """Roughly what the set holds in memory (runs exactly, pending ints estimated)."""
        return sum(run.itemsize * len(run) for run in self._runs) + 60 * len(self._new)

    def _flush(self) -> None:
        self._runs.append(array("Q", sorted(self._new)))
        self._new = set()
        # Keep run sizes at least halving from the first: O(log n) runs to search.
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            b, a = self._runs.pop(), self._runs.pop()
            self._runs.append(array("Q", sorted(a + b)))


def _sorted(hashes: array) -> array:
    try:
        import numpy as np
    except ImportError:
        return array("Q", sorted(hashes))
    a = np.frombuffer(hashes, dtype=np.uint64).copy()
    a.sort()
    out = array("Q")
    out.frombytes(a.tobytes())
    return out


def _has_repeats(run: array) -> bool:
    try:
        import numpy as np
    except ImportError:
        return any(run[i - 1] == run[i] for i in range(1, len(run)))
    a = np.frombuffer(run, dtype=np.uint64)
    return bool((a[1:] == a[:-1]).any())
