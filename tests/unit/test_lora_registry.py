"""The adapter registry's tiers: more adapters registered than device slots swap in between batches (free slot
first, then the least recently used one), the host LRU re-reads from disk past --max-cpu-loras, a re-load under the
same name is another adapter; and the scheduler keeps a batch within --max-loras distinct adapters."""

from __future__ import annotations

import torch

from diffuserve.config.batching import BatchingConfig
from diffuserve.engine.request import Request
from diffuserve.engine.scheduler import LORA_SLOTS, Dispatch, RequestLevelScheduler
from diffuserve.lora.files import LoraAdapter, LoraModule
from diffuserve.lora.registry import LoraRegistry
from diffuserve.lora.slots import RegistryBank
from diffuserve.sampling import SamplingParams


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.other = torch.nn.Linear(5, 5)


def _adapter(name: str, seed: int, module: str = "proj") -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    width = 6 if module == "proj" else 5
    return LoraAdapter(
        name,
        f"/{name}",
        {module: LoraModule(torch.randn(2, width, generator=gen), torch.randn(5, 2, generator=gen), 1.0)},
    )


def _setup(
    files: dict[str, LoraAdapter], startup: list[str], *, slots: int, host: int
) -> tuple[_Tiny, LoraRegistry, RegistryBank, list[str]]:
    torch.manual_seed(0)
    model = _Tiny()
    reads: list[str] = []
    registry = LoraRegistry({n: f"/{n}" for n in startup}, max_loras=slots, host_capacity=host)

    def reader(name: str, path: str) -> LoraAdapter:
        reads.append(path)
        return files[path]

    registry.reader = reader
    for entry in reversed(registry.entries()):
        registry.keep(entry, registry.read(entry.name, entry.path))
    bank = RegistryBank(model, registry, max_loras=slots, max_rank=2, device="cpu", dtype=torch.float32)
    return model, registry, bank, reads


def _want(model: _Tiny, adapter: LoraAdapter, x: torch.Tensor, module: str = "proj") -> torch.Tensor:
    m = adapter.modules[module]
    return x @ m.down.T @ m.up.T * m.scaling


def test_adapters_beyond_the_slots_swap_in_between_batches_lru_first() -> None:
    files = {f"/{n}": _adapter(n, i) for i, n in enumerate("abc")}
    model, registry, bank, reads = _setup(files, ["a", "b", "c"], slots=2, host=3)
    assert bank.slots == {"a": 0, "b": 1} and registry.counts() == {"registered": 3, "host": 3, "device": 2}
    x = torch.randn(2, 6)
    base = torch.nn.functional.linear(x, model.proj.weight, model.proj.bias)
    with bank.rows([[("b", 1.0)], []]):  # b used now: a is the least recently used slot
        model.proj(x)
    with bank.rows([[("c", 1.0)], [("b", 0.5)]]):
        y = model.proj(x)
    assert bank.slots == {"c": 0, "b": 1} and bank.swaps == 1
    assert torch.allclose(y[0], base[0] + _want(model, files["/c"], x[0]), atol=1e-5)
    assert torch.allclose(y[1], base[1] + 0.5 * _want(model, files["/b"], x[1]), atol=1e-5)
    assert reads == ["/c", "/b", "/a"]  # start-up only: c came from the host LRU


def test_host_lru_rereads_from_disk_and_a_reload_is_another_adapter() -> None:
    files = {"/a": _adapter("a", 1), "/b": _adapter("b", 2), "/a2": _adapter("a", 3, module="other")}
    model, registry, bank, reads = _setup(files, ["a", "b"], slots=1, host=1)
    reads.clear()
    with bank.rows([[("b", 1.0)]]):
        pass
    assert reads == ["/b"]  # the LRU held only a (the first start-up adapter)
    entry = registry.begin_unload("a")
    assert registry.names() == ["b"]
    registry.finish_unload(entry)
    registry.add("a", "/a2", files["/a2"])  # another file under the same name, adapting another layer
    x = torch.randn(1, 5)
    base = torch.nn.functional.linear(x, model.other.weight, model.other.bias)
    with bank.rows([[("a", 1.0)]]):
        y = model.other(x)
    assert torch.allclose(y, base + _want(model, files["/a2"], x, "other"), atol=1e-5)
    assert bank.slots == {"a": 0} and bank.layers == 2


