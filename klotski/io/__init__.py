"""What crosses the file system: job files (`jobs`, one line's fields in `requests`),
dataset inputs (`dataset_files`), output records and their writers (`output`,
`parquet_output`), resume (`progress`, `idset`), checkpoints (`checkpoint`, validated by
`check`), `--model` names (`registry`) and example job files (`wikitext`). Never imports
the runtime."""
