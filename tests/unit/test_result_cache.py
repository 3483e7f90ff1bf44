"""The exact-result cache's table (server/result_cache.py): what its key covers, the byte bound (LRU), retention
(`--result-ttl-s` and the url row in the results store) and the serving identity (model name, checkpoint)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from diffuserve.config.server_args import ServerArgs
from diffuserve.config.step_cache import parse_step_cache
from diffuserve.sampling import SamplingParams
from diffuserve.server.result_cache import CacheKey, ResultCache, serving_identity

BASE = SamplingParams(prompt="a red circle", seed=1, num_inference_steps=4)


def test_the_key_covers_every_setting_and_needs_a_seed() -> None:
    cache = ResultCache(1 << 20, "model")
    key = cache.key(BASE, seed_given=True)
    assert key == cache.key(dataclasses.replace(BASE), seed_given=True)
    assert cache.key(BASE, seed_given=False) is None  # the server drew the seed: never determined
    changes = [
        {"seed": 2},
        {"prompt": "a blue circle"},
        {"negative_prompt": "blurry"},
        {"width": 128},
        {"num_inference_steps": 5},
        {"guidance_scale": 2.0},
        {"step_cache": parse_step_cache({"method": "fbcache", "threshold": 0.2})},
        {"lora": (("style", 0.5),)},
        {"image_inputs": (b"png bytes",)},
        {"output_format": "jpeg"},
    ]
    keys = {cache.key(dataclasses.replace(BASE, **change), seed_given=True) for change in changes}
    assert key not in keys and len(keys) == len(changes)
    images = [dataclasses.replace(BASE, image_inputs=(b"a",)), dataclasses.replace(BASE, image_inputs=(b"b",))]
    assert cache.key(images[0], seed_given=True) != cache.key(images[1], seed_given=True)
    assert ResultCache(1 << 20, "other model").key(BASE, seed_given=True) != key


def test_least_recently_used_go_first_within_the_byte_budget() -> None:
    cache = ResultCache(10, "m")
    cache.store(CacheKey("a"), [b"1234"], None)
    cache.store(CacheKey("b"), [b"1234"], None)
    assert cache.lookup(CacheKey("a")) is not None  # now the most recently used
    cache.store(CacheKey("c"), [b"1234"], None)  # 12 bytes > 10: "b" goes
    assert cache.lookup(CacheKey("b")) is None and cache.lookup(CacheKey("a")).blobs == (b"1234",) and len(cache) == 2
    cache.store(CacheKey("huge"), [b"x" * 11], None)  # larger than the whole budget: not kept, nothing evicted
    assert cache.lookup(CacheKey("huge")) is None and len(cache) == 2
    assert cache.size_bytes._value.get() == 8 and cache.entries._value.get() == 2


def test_hits_and_misses_are_counted() -> None:
    cache = ResultCache(100, "m")
    cache.store(CacheKey("k"), [b"x"], {"method": "fbcache"})
    cache.lookup(CacheKey("k"))
    cache.lookup(CacheKey("other"))
    cache.lookup(None)  # no seed
    assert cache.requests.labels("hit")._value.get() == 1 and cache.requests.labels("miss")._value.get() == 2


class _Store:
    """The results store's `get`, for the rows the test keeps."""

    def __init__(self) -> None:
        self.rows: set[str] = set()

    def get(self, record_id: str) -> object | None:
        return object() if record_id in self.rows else None


def test_entries_follow_the_results_store_retention() -> None:
    now = [1000.0]
    store = _Store()
    cache = ResultCache(100, "m", ttl_s=60, results=store, clock=lambda: now[0])  # type: ignore[arg-type]
    cache.store(CacheKey("b64"), [b"x"], None)
    store.rows.add("row-1")
    cache.store(CacheKey("url"), [b"y"], None, record_id="row-1")
    now[0] += 59
    assert cache.lookup(CacheKey("b64")) is not None and cache.lookup(CacheKey("url")) is not None
    store.rows.discard("row-1")  # evicted or deleted from the store: the entry goes with it
    assert cache.lookup(CacheKey("url")) is None
    store.rows.add("row-2")
    cache.store(CacheKey("url"), [b"y"], None, record_id="row-2")
    cache.repoint(CacheKey("url"), "row-3")  # a url hit wrote the bytes again under a newer row
    assert cache.lookup(CacheKey("url")) is None  # row-3 is not in the store
    now[0] += 1  # --result-ttl-s passed since the result was made: expired, as the store expires its rows
    assert cache.lookup(CacheKey("b64")) is None and len(cache) == 0


def test_concurrent_use_keeps_the_bound() -> None:
    cache = ResultCache(64, "m")
    start = threading.Barrier(4)

    def work(offset: int) -> None:
        start.wait()
        for i in range(200):
            cache.store(CacheKey(f"{offset}-{i}"), [b"12345678"], None)
            cache.lookup(CacheKey(f"{offset}-{i - 1}"))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) == 8 and cache.size_bytes._value.get() == 64


def test_the_identity_changes_with_the_served_name_and_the_checkpoint(tmp_path: Path) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
        (tmp_path / name / "weights.safetensors").write_bytes(name.encode() * 10)
    one = serving_identity(ServerArgs(model_path=str(tmp_path / "one"), served_model_name="a"), None)
    assert one == serving_identity(ServerArgs(model_path=str(tmp_path / "one"), served_model_name="a"), None)
    assert one != serving_identity(ServerArgs(model_path=str(tmp_path / "one"), served_model_name="b"), None)
    assert one != serving_identity(ServerArgs(model_path=str(tmp_path / "two"), served_model_name="a"), None)
    assert one != serving_identity(ServerArgs(model_path=str(tmp_path / "one"), served_model_name="a"), {"tp": 2})


def test_an_adapter_is_keyed_by_its_weights_and_its_entries_go_with_them() -> None:
    """The key holds an adapter's fingerprint, not its name: `a` loaded again from other files is another key, the
    same weights under another name the same key. An entry lives while each name selects the weights it was made
    with (`drop_stale_adapters`, which the LoRA routes call after each load and unload), and an answer whose
    adapter changed while it ran is not stored. An adapter being unloaded (no fingerprint) is not cached."""
    loaded = {"a": "weights-1"}
    cache = ResultCache(100, "m", adapters=loaded.get)
    styled = dataclasses.replace(BASE, lora=(("a", 1.0),))
    first = cache.key(styled, seed_given=True)
    assert first is not None and first.adapters == (("a", "weights-1"),)
    assert cache.key(BASE, seed_given=True).adapters == ()
    cache.store(first, [b"a1 image"], None)
    cache.store(cache.key(BASE, seed_given=True), [b"base image"], None)
    loaded["b"] = "weights-1"  # the same weights under another name: the same answer
    assert cache.key(dataclasses.replace(BASE, lora=(("b", 1.0),)), seed_given=True).digest == first.digest
    del loaded["a"]  # unloaded
    assert cache.key(styled, seed_given=True) is None
    assert cache.drop_stale_adapters() == 1 and len(cache) == 1  # the base image stays
    loaded["a"] = "weights-2"  # loaded again from other files
    second = cache.key(styled, seed_given=True)
    assert second.digest != first.digest and cache.lookup(second) is None
    cache.store(first, [b"a1 image"], None)  # made with the old weights, answered after the reload: not kept
    assert cache.lookup(first) is None and len(cache) == 1
    cache.store(second, [b"a2 image"], None)
    assert cache.lookup(second).blobs == (b"a2 image",) and cache.entries._value.get() == 2
