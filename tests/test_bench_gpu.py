"""`klotski bench --preset gpu` on the CPU (issue 46): the real-dimension benchmark's command at
widths / 16, two layers, a few short prompts: every Mixtral row runs in its own process and
reports the issue's figures; the budget is the 24 GiB card's, scaled to the layers built,
recomputed here from the built checkpoint's own tensor sizes; a row not started by the
deadline is listed as not run."""
import argparse
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klotski.bench import driver as bench
from klotski.builtin import realdims

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("mixtral-8x7b:klotski", "mixtral-8x7b:simple", "mixtral-8x7b:accelerate", "mixtral-8x7b:klotski-host")
CARD_BYTES = 22.56 * 2**30  # planner/profiles/rtx3090-pcie4.json: 24 GiB x 0.94
# Mixtral-8x7B at full width (its hub config.json), parameters: one layer, and the ends
FULL_LAYER = 4096 * (2 * 4096 + 2 * 1024) + 8 * (3 * 4096 * 14336) + 8 * 4096 + 2 * 4096
FULL_ENDS = 2 * 32000 * 4096 + 4096


def _args(*argv):
    parser = argparse.ArgumentParser(prog="klotski")
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def _tensor_bytes(path: Path) -> dict[str, int]:
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command, timed, after this machine's one-time profile of the shape (the planner's
    measurement, cached per machine, shape and link: ~35 s here on its own) is in the cache."""
    root = tmp_path_factory.mktemp("gpubench")
    model = realdims.build(root / "models" / "mixtral-8x7b-2l-s16-skewed", "mixtral-8x7b", 2, shrink=16)
    subprocess.run([sys.executable, "-m", "klotski.cli", "profile", "--model", str(model), "--device", "cpu",
                    "--emulate-link", "25"], check=True, capture_output=True, cwd=ROOT, timeout=600)
    t0 = time.perf_counter()
    rc = bench.main(_args("--preset", "gpu", "--device", "cpu", "--rows", ",".join(ROWS), "--layers", "2",
                          "--prompts", "4", "--prompt-tokens", "40", "--max-new-tokens", "3",
                          "--model-dir", str(root / "models"), "--work-dir", str(root / "work"),
                          "--out", str(root / "out.json")))
    return {"rc": rc, "s": time.perf_counter() - t0, "results": json.loads((root / "out.json").read_text()),
            "root": root}


def test_every_row_runs_and_reports_the_figures(run):
    r = run["results"]
    rows = {x["row"]: x for x in r["rows"]}
    assert run["rc"] == 0, [(k, x.get("error")) for k, x in rows.items()]
    assert list(rows) == list(ROWS) and r["not_run"] == []
    k = rows["mixtral-8x7b:klotski"]
    assert k["bs"] >= 1 and k["n"] >= 1
    for key in ("mixtral-8x7b:klotski", "mixtral-8x7b:klotski-host"):
        x = rows[key]
        assert x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0 and x["tok_s"] > 0, key
        assert x["link_gbps"] == 25.0 and 0 <= x["link_busy_decode"] <= 1, key
        assert x["decode_h2d_bytes"] > 0, key  # experts streamed while decoding
        assert x["decode_bubble"] is not None and x["predicted_tok_s"] > 0, key
        assert 0 < x["allocator_peak"] <= x["budget"], key
        ex = x["extrapolated"]
        assert ex["full_layers"] == 32 and ex["tok_s_full"] == pytest.approx(x["tok_s"] * 2 / 32, abs=1e-3)
        assert (ex["paper_table3_tok_s"], ex["moegen_decode_tok_s"]) == (22.414, 469)
    host = rows["mixtral-8x7b:klotski-host"]
    assert host["host_compute"] == {"attention": "on", "experts": "on"} and host["host_s_per_layer_step"] > 0
    assert (rows["mixtral-8x7b:simple"]["bs"], rows["mixtral-8x7b:simple"]["n"]) == (k["bs"], 1)
    assert rows["mixtral-8x7b:accelerate"]["batch_size"] == k["bs"] and rows["mixtral-8x7b:accelerate"]["tok_s"] > 0
    # the command's own time, its profile cached (printed with -s; docs/benchmarks.md records it)
    print(f"bench --preset gpu on CPU, {len(ROWS)} rows: {run['s']:.1f} s")


def test_the_budget_is_the_cards_scaled_to_the_layers_built(run):
    shape = run["results"]["shapes"]["mixtral-8x7b"]
    sizes = _tensor_bytes(Path(shape["dir"]) / "model.safetensors")
    layer = sum(v for k, v in sizes.items() if k.startswith("model.layers.0."))
    ends = sum(v for k, v in sizes.items() if not k.startswith("model.layers."))
    share = (CARD_BYTES - 2 * FULL_ENDS) / (32 * 2 * FULL_LAYER)  # bfloat16: 2 bytes a parameter
    assert shape["budget"] == pytest.approx(ends + share * 2 * layer, rel=1e-4)
    assert 0.2 < share < 0.3  # a 24 GiB card holds about a quarter of Mixtral-8x7B's layers


def test_rows_not_started_by_the_deadline_are_listed(tmp_path):
    rc = bench.main(_args("--preset", "gpu", "--device", "cpu", "--rows", "mixtral-8x7b:klotski,qwen3-30b-a3b:simple",
                          "--deadline", "0", "--model-dir", str(tmp_path / "m"), "--work-dir", str(tmp_path / "w"),
                          "--out", str(tmp_path / "out.json")))
    r = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0 and r["rows"] == [] and r["not_run"] == ["mixtral-8x7b:klotski", "qwen3-30b-a3b:simple"]


def test_the_baselines_run_at_the_plans_choices_when_klotskis_row_fails(run, monkeypatch):
    """On an H200 the Mixtral klotski row failed, and simple and accelerate were left unmeasured
    ("needs klotski's batch size") after klotski's row had been run twice more for them. Now a
    failed row runs once, and the baselines take the planner's batch size (`klotski plan`)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_realdims as G
    tried, ran = [], {}

    def klotski_row(a, shape, tag, timeout):
        if tag == "klotski":
            tried.append(tag)
            return {"ok": False, "error": "planted failure"}
        ran[tag] = (shape.bs, shape.n)
        return {"ok": False, "error": "not run in this test"}

    def accelerate_row(a, shape, timeout):
        ran["accelerate"] = (shape.bs, shape.n)
        return {"ok": False, "error": "not run in this test"}

    monkeypatch.setattr(G, "klotski_row", klotski_row)
    monkeypatch.setattr(G, "accelerate_row", accelerate_row)
    root = run["root"]
    a = G.parse_args(["--device", "cpu", "--layers", "2", "--prompts", "4", "--prompt-tokens", "40",
                      "--max-new-tokens", "3", "--model-dir", str(root / "models"), "--work-dir", str(root / "fail")])
    a.shrink, a.results = 16, []
    shapes = {}
    rows = [G.run_row(a, shapes, f"mixtral-8x7b:{tag}", 120) for tag in ("simple", "accelerate")]
    assert tried == ["klotski"]  # once, for both
    bs, n = ran["simple"]
    assert isinstance(bs, int) and bs >= 1 and isinstance(n, int) and n >= 1
    assert ran["accelerate"] == (bs, n)
    assert all(r["choices_from"].startswith("klotski plan") for r in rows)


