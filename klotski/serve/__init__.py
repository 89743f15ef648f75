"""`klotski serve` (issue 40): the OpenAI Batch API, with the online completion endpoints, on
one long-lived engine. store.py keeps files and batches durable under --data-dir, batches.py
takes a batch through its states, worker.py drives the engine (batches as `klotski generate`
jobs, online requests joining the running group), app.py has the HTTP routes, server.py
wires them and runs uvicorn."""
