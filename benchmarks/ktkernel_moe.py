"""Issue 60 item 1: KTransformers' CPU MoE kernels (`kt-kernel`, llamafile backend) against
Klotski's CPU expert phase, on the trained model's GGUF experts. A measurement only: kt-kernel
is not a dependency of Klotski. Install its wheel beside the project, not into it:

    .venv/bin/python -m pip install --no-deps --target /tmp/ktk/site kt_kernel-0.7.2-...whl
    PYTHONPATH=/tmp/ktk/site .venv/bin/python benchmarks/ktkernel_moe.py [--quant Q8_0,Q4_0] \
        [--tokens 1,8,32] [--layers 30] [--reps 3] [--quiet 0.1] [--lock /tmp/klotski-bench.lock]

Each timing takes the shared benchmark lock itself (flock on --lock) and runs only while other
processes keep under --quiet cores busy (checked before and during; timed again otherwise): on
this shared 2-core machine kt-kernel needs both cores (below), so any other job skews it most.

For each GGUF file (smollm2-moe-{Q8_0,Q4_0}.gguf: 30 layers, hidden 576, 8 experts 1536 wide,
top-2) and each number of tokens routed top-2 over the 8 experts, the median time of one
layer's whole expert phase (the three products of every routed expert, SwiGLU, the router
weights, the sum over a token's experts), cycling over all the file's layers so that no
layer's weights sit in the cache when it is used (a layer's Q4_0 experts are 12 MB, the
last-level cache 32 MB), one compute thread:

  kt one     kt-kernel's MOE driven directly (CPUInfer + MOE, one worker thread), every token
             on its own (`forward_one`: blocks of 32 output rows, activations quantized to
             the blocks' dot type, llamafile's sgemm)
  kt many    the same with its grouped path (`forward_many`, taken at 10 tokens or more, as
             its Python wrapper configures it): tokens gathered per expert, blocks of 256 rows
             (QK_K); at hidden 576 its down product covers 2 x 256 = 512 of the 576 outputs
  kt many/768  the grouped path with the hidden size padded with zero blocks to 768 (3 x 256),
             the input padded with zeros and the first 576 outputs kept: correct, with a third
             more work on the hidden side than the model needs
  bf16       Klotski's path over a decoded bf16 copy (`--decoded-copies`): grouped.grouped_swiglu
             (torch._grouped_mm), the rows gathered per expert and scattered back
  int4       Q4_0 only: Klotski's int4 path (torch's _weight_int4pack_mm_for_cpu per expert,
             grouped.grouped_swiglu over the int4 form, scales and zeros built per use as
             the pool's form has them)

and each one's relative Frobenius error against the fp32 reference (the blocks dequantized
by klotski.compress.ggml.dequantize, the bf16 input as fp32, every product in fp32) on layer
5. kt-kernel binds its pool's thread to core 0 itself (hwloc, whatever the process's
affinity), and the thread that calls it spins until the pool is done (and the pool's thread
keeps spinning a while between jobs): so the main thread (torch's one thread, and kt's waiting
caller) is bound to another core, and the busy seconds of each thread are printed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llamacpp_side_by_side import bench_lock  # noqa: E402  (the shared benchmark lock)
import torch
import torch.nn.functional as F

from klotski.compress import ggml
from klotski.models import grouped
from klotski.models import int4 as int4mm

GGUF_DIR = os.path.expanduser("~/.cache/klotski/llamacpp/gguf/0.3.36")
NAMES = (("w1", "gate"), ("w3", "up"), ("w2", "down"))  # Klotski's name, GGUF's ffn_<name>_exps


def load_layers(path: str, layers: int) -> tuple[list[dict], dict]:
    import gguf
    reader = gguf.GGUFReader(path)
    t = {x.name: x for x in reader.tensors}
    out, meta = [], {}
    for i in range(layers):
        raw = {}
        for ours, theirs in NAMES:
            x = t[f"blk.{i}.ffn_{theirs}_exps.weight"]
            raw[ours] = torch.from_numpy(np.array(x.data))  # [E, rows, row bytes] as llama.cpp stores them
            meta[ours] = x.tensor_type.name
        out.append(raw)
    return out, meta


@contextlib.contextmanager
def quiet_stdout():
    """kt-kernel's C++ prints a few lines per MOE built: kept off the table."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


