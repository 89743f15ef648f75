"""Measuring the engine on this machine, for the planner and for the tests and benchmarks that
check it: the ops a hardware profile times (`profile_ops`: EngineOps), what the pipeline
itself costs around them (`overhead`), the ATen ops code issues (`opcounter`: OpCounter) and
those of a decode layer step or a whole job (`op_count`). It runs the engine's own code and
is handed what only the composition root builds (`open_engine`): the planning side of the
composition root asks it for a profile's ops and the pipeline's cost."""
