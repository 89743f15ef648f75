"""Model families as pure functions over weight dicts, one file per family, behind the
`Family` Protocol (`family.py`) with the hooks most of them share (`defaults.py`), plus what
every family is built from (`layers.py`), config field checks (`fields.py`) and `ModelSpec`
(`spec.py`: a checkpoint's shape, options and tensor names). Imports nothing from the
runtime, the CLI, io or the built-in models: a new family is one file here and one line in
`spec.FAMILIES`."""