class KtLayers:
    """One kt-kernel MOE per layer over one CPUInfer with one worker thread, driven as its
    wrapper does (kt_kernel/utils/llamafile.py) without the wrapper, whose pinned buffers
    need an accelerator."""
    cpu = None

    def __init__(self, raws: list[dict], qtype: str, experts: int, top_k: int, hidden: int, inter: int,
                 group_min_len: int, max_len: int):
        from kt_kernel import kt_kernel_ext as ext
        from kt_kernel_ext.kvcache import ggml_type
        from kt_kernel_ext.moe import MOE, MOEConfig
        pool = ext.WorkerPoolConfig()
        pool.subpool_count, pool.subpool_numa_map, pool.subpool_thread_count = 1, [0], [1]
        if KtLayers.cpu is None:  # one per process, as the wrapper keeps it
            KtLayers.cpu = ext.CPUInfer(pool)
        self.cpu = KtLayers.cpu
        self.mask = torch.zeros(experts, dtype=torch.bool)  # no expert on a GPU
        self.top_k = top_k
        self.moes = []
        self.blocks = raws  # the MOE reads them where they lie: they must outlive it
        kind = getattr(ggml_type, qtype)
        for i, raw in enumerate(raws):
            c = MOEConfig(experts, top_k, hidden, inter, self.mask.data_ptr())
            c.layer_idx, c.pool, c.m_block, c.group_min_len = i, self.cpu.backend_, 32, group_min_len
            c.max_len = c.group_max_len = max_len
            c.gate_proj, c.up_proj, c.down_proj = raw["w1"].data_ptr(), raw["w3"].data_ptr(), raw["w2"].data_ptr()
            c.gate_type = c.up_type = c.down_type = kind
            c.hidden_type = ggml_type.BF16
            moe = MOE(c)
            identity = torch.arange(experts, dtype=torch.int32)
            self.cpu.submit(moe.load_weights_task(identity.data_ptr()))
            self.cpu.sync()
            self.moes.append(moe)

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
            bsz: torch.Tensor) -> torch.Tensor:
        """The layer's MOE on x, synchronously from this thread (MOE.forward: the work runs on
        the pool's thread while this one waits), into `out`."""
        self.moes[layer].forward(bsz.data_ptr(), self.top_k, ids.data_ptr(), weights.data_ptr(), x.data_ptr(),
                                 out.data_ptr(), False)
        return out


def pool_cpus() -> set[int]:
    """The CPUs kt-kernel bound its pool's threads to (it binds them itself, with hwloc, from
    core 0 on, whatever the process's affinity)."""
    cpus = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if not f.read().startswith("numa_"):
                continue
        cpus |= os.sched_getaffinity(int(tid))
    return cpus


def padded(raw: dict, qtype: str, hidden: int, to: int) -> dict:
    """The blocks with the hidden size padded with zeros to `to` (all-zero blocks: scale 0, so
    weights 0): gate and up get (to - hidden) more columns, down as many more rows."""
    extra = ggml.row_nbytes(qtype, to) - ggml.row_nbytes(qtype, hidden)
    w1, w3, w2 = raw["w1"], raw["w3"], raw["w2"]
    return {"w1": F.pad(w1, (0, extra)).contiguous(), "w3": F.pad(w3, (0, extra)).contiguous(),
            "w2": F.pad(w2, (0, 0, 0, to - hidden)).contiguous()}


def klotski_phase(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: dict, experts: int) -> torch.Tensor:
    """A layer's expert phase as Klotski computes it on a CPU: the (token, expert) pairs sorted
    by expert, their rows gathered, grouped_swiglu, the router weights, the sum per token."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    rows = x.index_select(0, order // ids.shape[1])
    groups = grouped.Groups(counts.tolist(), counts.cumsum(0).to(torch.int32))
    y = grouped.grouped_swiglu(rows, w, groups) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // ids.shape[1], y)


def int4_form(raw: dict) -> dict:
    """Q4_0 blocks as Klotski's pool holds them for the int4 kernel: codes and scale fields."""
    out = {}
    for name, blocks in raw.items():
        codes, meta = ggml.int4_from_blocks(blocks, "Q4_0")
        out[name], out[name + "@meta"] = codes, meta
    return out


