"""Executors: how the engine's scheduled batches reach the ranks that run them.

The engine loop reads schedule -> execute -> update: it hands one scheduled batch (as a `BatchMessage`: request
ids, `SamplingParams`, the row cap) to `Executor.execute(replica, ...)` and gets a `BatchOutcome` back.
`InProcessExecutor` runs it on the pipeline of this process (one rank). `MultiRankExecutor` (executor/multirank.py)
runs it on a replica of several ranks (CFG parallel, sequence/tensor parallel, FSDP) or on one of several
data-parallel replicas; every rank of the replica runs the same pipeline call, and rank 0 decides at each step
boundary whether the call stops, so no rank is ever left alone inside a collective.
"""
