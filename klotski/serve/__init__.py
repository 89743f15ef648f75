"""`klotski serve` (issues 40, 50): the OpenAI Batch API, with the online completion endpoints,
on one long-lived engine. store.py keeps files and batches durable under --data-dir (faults.py
is its write-fault seam), batches.py takes a batch through its states on the worker thread,
worker.py fronts the engine (batches as `klotski generate` jobs, online requests joining the
running group), app.py guards every request, deps.py, routes.py and online.py are the HTTP
routes, server.py wires them and runs uvicorn."""