def int4_weights(form: dict) -> dict:
    """The weights dict of the int4 path, the kernel's scales and zeros built from the scale fields."""
    w = {}
    for name, t in form.items():
        if name.endswith("@meta"):
            w[name[:-len("@meta")] + int4mm.SCALES] = ggml.int4_scales_zeros(t, "Q4_0", torch.bfloat16)
        else:
            w[name] = t
    return w


def reference(x, ids, weights, raw, qtype) -> torch.Tensor:
    w = {n: ggml.dequantize(t, qtype) for n, t in raw.items()}
    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32)
    for tok in range(len(x)):
        for j in range(ids.shape[1]):
            e = int(ids[tok, j])
            h = F.silu(w["w1"][e] @ xf[tok]) * (w["w3"][e] @ xf[tok])
            out[tok] += float(weights[tok, j]) * (w["w2"][e] @ h)
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def timed(methods: dict, layers: int, reps: int) -> dict:
    """Median wall microseconds of each method's fn(layer), interleaved so that every method
    sees the same load: at step i method m takes layer (i + 7m) mod layers, so the layer it
    reads was last read at least 7 steps (every method's weights at 7 other layers) before.
    The first pass over the layers is not counted."""
    wall = {name: [] for name in methods}
    for rep in range(reps + 1):
        for i in range(layers):
            for m, (name, fn) in enumerate(methods.items()):
                t = time.perf_counter()
                fn((i + 7 * m) % layers)
                if rep:
                    wall[name].append(time.perf_counter() - t)
    return {name: statistics.median(wall[name]) * 1e6 for name in methods}


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return (sum(v) - v[3] - v[4]) / tick, (int(mine[11]) + int(mine[12])) / tick  # all but idle, iowait


def others_cores(seconds: float) -> float:
    """Cores other processes kept busy over the last `seconds` (sampled now)."""
    a, t = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    b = cpu_seconds()
    return ((b[0] - a[0]) - (b[1] - a[1])) / (time.perf_counter() - t)


def quiet_timed(methods: dict, layers: int, reps: int, limit: float, lock: str | None,
                tries: int = 40) -> tuple[dict, float]:
    """timed() under the benchmark lock on a machine other processes leave alone: it waits
    (outside the lock) until they use under `limit` cores, takes the lock, times, and times
    again if they used more meanwhile (the shared machine's untimed jobs take no lock).
    Returns the times and the other processes' cores during them."""
    for _ in range(tries):
        while others_cores(2.0) > limit:
            time.sleep(5)
        with bench_lock(lock):
            a, t = cpu_seconds(), time.perf_counter()
            times = timed(methods, layers, reps)
            b = cpu_seconds()
        other = ((b[0] - a[0]) - (b[1] - a[1])) / (time.perf_counter() - t)
        if other <= limit:
            return times, other
        print(f"  (other processes took {other:.2f} cores while timing: again)", flush=True)
    return times, other


