"""IdSet: a compact set of string ids, for job files of millions of lines.

A Python ``set`` of ids costs ~100 bytes an id (the string, its slot); a 10-million-line
job would hold a gigabyte just to remember which ids it has seen. IdSet keeps each id as
a 64-bit hash, 8 bytes, in sorted ``array('Q')`` runs, with the newest ids in a small
``set`` of ints that is sorted into a run when it fills. Runs of similar size are merged
(Timsort merges two sorted runs in one linear pass), so there are O(log n) runs and a
lookup is a few binary searches.

The hash is Python's own string hash (SipHash, 64 bits), salted per process: two
different ids collide with probability about n²/2⁶⁵ (3·10⁻⁶ for 10 million ids), and a
collision that does happen is not repeated on a rerun. Callers only ever turn a
collision into "already seen" — an error record or a skipped write that the next run
redoes — never into a second record.

Standard library only (klotski.jobs and klotski.output import it).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left

_MASK = (1 << 64) - 1
PENDING = 1 << 15  # ids kept as Python ints before they are sorted into a run


def id_hash(rid: str) -> int:
    return hash(rid) & _MASK


class IdSet:
    def __init__(self, ids=()):
        self._runs: list[array] = []
        self._new: set[int] = set()
        self._len = 0
        for rid in ids:
            self.add(rid)

    def add(self, rid: str) -> bool:
        """Add `rid`; False when it (or an id with the same hash) was already there."""
        return self.add_hash(hash(rid) & _MASK)

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
        return self.has_hash(hash(rid) & _MASK)

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
