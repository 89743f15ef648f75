"""llama.cpp beside `klotski generate` on the same GGUF files (issue 60 item 4).

Tooling only, never a dependency of the product. Stages, each cached so a rerun skips it:
  build    llama.cpp from the copy vendored in the llama-cpp-python source package (CPU only,
           Release, CMake + Ninja, only `llama-batched-bench` and `llama-quantize`), under
           $XDG_CACHE_HOME/klotski/llamacpp (or ~/.cache/...).
  convert  the built-in upcycled `smollm2-moe` checkpoint folder with llama.cpp's own
           convert_hf_to_gguf.py (its Python needs in a folder of their own on PYTHONPATH, never
           in the project's environment) to F16, then `llama-quantize` to Q8_0 and Q4_0.
  bench    `llama-batched-bench -npp 128 -ntg 64 -npl 32` and `klotski generate` (32 prompts of
           128 tokens, 64 new tokens each, EOS ignored) on each file, same thread count, repeated;
           medians of prefill, decode and end-to-end tokens/s and their ratios.

    python benchmarks/llamacpp_side_by_side.py [--stages build,convert,bench] [--threads 1] [--repeats 3]
        [--formats F16,Q8_0,Q4_0] [--klotski-args "--reordered-weights off"] [--engines klotski]

Each timed run takes the shared benchmark lock (/tmp/klotski-bench.lock) for itself alone.
Prefill and decode tok/s are each engine's own: llama-batched-bench's S_PP and S_TG (its prompt
pass over all sequences; its 64 batched steps), klotski's report (prompt tokens / prefill_s;
tokens made by decode steps / decode_s: each sequence's first new token comes from its
prefill, so klotski takes 63 decode steps to llama.cpp's 64). End to end is (prompt + new
tokens) / (prefill + decode seconds), llama.cpp's S t/s; "process" divides by the whole
process's wall time instead (loading, and klotski's planning and first-run measurements).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "klotski" / "llamacpp"
LOCK = "/tmp/klotski-bench.lock"
TARGETS = ("llama-batched-bench", "llama-quantize")
MODEL = "smollm2-moe"                 # the upcycled trained model in the box (klotski/builtin/smollm.py)
FORMATS = ("F16", "Q8_0", "Q4_0")     # F16 from the converter, the others from llama-quantize
CONVERTER_NEEDS = ("sentencepiece>=0.1.98,<0.3.0",)  # beyond what the project's environment has
NPL, NPP, NTG = 32, 128, 64           # sequences in parallel, prompt tokens, new tokens


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def locked(cmd: list[str]) -> list[str]:
    """Timed or CPU-heavy work runs under the shared lock, one at a time on the shared cores."""
    return ["flock", LOCK] + cmd


# --------------------------------------------------------------------------- build

def source_tree() -> Path:
    """vendor/llama.cpp of the llama-cpp-python source package, downloaded once."""
    src = CACHE / "src"
    src.mkdir(parents=True, exist_ok=True)
    archives = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(src)], check=True)
        archives = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    archive = archives[-1]
    tree = src / archive.name[:-len(".tar.gz")] / "vendor" / "llama.cpp"
    if not tree.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    return tree


def package_version(tree: Path) -> str:
    """llama-cpp-python's version names the vendored llama.cpp (the archive has no git history)."""
    return tree.parents[1].name.split("-", 1)[1]


def build(tree: Path) -> Path:
    """The two tools, built once; returns the folder holding them."""
    build_dir = CACHE / f"build-{package_version(tree)}"
    bin_dir = build_dir / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    log(f"building llama.cpp {package_version(tree)} in {build_dir} (about 10 minutes on 2 cores)")
    subprocess.run(locked(["nice", "cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja",
                           "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                           "-DLLAMA_BUILD_APP=OFF", "-DGGML_NATIVE=ON"]), check=True)
    subprocess.run(locked(["nice", "cmake", "--build", str(build_dir), "--target", *TARGETS,
                           "-j", str(os.cpu_count() or 1)]), check=True)
    return bin_dir


# --------------------------------------------------------------------------- convert

def converter_path() -> Path:
    """A folder of the converter's own Python needs (on PYTHONPATH only for the converter)."""
    deps = CACHE / "pydeps"
    if not (deps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps),
                        *CONVERTER_NEEDS], check=True)
    return deps


def convert(tree: Path, bin_dir: Path) -> dict[str, Path]:
    """The built-in model as GGUF files, one per format: llama.cpp's converter to F16, then
    llama-quantize. The converter imports the `gguf` package beside it (tree/gguf-py)."""
    sys.path.insert(0, str(ROOT))
    from klotski.builtin import smollm
    out = CACHE / "gguf" / package_version(tree)
    out.mkdir(parents=True, exist_ok=True)
    files = {fmt: out / f"{MODEL}-{fmt}.gguf" for fmt in FORMATS}
    if not files["F16"].exists():
        checkpoint = smollm.ensure(MODEL)
        log(f"converting {checkpoint} to {files['F16']}")
        tmp = files["F16"].with_suffix(".part")
        env = dict(os.environ, PYTHONPATH=str(converter_path()))
        subprocess.run(["nice", sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint),
                        "--outtype", "f16", "--outfile", str(tmp)], check=True, env=env)
        tmp.rename(files["F16"])
    for fmt in FORMATS[1:]:
        if not files[fmt].exists():
            tmp = files[fmt].with_suffix(".part")
            # seconds of one niced thread: not worth queueing behind others' timed runs for the lock
            subprocess.run(["nice", str(bin_dir / "llama-quantize"), str(files["F16"]), str(tmp), fmt, "1"],
                           check=True, capture_output=True)
            tmp.rename(files[fmt])
    return files