def thread_seconds(fn, layers: int, seconds: float = 1.0) -> str:
    """CPU seconds each of the process's threads spent while fn(layer) ran, cycling layers."""
    def ticks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[tid] = (f.read().strip(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out
    before, t, n = ticks(), time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        fn(n % layers)
        n += 1
    wall, after = time.perf_counter() - t, ticks()
    busy = [f"{name} {(s - before.get(tid, (name, 0.0))[1]) / wall:.2f}" for tid, (name, s) in after.items()]
    return f"{n} calls; CPU s per wall s, by thread: " + ", ".join(b for b in busy if not b.endswith(" 0.00"))


def measure(qtype: str, tokens: list[int], args) -> None:
    """Every row of the table for one GGUF file."""
    E, K, H, N = 8, 2, 576, 1536
    raws, meta = load_layers(os.path.join(GGUF_DIR, f"smollm2-moe-{qtype}.gguf"), args.layers)
    assert set(meta.values()) == {qtype}, meta
    with quiet_stdout():
        kt_one = KtLayers(raws, qtype, E, K, H, N, group_min_len=1 << 30, max_len=max(tokens))
        kt_many = KtLayers(raws, qtype, E, K, H, N, group_min_len=10, max_len=max(tokens))
        kt_pad = KtLayers([padded(raw, qtype, H, 768) for raw in raws], qtype, E, K, 768, N, group_min_len=10,
                          max_len=max(tokens))
    others = os.sched_getaffinity(0) - pool_cpus()
    if others:  # torch's thread and kt's waiting caller off the core kt computes on
        os.sched_setaffinity(0, {min(others)})
    bf16 = [{n: ggml.dequantize(t, qtype, torch.bfloat16) for n, t in raw.items()} for raw in raws]
    q4 = [int4_form(raw) for raw in raws] if qtype == "Q4_0" else None
    acc = raws[args.accuracy_layer]
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).bfloat16()
        top, ids = torch.topk(torch.randn(T, E, generator=g), K, dim=-1)
        ids, wts = ids.long().contiguous(), top.softmax(-1).float().contiguous()
        out, bsz = torch.zeros(T, H, dtype=torch.bfloat16), torch.tensor([T], dtype=torch.int32)
        ref = reference(x, ids, wts, acc, qtype)
        outp = torch.zeros(T, 768, dtype=torch.bfloat16)
        xp = F.pad(x, (0, 768 - H)).contiguous()
        methods = {"kt one": lambda i: kt_one.run(i, x, ids, wts, out, bsz)}
        if T >= 10:
            methods["kt many"] = lambda i: kt_many.run(i, x, ids, wts, out, bsz)
            methods["kt many/768"] = lambda i: kt_pad.run(i, xp, ids, wts, outp, bsz)
        methods["bf16"] = lambda i: klotski_phase(x, ids, wts, bf16[i], E)
        if q4 is not None:
            methods["int4"] = lambda i: klotski_phase(x, ids, wts, int4_weights(q4[i]), E)
        times, other = quiet_timed(methods, args.layers, args.reps, args.quiet, args.lock)
        print(f"  other processes: {other:.2f} cores while timing; "
              f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
        a = args.accuracy_layer
        errors = {"kt one": rel(kt_one.run(a, x, ids, wts, torch.zeros_like(out), bsz), ref),
                  "bf16": rel(klotski_phase(x, ids, wts, bf16[a], E), ref)}
        if T >= 10:
            got = kt_many.run(a, x, ids, wts, torch.zeros_like(out), bsz).float()
            errors["kt many"] = rel(got, ref)
            print(f"  kt many, error on output columns <512: {rel(got[:, :512], ref[:, :512]):.4f}, "
                  f">=512: {rel(got[:, 512:], ref[:, 512:]):.4f}")
            errors["kt many/768"] = rel(kt_pad.run(a, xp, ids, wts, torch.zeros_like(outp), bsz)[:, :H], ref)
        if q4 is not None:
            errors["int4"] = rel(klotski_phase(x, ids, wts, int4_weights(q4[a]), E), ref)
        rows = {name: (times[name], errors[name]) for name in methods}
        if T == max(tokens):
            with bench_lock(args.lock):
                print(f"  kt one, {thread_seconds(methods['kt one'], args.layers)}")
        base = rows["bf16"][0]
        for name, (wall, err) in rows.items():
            print(f"{qtype} tokens {T:3d} {name:11s} {wall:8.0f} us  "
                  f"x{base / wall:5.2f} vs bf16  rel.err {err:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="Q8_0,Q4_0")
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--accuracy-layer", type=int, default=5)
    ap.add_argument("--lock", default="/tmp/klotski-bench.lock",
                    help="the shared benchmark lock, taken for each timing ('' for none)")
    ap.add_argument("--quiet", type=float, default=0.1,
                    help="time only while other processes keep under this many cores busy")
    args = ap.parse_args()
    args.lock = args.lock or None
    torch.set_num_threads(1)
    try:
        import kt_kernel
    except Exception as e:  # the measurement needs the wheel beside the project (see above)
        sys.exit(f"ktkernel_moe: kt_kernel does not import ({type(e).__name__}: {e}); "
                 "install its wheel with pip --no-deps --target DIR and put DIR on PYTHONPATH")
    print(f"kt_kernel {kt_kernel.__version__}, variant {kt_kernel.__cpu_variant__}; torch {torch.__version__}, "
          f"1 torch thread; {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    tokens = [int(s) for s in args.tokens.split(",")]
    for qtype in args.quant.split(","):
        measure(qtype, tokens, args)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
