"""The scheduler's side: the waiting queue every source feeds, admission into rows (continuous
batching), sequences, sampling, constraints, log-probabilities, shared prefixes, the step
loop (engine.py: schedule -> execute -> update), its accounting and report."""