# --------------------------------------------------------------------------- bench

@contextmanager
def bench_lock(path: str | None = LOCK):
    """The shared benchmark lock (flock(2), as flock(1) takes it), held for one timed run
    (None: no lock)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def timed(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`cmd` under the lock: its result, with its wall time and the load average before and after."""
    with bench_lock():
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
    return proc, {"process_wall_s": round(wall, 3), "load_before": load_before, "load_after": load_after}


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def llama_run(bin_dir: Path, model: Path, threads: int) -> dict:
    """One llama-batched-bench run: NPL sequences of NPP random prompt tokens, NTG new tokens each."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(NPL * (NPP + NTG)),
           "-b", "2048", "-ub", "512", "-npp", str(NPP), "-ntg", str(NTG), "-npl", str(NPL),
           "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    proc, meta = timed(cmd)
    rows = [json.loads(l) for l in (proc.stdout + proc.stderr).splitlines() if l.startswith('{"n_kv_max"')]
    if proc.returncode or not rows:
        raise RuntimeError(f"llama-batched-bench on {model.name}: {one_line(proc)}")
    r = rows[0]
    prompt, generated = r["pl"] * r["pp"], r["pl"] * r["tg"]
    return {"prefill_tok_s": r["speed_pp"], "decode_tok_s": r["speed_tg"], "e2e_tok_s": r["speed"],
            "prefill_s": r["t_pp"], "decode_s": r["t_tg"], "prompt_tokens": prompt, "generated": generated,
            "decode_steps": r["tg"], "process_tok_s": (prompt + generated) / meta["process_wall_s"],
            "flash_attn": r["flash_attn"], "n_batch": r["n_batch"], "n_ubatch": r["n_ubatch"], **meta}


def write_jobs(path: Path, seed: int = 0) -> Path:
    """NPL lines of NPP random token ids each (as llama-batched-bench's prompts: no shared prefix),
    NTG new tokens each, EOS ignored so every line makes all of them."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(NPL):
            ids = [rng.randrange(100, 49000) for _ in range(NPP)]  # clear of the special tokens
            f.write(json.dumps({"id": f"p{i}", "prompt": ids, "max_tokens": NTG, "ignore_eos": True}) + "\n")
    return path


def klotski_run(jobs: Path, model: Path, threads: int, work: Path, tag: str, dtype: str | None,
                extra: tuple = ()) -> dict:
    """One `klotski generate` run on the GGUF file, every sequence in one batch of NPL (`extra`:
    more of its flags, e.g. an A/B of one of them)."""
    report, out = work / f"{tag}.report.json", work / f"{tag}.out.jsonl"
    cmd = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "-o", str(out), "--no-resume", "--no-progress",
           "--report", str(report), "--model", str(model), "--device", "cpu", "--threads", str(threads),
           "--batch-size", str(NPL), "--no-prefix-cache"] + (["--dtype", dtype] if dtype else []) + list(extra)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc, meta = timed(cmd, env)
    rep = json.loads(report.read_text()) if report.exists() else {}
    if proc.returncode or "error" in rep:
        raise RuntimeError(f"klotski generate on {model.name}: {rep.get('error') or one_line(proc)}")
    prompt, generated = rep["tokens"]["prompt"], rep["tokens"]["generated"]
    # each sequence's first new token comes out of its prefill: decode steps make the rest
    decoded = generated - rep["requests"]["ok"]
    return {"prefill_tok_s": prompt / rep["prefill_s"], "decode_tok_s": decoded / rep["decode_s"],
            "e2e_tok_s": (prompt + generated) / (rep["prefill_s"] + rep["decode_s"]),
            "prefill_s": rep["prefill_s"], "decode_s": rep["decode_s"], "prompt_tokens": prompt,
            "generated": generated, "decode_steps": rep["decode_steps"], "klotski_wall_s": rep["wall_s"],
            "process_tok_s": (prompt + generated) / meta["process_wall_s"], "batch_size": rep["plan"]["batch_size"],
            "dtype": rep["config"].get("dtype"), **meta}


METRICS = ("decode_tok_s", "prefill_tok_s", "e2e_tok_s", "process_tok_s")


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in METRICS}


