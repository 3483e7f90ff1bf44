"""Executors: how the engine's scheduled batches reach the ranks that run them.

The engine loop reads schedule -> execute -> update: it hands one scheduled batch as data (a `BatchMessage`:
request ids, `SamplingParams`, the row cap, the previews asked for, whether the decode may overlap) to
`Executor.execute(replica, message, events)`; the running batch reports typed events (`Progress`, `Preview`) to
`events` at its step boundaries and reads back which requests were cancelled, and the call returns a
`BatchOutcome` (whose `decoded` future carries the complete outcome when the decode runs in the decode lane).
`InProcessExecutor` runs it on the pipeline of this process (one rank). `MultiRankExecutor` (executor/multirank.py)
runs it on a replica of several ranks (CFG parallel, sequence/tensor parallel, FSDP) or on one of several
data-parallel replicas (the same `BatchMessage` goes to the replica's leader); every rank of the replica runs the
same pipeline call, and rank 0 decides at each step boundary whether the call stops, so no rank is ever left alone
inside a collective. Continuous batching goes through `Executor.steps()`, a `StepRunner` (executor/base.py).
"""
