"""Room for `klotski serve` (the OpenAI Batch API over HTTP, issue 40): the server and its
durable batch store will live here, beside cli/, calling the same `generate` a job runs."""
