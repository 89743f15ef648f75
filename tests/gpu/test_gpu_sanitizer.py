"""The CUDA sanitizer can see the races it is run for (issue 46, item 3).

torch's sanitizer records the tensors each kernel reads and writes through a dispatch mode of
the thread it was enabled on. The channels used to issue their copies on worker threads, so a
copy-versus-compute race was invisible to it and "no race found" proved nothing. While the
sanitizer runs, the channels now issue copies on the calling thread (klotski/execute/
cudacopies.py). Here one run with a planted missing wait (a ticket handed over without making
the compute stream wait on the copy's event) must be reported, and the same run without the
plant must not; both check in the child that the sanitizer was on. Skipped without CUDA.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klotski.builtin import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: run tests/gpu on a GPU machine (../shared/gpu/README.md)")

SCRIPT = """
import sys
sys.path[:0] = {paths!r}
from torch.cuda._sanitizer import cuda_sanitizer
from klotski.execute import channels, cudacopies
print("SANITIZER", cuda_sanitizer.enabled, cudacopies.sanitizer_on())
if sys.argv[1] == "planted":
    def wait_without_the_event(self):  # the planted race: no stream.wait_event(self.event)
        return self.future.result()
    channels.Ticket.wait = wait_without_the_event
from test_gpu import run
tokens, _, engine = run({model!r}, "host", schedule="klotski", max_new_tokens=4)
print("ON_CALLER", all(c.on_caller for n, c in engine.channels.items() if n != "disk"),
      "EXPERTS", engine.pipeline.experts_loaded)
print("RAN")
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("san") / "small", "small", dtype="float32")


def sanitized(model, mode: str) -> tuple[int, str]:
    here = Path(__file__).parent  # the child imports test_gpu from here, conftest from tests/, klotski from the root
    script = SCRIPT.format(paths=[str(here), str(here.parent), str(here.parent.parent)], model=str(model))
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                         timeout=600, cwd=here)
    return out.returncode, out.stdout + out.stderr


def test_the_sanitizer_passes_the_code_and_catches_a_planted_missing_wait(model):
    rc, log = sanitized(model, "clean")
    assert "SANITIZER True True" in log, log[-3000:]  # it was on, and the channels knew it
    assert rc == 0 and "RAN" in log, log[-3000:]
    assert "CSAN" not in log and "data race" not in log.lower(), log[-3000:]
    assert "ON_CALLER True" in log and "EXPERTS 0" not in log, log[-3000:]  # copies were made, where it sees them

    rc, log = sanitized(model, "planted")
    assert "SANITIZER True True" in log, log[-3000:]
    assert rc != 0 and "RAN" not in log, f"the planted missing wait went unnoticed:\n{log[-3000:]}"
    assert "CSAN" in log or "data race" in log.lower(), log[-3000:]
