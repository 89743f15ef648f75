"""What it costs to hand every checkpoint read over at a 64-byte boundary (placement/store.py).

    python benchmarks/read_alignment.py [--mib 256] [--reps 7] [--dir /tmp]

One safetensors-like file holding one tensor twice: at a 64-byte boundary, and 8 bytes past
one (as a real checkpoint's header leaves its tensors). Each is read whole by TensorStore,
with O_DIRECT (a misaligned one is moved down to the boundary in place: one memmove) and
buffered (read straight into a torch allocation, which starts at one); and, as the baseline of
the buffered path before, into a bytearray. Medians of `--reps` interleaved reads, in GB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from placement.store import TensorStore  # noqa: E402


def write_file(path: Path, nbytes: int) -> None:
    """Tensors "aligned" at a 64-byte boundary and "skewed" 8 bytes past one."""
    n = nbytes // 4
    header = {"aligned": {"dtype": "F32", "shape": [n], "data_offsets": [0, nbytes]},
              "pad": {"dtype": "U8", "shape": [8], "data_offsets": [nbytes, nbytes + 8]},
              "skewed": {"dtype": "F32", "shape": [n], "data_offsets": [nbytes + 8, 2 * nbytes + 8]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        block = torch.randn(1 << 20).numpy().tobytes()
        for _ in range(2):
            for at in range(0, nbytes, len(block)):
                f.write(block[:min(len(block), nbytes - at)])
            if _ == 0:
                f.write(b"\0" * 8)


def bytearray_read(store: TensorStore, name: str) -> None:
    """The buffered path as it was: into a bytearray (zero-filled, 16-byte aligned)."""
    entry = store.entries[name]
    buf = bytearray(entry.nbytes)
    os.preadv(store._fd(entry.file, False), [buf], entry.offset)
    torch.frombuffer(buf, dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    nbytes = a.mib << 20
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        write_file(Path(d) / "model.safetensors", nbytes)
        direct, buffered = TensorStore(d, direct=True), TensorStore(d, direct=False)
        cases = {"direct, aligned": lambda: direct.read("aligned"),
                 "direct, skewed (moved)": lambda: direct.read("skewed"),
                 "buffered, aligned": lambda: buffered.read("aligned"),
                 "buffered, skewed": lambda: buffered.read("skewed"),
                 "buffered into a bytearray (before)": lambda: bytearray_read(buffered, "skewed")}
        times = {k: [] for k in cases}
        for _ in range(a.reps):
            for k, read in cases.items():
                start = time.perf_counter()
                t = read()
                times[k].append(time.perf_counter() - start)
                del t
        print(f"{a.mib} MiB a read, median of {a.reps}; O_DIRECT used: {direct.direct}")
        for k, ts in times.items():
            print(f"  {k:36s} {nbytes / statistics.median(ts) / 1e9:6.2f} GB/s")
        direct.close()
        buffered.close()


if __name__ == "__main__":
    main()