def test_a_row_at_its_time_limit_is_asked_to_stop_before_it_is_killed(tmp_path, monkeypatch):
    """benchmarks/gpu.py's runner sends SIGTERM at a row's limit and waits for the run to write
    its report of the part that ran (klotski does: tests/test_iofaults.py), then kills."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu
    monkeypatch.setattr(gpu, "TERM_GRACE_S", 10)
    said = tmp_path / "said.txt"
    script = ("import signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *_: (open({str(said)!r}, 'w').write('bye'), sys.exit(143)))\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    t0 = time.perf_counter()
    rc, _, last = gpu.sh([sys.executable, "-c", script], tmp_path / "row.log", timeout=3)
    assert rc is None and last.startswith("timed out after 3 s")
    assert said.read_text() == "bye" and time.perf_counter() - t0 < 10


def test_a_row_the_allocators_cap_stopped_runs_again_under_a_higher_cap(tmp_path, monkeypatch):
    """The cap is the budget plus the CUDA runtime's headroom (a cap of the budget itself stops a
    run that fills its budget, as klotski's runs do: the cuBLAS workspace is outside its
    accounts); a row that still meets the cap's "out of memory" is measured again under a cap a
    quarter higher, and says so."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_realdims as G
    a = G.parse_args(["--device", "cuda", "--layers", "4", "--model-dir", str(tmp_path / "m"),
                      "--work-dir", str(tmp_path / "w")])
    a.shrink = 1
    shape = G.Shape(a, "mixtral-8x7b")
    assert shape.cap == shape.budget + G.RUNTIME_HEADROOM
    shape.jobs, shape.bs, shape.n = tmp_path / "jobs.jsonl", 4, 1
    launchers = []

    def klotski_once(ns, schedule, tag, budget, extra, launcher):
        launchers.append(launcher)
        error = "internal error (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB)"
        return {"ok": False, "error": error if len(launchers) == 1 else "the second try failed too"}

    monkeypatch.setattr(G.gpu, "klotski_once", klotski_once)
    monkeypatch.setattr(G, "figures", lambda *args, **kw: {})
    row = G.klotski_row(a, shape, "klotski", 100.0)
    assert [int(x[-1]) for x in launchers] == [shape.cap, int(shape.cap * 1.25)]
    assert "out of memory" in row["first_try"]["error"] and "allocator cap" in row["first_try"]["then"]
    assert row["error"] == "the second try failed too"
