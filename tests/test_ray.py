"""`klotski generate --ray` and `klotski.ray.build_processor` on a local Ray cluster of this
machine (2 CPUs, one cluster for the module): the same records as a single-process run, work
spread over both actors, and no id lost or duplicated when an actor or the driver is killed."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import PROMPTS, reference_tokens
from klotski.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
COUNT = 24


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'klotski[ray]'")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))  # actors import this tree
    ctx = ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
                   logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ctx.address_info["address"]
    ray.shutdown()
    mp.undo()


@pytest.fixture(scope="module")
def job(checkpoints, tmp_path_factory):
    """A job of COUNT prompts and one bad line, and its single-process output (token ids kept)."""
    from klotski.generate import generate
    root = tmp_path_factory.mktemp("rayjob")
    jobs = root / "jobs.jsonl"
    with open(jobs, "w") as f:
        for i in range(COUNT):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} number {i}"}) + "\n")
        f.write('{"id": "empty", "prompt": ""}\n')
    config = RunConfig(model=str(checkpoints["gqa"]), max_new_tokens=12, include_token_ids=True, progress=False)
    assert generate(config, jobs, str(root / "single.jsonl")) == 1  # the bad line
    return jobs, config, by_id(root / "single.jsonl")


def by_id(path):
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in records}


def ray_run(config, jobs, out, cluster, **kw):
    from klotski.ray import RayRun
    return RayRun(config, jobs, out, address=cluster, **kw)


def test_ray_matches_single_process_and_both_actors_serve(cluster, job, checkpoints, tmp_path):
    jobs, config, single = job
    out = tmp_path / "out.jsonl"
    run = ray_run(config, jobs, out, cluster, workers=2, shard=4)
    report = run.run()
    assert by_id(out) == single  # every id once, token for token
    assert single["empty"]["error"]["message"]
    served = [a["records"] for a in report["ray"]["per_actor"]]
    assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == COUNT, served
    assert report["requests"] == {"ok": COUNT, "failed": 1, "skipped": 0}
    assert all(a["plan"]["batch_size"] >= 1 and a["pid"] for a in report["ray"]["per_actor"])  # each planned its own
    # and the single-process run is transformers' greedy output
    ref = reference_tokens(checkpoints["gqa"], [f"{p} number {i}" for i, p in enumerate(PROMPTS)], 12)
    assert [single[f"q{i}"]["token_ids"] for i in range(len(PROMPTS))] == ref


def test_ray_answers_a_line_of_n_samples_with_logprobs_as_one_process_does(cluster, checkpoints, tmp_path):
    from klotski.generate import generate
    jobs = tmp_path / "n.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"n{i}", "prompt": f"{PROMPTS[i]} number {i}", "n": 2, "seed": i,
                                        "temperature": 1.0, "logprobs": 2}) + "\n" for i in range(4)))
    config = RunConfig(model=str(checkpoints["gqa"]), max_new_tokens=4, progress=False)
    generate(config, jobs, str(tmp_path / "single.jsonl"))
    ray_run(config, jobs, tmp_path / "ray.jsonl", cluster, workers=2, shard=2).run()
    single, got = by_id(tmp_path / "single.jsonl"), by_id(tmp_path / "ray.jsonl")
    assert all(len(r["choices"]) == 2 for r in single.values())

    def numbers(records):  # taken out: the same tokens, their logprobs within float noise of another batching
        entries = [x for _, r in sorted(records.items()) for c in r["choices"] for t in c["logprobs"]
                   for x in (t, *t["top_logprobs"])]
        return [x.pop("logprob") for x in entries]
    want = numbers(single)
    assert len(want) > 8 and numbers(got) == pytest.approx(want, abs=1e-4) and got == single


def _wait_for_lines(path, count, alive=lambda: True, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and alive():
        if path.exists() and path.read_text().count("\n") >= count:
            return True
        time.sleep(0.02)
    return False


def test_an_actor_killed_mid_run_has_its_shards_rerun(cluster, job, tmp_path):
    jobs, config, single = job
    out = tmp_path / "out.jsonl"
    run = ray_run(config, jobs, out, cluster, workers=2, shard=2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(report=run.run()))
    thread.start()
    assert _wait_for_lines(out, 4, thread.is_alive) and run.ready
    victim = run.slots[0].info["pid"]
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=300)
    assert "report" in result, "the run did not finish"
    written = out.read_text().count("\n")
    assert by_id(out) == single and written == COUNT + 1
    report = result["report"]["ray"]
    assert report["per_actor"][0]["deaths"] == 1 and report["shards_rerun"] >= 1
    assert report["per_actor"][0]["pid"] != victim  # a fresh actor took the slot


def test_a_driver_killed_mid_run_resumes_on_rerun(cluster, job, tmp_path, capsys):
    jobs, config, single = job
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "klotski.cli", "generate", str(jobs), "-o", str(out), "--model", config.model,
            "--max-new-tokens", "12", "--include-token-ids", "--no-progress", "--ray", cluster, "--workers", "2",
            "--shard", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for_lines(out, 4, lambda: proc.poll() is None), proc.stderr.read() if proc.poll() else "timeout"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert partial < COUNT + 1, "the kill should land mid-run"
    from klotski.cli import main as cli
    code = cli.main(args[3:])  # the rerun, in this process: the same command
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED_LINES, err  # the empty prompt
    assert "already done" in err and "Traceback" not in err
    assert by_id(out) == single


def test_build_processor_maps_a_dataset_to_completions(cluster, job):
    import ray

    from klotski.ray import build_processor
    _, config, single = job
    rows = [{"id": f"q{i}", "text": f"{PROMPTS[i % len(PROMPTS)]} number {i}", "label": i} for i in range(8)]
    rows.append({"id": "empty", "text": "", "label": -1})
    processor = build_processor(config, batch_size=4, prompt_field="text")
    got = {r["id"]: r for r in processor(ray.data.from_items(rows)).take_all()}
    assert set(got) == {r["id"] for r in rows}
    for i in range(8):
        r, want = got[f"q{i}"], single[f"q{i}"]
        assert (r["completion"], r["finish_reason"], r["completion_tokens"], r["label"]) == \
            (want["completion"], want["finish_reason"], want["completion_tokens"], i)
        assert r["error"] is None
    assert "empty" in got["empty"]["error"] and got["empty"]["completion"] is None


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from klotski.cli import main as cli
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    jobs = tmp_path / "j.jsonl"
    jobs.write_text('{"prompt": "x"}\n')
    assert cli.main(["generate", str(jobs), "--ray", "--no-progress"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'klotski[ray]'" in err[0], err
    assert cli.main(["generate", str(jobs), "--workers", "2"]) == cli.EXIT_USAGE
    assert "needs --ray" in capsys.readouterr().err


def test_a_user_mistake_seen_by_the_actors_is_one_line(cluster, tmp_path, capsys):
    from klotski.cli import main as cli
    jobs = tmp_path / "j.jsonl"
    jobs.write_text('{"prompt": "x"}\n')
    code = cli.main(["generate", str(jobs), "--model", str(tmp_path / "no-such-model"), "--ray", cluster,
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_USAGE and len(err) == 1 and "no-such-model" in err[0], err
    assert not (tmp_path / "j.out.jsonl").exists()
