"""The composition root of `serve` and `generate`: the only package that knows every layer.

Its modules import one way (ranks <- setup <- follower <- root), never back:

- `ranks.py`: process topology only — who this process is among the ranks (`LaunchInfo`), how it joins the
  group (`connect`), how the first process of a host starts the others (`spawn_local_ranks(entry=...)`), and
  the heartbeat of a rank without HTTP.
- `setup.py`: one rank's set-up — checkpoint, device, plan -> load -> shard -> residency -> parallel ->
  compile -> (operator-only) fault injection.
- `follower.py`: a rank that serves no HTTP — join, load its share, follow its replica's leader (or, as a
  replica leader, rank 0's batches) until shutdown.
- `root.py`: `serve` / `generate`'s root — the scheduler, the executor (one rank or several) and the engine.

Nothing is re-exported here, so importing `ranks` (as the CLI does to decide which role it plays) loads no
engine or model code.
"""