def test_a_batch_holds_at_most_max_loras_distinct_adapters() -> None:
    batcher = RequestLevelScheduler(
        BatchingConfig(mode="dynamic", max_size=8, delay_ms=0, max_adapters=2), model_names=["m"]
    )
    for i, lora in enumerate([(("a", 1.0),), (("b", 1.0),), (("c", 1.0),), (), (("a", 0.5), ("b", 1.0))]):
        batcher.add(Request(request_id=str(i), params=SamplingParams(prompt="p", lora=lora), arrival_time=float(i)))
    action = batcher.schedule(10.0)
    assert isinstance(action, Dispatch)
    assert [r.request_id for r in action.batch.requests] == ["0", "1", "3", "4"]
    assert action.batch.rejects == {LORA_SLOTS: 1}


def test_an_adapter_is_fingerprinted_by_its_weights_once_when_read() -> None:
    """The same weights under another name or path give the same fingerprint, other weights under the same name
    another; the registry takes it when the adapter is read (start-up and runtime loads) and answers it by name
    while the adapter is selectable."""
    same = _adapter("a", 1)
    assert same.fingerprint == LoraAdapter("b", "/elsewhere", same.modules).fingerprint
    assert same.fingerprint != _adapter("a", 2).fingerprint
    scaled = {k: LoraModule(m.down, m.up, 0.5) for k, m in same.modules.items()}
    assert LoraAdapter("a", "/a", scaled).fingerprint != same.fingerprint
    files = {"/a": same, "/a2": _adapter("a", 2)}
    _, registry, _, _ = _setup(files, ["a"], slots=1, host=1)
    assert registry.fingerprint("a") == same.fingerprint and registry.fingerprint("nope") is None
    entry = registry.begin_unload("a")
    assert registry.fingerprint("a") is None  # being unloaded: no new request gets it
    registry.finish_unload(entry)
    registry.add("a", "/a2", registry.read("a", "/a2"))
    assert registry.fingerprint("a") == files["/a2"].fingerprint != same.fingerprint


def _request(rid: str, t: float, lora: tuple = (), **params: object) -> Request:
    return Request(request_id=rid, params=SamplingParams(prompt=rid, lora=lora, **params), arrival_time=t)


def test_both_schedulers_name_the_queued_and_running_requests_of_an_adapter() -> None:
    from diffuserve.engine.step_scheduler import StepPlan, StepScheduler

    batcher = RequestLevelScheduler(BatchingConfig(mode="dynamic", max_size=1), model_names=["m"])
    for i, lora in enumerate([(("a", 1.0),), (), (("b", 1.0), ("a", 0.5))]):
        batcher.add(_request(str(i), float(i), lora))
    assert isinstance(batcher.schedule(10.0), Dispatch)  # "0" runs, "1" and "2" wait
    assert [r.request_id for r in batcher.requests_using_adapter("a")] == ["2", "0"]
    steps = StepScheduler(BatchingConfig(mode="continuous", max_size=2), model_names=["m"])
    for i, lora in enumerate([(("a", 1.0),), (("c", 1.0),), (("a", 1.0),)]):
        steps.add(_request(str(i), float(i), lora))
    plan = steps.schedule(10.0)
    assert isinstance(plan, StepPlan) and [e.request.request_id for e in plan.rows] == ["0", "1"]
    assert sorted(r.request_id for r in steps.requests_using_adapter("a")) == ["0", "2"]  # a group row, a queued one
    assert [r.request_id for r in steps.requests_using_adapter("c")] == ["1"]
