"""What runs a job on the machine: the `Engine` and its step loop (`engine`, continuous
batching in `batching`), the schedule of a step through the layers (`pipeline`, Algorithm 1
of the paper) and its expert phase (`experts`), host compute (`hostcompute`), the KV cache
(`kvcache`), copy channels (`channels`), the timeline (`trace`), tokenized sequences
(`sequences`), and what it measures for the planner (`overhead`, `profile_ops`)."""
