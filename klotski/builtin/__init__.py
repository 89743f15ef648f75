"""The models that ship inside Klotski: deterministic tiny Mixtral presets (`tiny`), small
random checkpoints of the other families saved by transformers' own classes (`families`),
and `smollm2-moe`, a trained model upcycled from SmolLM2 (`smollm`). Used by `make-tiny`,
the demo and the tests; built once into the user cache."""
