"""CPU compute threads sized to the cores the process can have now (issue 45), and a speed
profile measured on a busy machine not kept as the machine's speed."""
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from klotski.util import threads as T


def test_threads_are_the_cores_other_processes_leave():
    assert T.compute_threads(total=2, others=0) == 2
    assert T.compute_threads(total=2, others=1) == 1
    assert T.compute_threads(total=2, others=3.8) == 1   # never none
    assert T.compute_threads(total=16, others=4) == 12


def test_other_processes_spinning_are_seen():
    """Two busy processes beside this one: /proc says so (this process's own threads not counted)."""
    spin = [subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"], stdout=subprocess.PIPE)
            for _ in range(2)]
    try:
        for p in spin:  # spinning (on a busy machine an interpreter takes a while to start)
            p.stdout.readline()
        time.sleep(0.2)
        others = T.others_runnable()
    finally:
        for p in spin:
            p.kill()
    if others is None:
        import pytest
        pytest.skip("no /proc/loadavg here")
    assert others >= 1.5


def test_a_governor_keeps_a_fixed_count_and_otherwise_follows_the_machine(monkeypatch):
    before = torch.get_num_threads()
    try:
        fixed = T.ThreadGovernor(fixed=1)
        assert torch.get_num_threads() == 1 and fixed.fixed
        fixed.restore()
        assert torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        now = [0.0]
        free = {"others": 0}
        monkeypatch.setattr(T, "others_runnable", lambda: free["others"])
        monkeypatch.setattr(T, "cores", lambda: 2)
        g = T.ThreadGovernor(clock=lambda: now[0])
        assert torch.get_num_threads() == 2
        free["others"] = 3
        g.check()
        assert torch.get_num_threads() == 2  # not looked at again yet
        now[0] = T.CHECK_EVERY_S + 0.1
        g.check()
        assert torch.get_num_threads() == 1 and g.history[-1] == (round(now[0], 1), 1)
        g.restore()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_profile_measured_while_busy_is_not_cached(tmp_path):
    """planner.profile.measure with a `busy` probe that reports load: used, not saved; free: saved."""
    from klotski.measure.profile_ops import EngineOps
    from planner.profile import measure
    from planner.shapes import ModelShape
    shape = ModelShape(hidden_size=32, intermediate_size=64, num_layers=2, num_experts=4, top_k=2, num_heads=2,
                       num_kv_heads=1, head_dim=16, vocab_size=64, dtype="float32")
    grid = dict(batch_sizes=(1,), context_lengths=(8,), token_counts=(1,), reps=1, io_bytes=1 << 16)
    busy = measure(shape, ops=EngineOps(), cache_dir=tmp_path, busy=lambda: 3.0, **grid)
    assert busy.machine["busy_runnable_threads"] == 3.0 and not list(tmp_path.glob("*.json"))
    said = []  # still busy: the busy profile is used again, nothing measured
    again = measure(shape, ops=EngineOps(), cache_dir=tmp_path, busy=lambda: 2.0, announce=said.append, **grid)
    assert not said and again.machine["busy_runnable_threads"] == 3.0
    # quiet now, but the kept-apart profile is minutes old: used, not measured again every run
    # (a disturbance the reader misses would otherwise have every run measure)
    measure(shape, ops=EngineOps(), cache_dir=tmp_path, busy=lambda: None, announce=said.append, **grid)
    assert not said and not list(tmp_path.glob("*.json"))
    import os
    from planner.profile import REMEASURE_AFTER_S
    for stale in tmp_path.glob("*.busy"):
        os.utime(stale, (stale.stat().st_mtime - REMEASURE_AFTER_S - 1,) * 2)
    measure(shape, ops=EngineOps(), cache_dir=tmp_path, busy=lambda: None, **grid)
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_run_that_fixes_its_threads_is_profiled_at_them(monkeypatch):
    """`--threads N`: the profile is timed (and keyed, by its machine fingerprint) at N threads,
    and torch's count is given back afterwards (planning.measure_here)."""
    from klotski import planning
    seen = []

    def fake_measure(shape, **kw):
        seen.append(torch.get_num_threads())
        return SimpleNamespace(overhead_s={})
    monkeypatch.setattr(planning, "measure", fake_measure)
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    planning.measure_here(object(), device="cpu", threads=want)
    planning.measure_here(object(), device="cpu")
    assert seen == [want, before] and torch.get_num_threads() == before
