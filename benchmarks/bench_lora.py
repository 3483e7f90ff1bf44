"""Per-request LoRA, side by side in one run (issue 20 item 6): mixed-adapter batches, per-forward cost, load time.

    .venv/bin/python benchmarks/bench_lora.py [--steps 4] [--size 256] [--rounds 3] [--threads 1] [--rank 16]
        [--adapters 8] [--targets attention|all] [--json results/lora.json]

On the FLUX.1-style checkpoint with the ~36M-parameter transformer (`build_tiny_checkpoint("flux", preset="36m")`)
at 256 px, with `--adapters` random rank-`--rank` adapters (`make-tiny-lora`, diffusers' format) loaded into one
pipeline (`install_lora`, as `serve --lora-modules` does):

(a) one call of 8 rows, each row with its own adapter, against the same 8 requests run one by one; beside it the
    same pair without adapters. The goal: the adapters' speed-up from batching is >= 0.9x the base model's.
(b) the per-forward cost of the adapters against the base model: the transformer's forward timed alone (torch
    forward hooks), for the batch of 8 (8 different adapters) and for one request (one adapter). Goal <= 1.15x.
(c) adapter load time from disk (diffusers' `lora_state_dict` + the checks of `read_adapter`) and the cost of a cold
    adapter: that read plus writing its weights into the layers' slots (what an LRU miss pays before the request).

Every variant runs once per round, the order alternating round by round so that load from other processes hits
all alike; medians are reported, of wall time and of the process' CPU time (`cpu`), which other processes on a
shared machine disturb far less (run with `--threads 1` there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ALL_TARGETS = (
    "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,proj_mlp,proj_out,"
    "ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
)
"""Every Linear of the FLUX blocks (what kohya-style FLUX LoRAs adapt); `attention` is diffusers' default four."""


class ForwardTimer:
    """Wall and CPU seconds of every transformer forward, with torch forward hooks (outside every diffusers hook)."""

    def __init__(self, module: Any) -> None:
        self.calls: list[tuple[float, float]] = []
        self._start = (0.0, 0.0)
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, *_: Any) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def _after(self, *_: Any) -> None:
        self.calls.append((time.perf_counter() - self._start[0], time.process_time() - self._start[1]))

    def take(self) -> list[tuple[float, float]]:
        calls, self.calls = self.calls, []
        return calls


def _adapters(checkpoint: Path, root: Path, count: int, rank: int, targets: str) -> dict[str, str]:
    from diffuserve.lora.tiny import DEFAULT_LORA_TARGETS, write_random_lora

    names = tuple(DEFAULT_LORA_TARGETS) if targets == "attention" else tuple(ALL_TARGETS.split(","))
    return {
        f"a{i}": str(write_random_lora(checkpoint, root / f"a{i}", rank=rank, seed=i + 1, targets=names, std=0.05))
        for i in range(count)
    }


