"""Mixed sizes on the real 36M checkpoint: size-grouped batching against packed calls + token budget + DRR.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mixed_36m.py --requests 24 --rounds 2 --steps 2

The CPU counterpart of `bench_arrivals.py --simulate gpu --mixed` (issue 31 item 5): the FLUX.1-style checkpoint
with the ~36M-parameter transformer (`build_tiny_checkpoint("flux", preset="36m")`), loaded twice in this process,
each copy behind its own in-process `AsyncEngine` (dynamic mode, `--batching-max-size 8`, 5 ms delay):

- `size-grouped`: today's batching: the copy's `packs_mixed_sizes` is set False, so size stays in the batch
  signature (what a family that cannot pack gets), FIFO order, no token budget;
- `tokens+drr`: the family as it ships (packed mixed-size denoiser calls; the cost gate of
  `pipelines/pack_plan.py` off, as by default, unless `--call-tokens`), `--batching-max-tokens` = 8
  rows of the largest size (the server's default budget, so both arms may fill the same 8-row cap; before, 8 rows
  of the middle size held the packed arm to smaller batches than the size-grouped arm's), `--batching-order drr`;
- with `--ablation` also `tokens (fifo)` (packing and the budget alone) and `size-grouped+drr` (fair order alone);
  with `--gate-ablation` also `tokens+drr (gate 64)` (the packed arm with the cost gate at 64 tokens per call).

The sizes are the issue's (256x256, 384x512, 512x512, 512x768) divided by `--scale` (default 4: 64x64, 96x128,
128x128, 128x192), drawn uniformly; one 256x256 request of 2 steps takes ~10 s on this shared 2-core CPU, so the
issue's sizes would not finish in a useful time. The figures, interleaved so that load from other processes hits
all alike (round r runs every setting, the order rotating by round):

1. saturation: a closed loop of `--clients` clients over the round's share of the requests (requests / s, pooled);
2. latency: Poisson arrivals at `--load` x size-grouped's pooled saturation throughput (the same arrivals and sizes
   for both): mean latency and the p99 of the smallest size class (over so few requests, about its max).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from diffuserve.tools.bench_report import percentile
from diffuserve.tools.sim_mixed import (
    ABLATION,
    MIXED_SIZES,
    SCHEDULERS,
    SimScheduler,
    open_loop,
    report,
    saturation_rps,
)


def _engine(
    checkpoint: Path, setting: SimScheduler, *, max_tokens: int | None, delay_ms: float, call_tokens: float | None
) -> Any:
    from diffuserve.engine.engine import AsyncEngine, EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig, RequestLevelScheduler
    from diffuserve.executor.base import InProcessExecutor
    from diffuserve.models.loader import load_pipeline
    from diffuserve.pipelines.serving import ServingPipeline

    def load() -> ServingPipeline:
        pipeline = load_pipeline(checkpoint)
        pipeline.packs_mixed_sizes = setting.packs  # False: today's size-grouped batches (size in the signature)
        pipeline.adapter.packing_call_tokens = call_tokens  # the cost gate (pipelines/pack_plan.py); None: the default
        return ServingPipeline.of(pipeline)

    config = BatchingConfig(mode="dynamic", max_size=8, delay_ms=delay_ms, max_tokens=max_tokens, order=setting.order)
    engine = AsyncEngine(
        InProcessExecutor(load),
        RequestLevelScheduler(config, model_names=["flux-36m"]),
        config=EngineConfig(max_queue_size=0, request_timeout_s=0.0, enable_warmup=False),
        model_name="flux-36m",
    )
    engine.start()
    if not engine.wait_ready(600):
        raise RuntimeError(f"the engine did not start: {engine.failure}")
    return engine


def run(args: argparse.Namespace) -> list[str]:
    sizes_of = tuple((w // args.scale, h // args.scale) for w, h in MIXED_SIZES)
    largest = max(sizes_of, key=lambda s: s[0] * s[1])
    max_tokens = 8 * (largest[0] // 16) * (largest[1] // 16)  # 8 rows of the largest size (the server's default)
    rng = random.Random(0)
    sizes = [rng.choice(sizes_of) for _ in range(args.requests)]
    smallest = min(sizes_of, key=lambda s: s[0] * s[1])
    share = [sizes[r :: args.rounds] for r in range(args.rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        from diffuserve.models.tiny import build_tiny_checkpoint

        checkpoint = build_tiny_checkpoint("flux", Path(tmp) / "flux-36m", preset="36m")
        settings = {
            n: (s, args.call_tokens) for n, s in (SCHEDULERS | ABLATION if args.ablation else SCHEDULERS).items()
        }
        if args.gate_ablation:  # the packed arm with the cost gate, beside the shipped one, interleaved alike
            settings["tokens+drr (gate 64)"] = (SCHEDULERS["tokens+drr"], 64.0)
        engines = {
            name: _engine(checkpoint, s, max_tokens=max_tokens if s.packs else None, delay_ms=5.0, call_tokens=gate)
            for name, (s, gate) in settings.items()
        }
        try:
            for engine in engines.values():  # warm-up: one request of each size, not timed
                saturation_rps(engine, list(sizes_of), clients=1, steps=args.steps)
            rounds = [list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)] for r in range(args.rounds)]
            seconds = {name: 0.0 for name in engines}
            for r, order in enumerate(rounds):
                for name in order:
                    rps = saturation_rps(engines[name], share[r], clients=args.clients, steps=args.steps)
                    seconds[name] += len(share[r]) / rps
                    print(f"round {r} {name}: saturation {rps:.3f} req/s", flush=True)
            results: dict[str, dict[str, float]] = {n: {"saturation_rps": len(sizes) / s} for n, s in seconds.items()}
            rate = args.load * results["size-grouped"]["saturation_rps"]
            answered: dict[str, list[tuple]] = {name: [] for name in engines}
            for r, order in enumerate(rounds):
                for name in order:
                    got = open_loop(engines[name], share[r], rate=rate, steps=args.steps, seed=100 + r)
                    answered[name] += got
                    mean = statistics.mean(x for _, x in got)
                    print(f"round {r} {name}: mean {mean:.2f} s at {rate:.3f} req/s", flush=True)
        finally:
            for engine in engines.values():
                engine.stop()
    for name, got in answered.items():
        small = [latency for size, latency in got if size == smallest]
        results[name] |= {
            "rate_rps": rate,
            "mean_ms": statistics.mean(latency for _, latency in got) * 1000,
            "p99_smallest_ms": percentile(small, 99) * 1000,
        }
    label = "36m mixed (" + " ".join(f"{w}x{h}" for w, h in sizes_of) + ")"
    head = (
        f"36m: FLUX.1-style ~36M transformer on CPU; {args.steps} steps; {args.requests} requests per point in "
        f"{args.rounds} interleaved rounds; saturation: {args.clients} closed-loop clients; load: {args.load:.0%} of "
        f"size-grouped saturation; dynamic, max size 8, 5 ms; tokens+drr: --batching-max-tokens {max_tokens}, "
        + (f"cost gate {args.call_tokens} tokens per call" if args.call_tokens else "no cost gate (the default)")
    )
    lines = [head, *report(label, results, targets=True)]
    if "tokens+drr (gate 64)" in results:
        old, new = results["size-grouped"], results["tokens+drr (gate 64)"]
        lines.append(
            f"{label} tokens+drr (gate 64) / size-grouped: throughput "
            f"{new['saturation_rps'] / old['saturation_rps']:.2f}x, mean {new['mean_ms'] / old['mean_ms']:.2f}x, "
            f"p99 {new['p99_smallest_ms'] / old['p99_smallest_ms']:.2f}x"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24, help="requests per point (saturation; latency)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds the requests are split into")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients at saturation")
    parser.add_argument("--load", type=float, default=0.7, help="open-loop rate / size-grouped saturation")
    parser.add_argument("--scale", type=int, default=4, help="divide the issue's sizes by this (1: as given)")
    parser.add_argument("--ablation", action="store_true", help="also packing alone and fair order alone")
    parser.add_argument("--call-tokens", type=float, help="the packed arms' cost gate (packing_call_tokens)")
    parser.add_argument("--gate-ablation", action="store_true", help="also the packed arm with the cost gate at 64")
    parser.add_argument("--output", type=Path, help="append the printed figures to this file")
    args = parser.parse_args()
    lines = run(args)
    print("\n".join(lines))
    if args.output is not None:
        with args.output.open("a") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
