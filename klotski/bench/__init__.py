"""`klotski bench`: the benchmark driver (`driver`), apart from the runtime it measures."""
