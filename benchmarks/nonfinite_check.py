"""Cost of the per-layer non-finite check: on, against off (replaced by an identity), in one
process, alternating, 3 rounds; tokens compared.

    python benchmarks/nonfinite_check.py medium-mixtral
"""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import requests  # noqa: E402
from klotski.execute import pipeline as P  # noqa: E402
from klotski.assemble import open_engine  # noqa: E402
from klotski.config import RunConfig  # noqa: E402


def main(model: str) -> None:
    real = P._first_broken
    prompts = [f"The history of topic number {i} begins with a long story about" for i in range(32)]
    speed, tokens = {"on": [], "off": []}, {}
    for _ in range(3):
        for mode in ("on", "off"):
            P._first_broken = real if mode == "on" else (lambda broken, layer, h: broken)
            engine, seqs, _ = open_engine(RunConfig(model=model, progress=False, batch_size=16, num_batches=2),
                                          requests(prompts, max_new_tokens=16))
            out = {s.request.id: s.out for s in engine.run(seqs)}
            s = engine.stats
            engine.close()
            speed[mode].append(s.generated_tokens / (s.prefill_s + s.decode_s))
            tokens.setdefault(mode, out)
    P._first_broken = real
    print({m: [round(x, 2) for x in v] for m, v in speed.items()})
    print("median tokens/s on, off:", round(statistics.median(speed["on"]), 2),
          round(statistics.median(speed["off"]), 2), "identical tokens:", tokens["on"] == tokens["off"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "medium-mixtral")
