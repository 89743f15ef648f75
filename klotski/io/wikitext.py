"""`klotski jobs wikitext`: export real wikitext-103 prompts as a job file, for users who can
reach the Hugging Face hub (the bundled jobs/wikitext.jsonl needs no network)."""
from __future__ import annotations

import json
import random

from klotski.errors import UserError


def export_wikitext(path: str, count: int, seed: int, *, words: int = 64) -> int:
    try:
        from datasets import load_dataset
        rows = load_dataset("Salesforce/wikitext", "wikitext-103-raw-v1", split="test")["text"]
    except ImportError:
        raise UserError("`klotski jobs wikitext` needs the datasets package, which is not installed: "
                        "pip install 'klotski[datasets]'") from None
    except Exception as e:
        raise UserError(f"cannot load wikitext-103 from the Hugging Face hub ({type(e).__name__}); "
                        "check the network, or use the bundled jobs/wikitext.jsonl") from None
    # Paragraphs, not headings: wikitext marks headings with " = ... = ".
    paragraphs = [t.strip() for t in rows if len(t.split()) >= words and not t.strip().startswith("=")]
    random.Random(seed).shuffle(paragraphs)
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(paragraphs[:count], 1):
            f.write(json.dumps({"id": f"wt103-{i:05d}", "prompt": " ".join(text.split()[:words])}) + "\n")
    return min(count, len(paragraphs))