def load_times(adapters: dict[str, str], transformer: Any, bank: Any, rank: int) -> dict[str, float]:
    """(c): median ms to read one adapter from disk, and to write its weights into the slots it takes."""
    import torch

    from diffuserve.lora.files import read_adapter

    reads, fills = [], []
    for name, path in adapters.items():
        start = time.perf_counter()
        adapter = read_adapter(name, path, "flux", transformer, max_rank=rank)
        reads.append(time.perf_counter() - start)
        slot = bank.slots[name]
        start = time.perf_counter()
        with torch.no_grad():  # the same values again into the adapter's own slot: what a cold load writes
            bank.place(slot, adapter)
        fills.append(time.perf_counter() - start)
    return {"read_ms": statistics.median(reads) * 1000, "slot_fill_ms": statistics.median(fills) * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--size", type=int, default=256, help="image width and height in pixels")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every variant once)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (= --max-lora-rank)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters loaded = rows of the mixed batch")
    parser.add_argument("--targets", choices=("attention", "all"), default="all", help="the Linears adapted")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.tiny import build_tiny_checkpoint
    from diffuserve.sampling import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    checkpoint = build_tiny_checkpoint("flux", work / "flux-36m", preset="36m")
    adapters = _adapters(checkpoint, work / "loras", args.adapters, args.rank, args.targets)
    pipe = load_pipeline(checkpoint)
    start = time.perf_counter()
    bank = install_lora(
        pipe, "flux", adapters, max_loras=len(adapters), max_rank=args.rank, device="cpu", dtype=torch.float32
    )
    install_s = time.perf_counter() - start
    timer = ForwardTimer(pipe.components["transformer"])

    def params(i: int, lora: bool) -> SamplingParams:
        return SamplingParams(
            prompt=f"a red circle number {i}",
            seed=i,
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            lora=((f"a{i}", 1.0),) if lora else (),
        )

    rows = len(adapters)
    variants = {f"{kind} batch": [[params(i, kind == "lora") for i in range(rows)]] for kind in ("lora", "base")} | {
        f"{kind} one by one": [[params(i, kind == "lora")] for i in range(rows)] for kind in ("lora", "base")
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    fwd: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    with torch.inference_mode():
        for batches in variants.values():  # warm-up
            pipe.run(batches[0])
        timer.take()
        names = list(variants)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                for batch in variants[name]:
                    pipe.run(batch)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                fwd[name] += timer.take()
    report = _report(wall, cpu, fwd)
    report["load"] = {**load_times(adapters, pipe.components["transformer"], bank, args.rank), "install_s": install_s}
    report["setup"] = {
        "model": "FLUX.1-style 36M transformer",
        "size": args.size,
        "steps": args.steps,
        "rank": args.rank,
        "adapters": rows,
        "targets": args.targets,
        "adapted_layers": bank.layers,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
    }
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _report(wall: dict[str, list[float]], cpu: dict[str, list[float]], fwd: dict[str, list]) -> dict[str, Any]:
    med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}
    per_fwd = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in fwd.items()}
    out: dict[str, Any] = {"seconds": {k: {"wall": w, "cpu": c} for k, (w, c) in med.items()}}
    out["forward_ms"] = {k: {"wall": w * 1000, "cpu": c * 1000} for k, (w, c) in per_fwd.items()}
    for i, clock in enumerate(("wall", "cpu")):
        lora_gain = med["lora one by one"][i] / med["lora batch"][i]
        base_gain = med["base one by one"][i] / med["base batch"][i]
        out[f"a_{clock}"] = {"lora_gain": lora_gain, "base_gain": base_gain, "ratio": lora_gain / base_gain}
        out[f"b_{clock}"] = {
            "batch": per_fwd["lora batch"][i] / per_fwd["base batch"][i],
            "single": per_fwd["lora one by one"][i] / per_fwd["base one by one"][i],
        }
    return out


def _print(report: dict[str, Any]) -> None:
    s = report["setup"]
    print(
        f"{s['model']}, {s['size']}px, {s['steps']} steps, {s['adapters']} adapters of rank {s['rank']} "
        f"on {s['adapted_layers']} layers ({s['targets']}), {s['threads']} threads, {s['rounds']} rounds"
    )
    print(f"{'variant':<18}{'wall s':>9}{'cpu s':>9}{'fwd ms':>9}{'fwd cpu ms':>12}")
    for name, t in report["seconds"].items():
        f = report["forward_ms"][name]
        print(f"{name:<18}{t['wall']:>9.2f}{t['cpu']:>9.2f}{f['wall']:>9.1f}{f['cpu']:>12.1f}")
    for clock in ("wall", "cpu"):
        a, b = report[f"a_{clock}"], report[f"b_{clock}"]
        print(
            f"({clock}) a: batching gain with 8 adapters {a['lora_gain']:.2f}x, without {a['base_gain']:.2f}x, "
            f"ratio {a['ratio']:.2f} (goal >= 0.9); b: forward cost batch {b['batch']:.3f}x, "
            f"single {b['single']:.3f}x (goal <= 1.15)"
        )
    load = report["load"]
    print(
        f"c: read from disk {load['read_ms']:.1f} ms per adapter, slot fill {load['slot_fill_ms']:.1f} ms, "
        f"cold adapter {load['read_ms'] + load['slot_fill_ms']:.1f} ms; install of all {s['adapters']}: "
        f"{load['install_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
