"""The byte-level BPE tokenizer and chat template of the built-in test checkpoints.

Trained on klotski/builtin/data/corpus.txt to the model's vocabulary size, so the same
vocabulary size always gives the same tokenizer; saved so that both transformers 4.x and 5
load it with `AutoTokenizer`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = Path(__file__).with_name("data") / "corpus.txt"


@functools.lru_cache(maxsize=None)
def tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocabulary size per process.

    The corpus caps the vocabulary (a few thousand merges); asking for more
    yields the largest tokenizer the corpus supports.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space and a byte-level decoder: decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small; frequency-2 pairs run out before 4096
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n\n"), trainer)
    bos = SPECIAL_TOKENS.index("<s>")
    # Like Mixtral's tokenizer: encode() prepends <s> unless add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok.to_str()


def quiet_token_ids(tok, vocab_size: int) -> tuple[int, ...]:
    """Ids that do not decode to standalone printable text (all but eos)."""
    import unicodedata

    eos = tok.token_to_id("</s>")
    quiet = []
    for i in range(vocab_size):
        text = tok.decode([i], skip_special_tokens=False) if i < tok.get_vocab_size() else ""
        special = tok.id_to_token(i) in SPECIAL_TOKENS
        bad = not text or "\ufffd" in text or any(
            unicodedata.category(c) == "Cc" and c not in "\n\t" for c in text)
        if i != eos and (special or bad):
            quiet.append(i)
    return tuple(quiet)


def save_tokenizer(out_dir: Path, vocab_size: int, max_len: int):
    """Write tokenizer files into out_dir; return the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizer_json(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_max_length=max_len,
    )
    fast.save_pretrained(out_dir)
    # transformers 5 records its own backend class name, which tools built on
    # 4.x cannot resolve, and puts the template in a .jinja file that older 4.x
    # releases ignore; both major versions read these.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    return tok