def table(results: dict) -> str:
    head = ("| format | engine | decode tok/s | prefill tok/s | end-to-end tok/s | process tok/s |\n"
            "|---|---|---|---|---|---|\n")
    rows = []
    for fmt, res in results.items():
        med = {e: medians(res[e]) for e in ("llama.cpp", "klotski") if res.get(e)}
        for engine, m in med.items():
            label = engine + (f" ({res['klotski_dtype']})" if engine == "klotski" else "")
            rows.append(f"| {fmt} | {label} | " + " | ".join(f"{m[k]:.1f}" for k in METRICS) + " |")
        if len(med) == 2:
            rows.append(f"| {fmt} | **klotski / llama.cpp** | " + " | ".join(
                f"**{med['klotski'][k] / med['llama.cpp'][k]:.2f}x**" for k in METRICS) + " |")
        for engine, err in res.get("errors", {}).items():
            rows.append(f"| {fmt} | {engine} | failed: {err} | | | |")
    return head + "\n".join(rows)


def bench(bin_dir: Path, files: dict[str, Path], threads: int, repeats: int, formats: list[str],
          dtype_f16: str, save, extra: tuple = (), engines_run: set = frozenset({"llama.cpp", "klotski"})) -> dict:
    """Every format's runs, repeat by repeat (the engines alternating which goes first);
    `save(results)` after each run, so a run stopped midway keeps what it measured."""
    work = CACHE / "runs"
    work.mkdir(parents=True, exist_ok=True)
    jobs = write_jobs(work / "jobs.jsonl")
    results = {fmt: {"llama.cpp": [], "klotski": [], "errors": {}, "file": str(files[fmt]),
                     "klotski_dtype": dtype_f16 if fmt == "F16" else "bfloat16, the GGUF default"}
               for fmt in formats}
    for r in range(repeats):
        for fmt in formats:
            res = results[fmt]
            engines = [("llama.cpp", lambda: llama_run(bin_dir, files[fmt], threads)),
                       ("klotski", lambda: klotski_run(jobs, files[fmt], threads, work, f"{fmt}-{r}",
                                                      dtype_f16 if fmt == "F16" else None, extra))]
            for engine, run in (engines if r % 2 == 0 else engines[::-1]):  # alternate who goes first
                if engine in res["errors"] or engine not in engines_run:
                    continue
                try:
                    res[engine].append(run())
                    log(f"{fmt} {engine} run {r + 1}: " + ", ".join(
                        f"{k} {res[engine][-1][k]:.1f}" for k in METRICS) + f"; load {res[engine][-1]['load_before']}")
                except RuntimeError as e:
                    res["errors"][engine] = str(e)
                    log(f"{fmt} {engine} failed: {e}")
                save(results)
    return results


def version(bin_dir: Path) -> str:
    proc = subprocess.run([str(bin_dir / "llama-batched-bench"), "--version"], capture_output=True, text=True)
    return " ".join((proc.stdout + proc.stderr).split())


def tree_state() -> dict:
    """The klotski code measured: its commit and the files changed beside it (the tree is shared)."""
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--short", "--untracked-files=no").splitlines()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="build,convert,bench", help="comma-separated: build, convert, bench; or table alone (from --out)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of both engines (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--dtype-f16", default="bfloat16", help="klotski's compute dtype on the F16 file")
    ap.add_argument("--klotski-args", default="", help="more `klotski generate` flags, one string "
                    "(e.g. \"--reordered-weights off\")")
    ap.add_argument("--engines", default="llama.cpp,klotski", help="which engines run (an A/B of klotski flags: klotski)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llamacpp-side-by-side.json"))
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    if stages == {"table"}:  # the table again from a saved (or partly saved) run
        print(table(json.loads(Path(args.out).read_text())["results"]))
        return
    tree = source_tree()
    bin_dir = build(tree)
    log(f"llama.cpp {package_version(tree)} tools in {bin_dir}")
    if not stages & {"convert", "bench"}:
        return
    files = convert(tree, bin_dir)
    log("GGUF files: " + ", ".join(f"{k} {v} ({v.stat().st_size / 1e6:.0f} MB)" for k, v in files.items()))
    if "bench" not in stages:
        return
    formats = args.formats.split(",")
    head = {"klotski": tree_state(), "machine": os.uname().machine, "cpus": os.cpu_count(),
            "llama_cpp": {"package": f"llama-cpp-python {package_version(tree)}", "version": version(bin_dir)},
            "threads": args.threads, "repeats": args.repeats, "npl": NPL, "npp": NPP, "ntg": NTG,
            "klotski_args": args.klotski_args}

    def save(results: dict) -> None:
        summary = {**head, "medians": {fmt: {e: medians(res[e]) for e in ("llama.cpp", "klotski") if res[e]}
                                       for fmt, res in results.items()}, "results": results}
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")

    results = bench(bin_dir, files, args.threads, args.repeats, formats, args.dtype_f16, save,
                    tuple(args.klotski_args.split()), set(args.engines.split(",")))
    print(table(results))
    print(f"\nllama.cpp: {head['llama_cpp']}; threads {args.threads}; medians of {args.repeats}; "
          f"raw runs in {args.out}")


if __name__ == "__main__":
    main()
