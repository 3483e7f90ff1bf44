"""`step_cache` settings (config/step_cache.py): every accepted shape, every refusal naming the field, the server
flags, and which part joins the batch signature."""

from __future__ import annotations

import pytest

from diffuserve.config.step_cache import (
    StepCacheSettings,
    parse_step_cache,
    server_step_cache,
    with_calibration,
)
from diffuserve.config.step_cache_args import StepCacheArgs
from diffuserve.errors import ConfigError, InvalidRequestError
from diffuserve.sampling import SamplingParams, signature_difference


def test_accepted_shapes() -> None:
    assert parse_step_cache(None) is None and parse_step_cache("off") is None
    assert parse_step_cache({"method": "off"}) is None
    assert parse_step_cache("fbcache") == StepCacheSettings(method="fbcache")
    settings = parse_step_cache({"method": "taylorseer", "order": 2, "refresh_interval": 3})
    assert (settings.method, settings.order, settings.refresh_interval) == ("taylorseer", 2, 3)
    assert parse_step_cache('{"method": "teacache", "threshold": 0.3}').resolved_threshold == 0.3
    assert parse_step_cache("fbcache").resolved_threshold == 0.12  # the method's default


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("deepcache", "unknown method"),
        ({"method": "fbcache", "threshold": 11}, "out of range"),
        ({"method": "fbcache", "threshold": "high"}, "must be a number"),
        ({"method": "taylorseer", "order": 1.5}, "whole number"),
        ({"method": "taylorseer", "refresh_interval": 0}, "out of range"),
        ({"method": "fbcache", "speed": 2}, "unknown option"),
        ({"threshold": 0.1}, "no 'method'"),
        (["fbcache"], "must be a method name"),
        ("{not json", "not valid JSON"),
    ],
)
def test_refusals_name_the_field(value: object, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as raised:
        parse_step_cache(value)
    assert raised.value.param == "step_cache"


def test_server_flags() -> None:
    assert server_step_cache(None, None) is None
    settings = server_step_cache("fbcache", '{"threshold": 0.2, "warmup_steps": 1}')
    assert (settings.threshold, settings.warmup_steps) == (0.2, 1)
    StepCacheArgs(method="teacache").validate()
    with pytest.raises(ConfigError, match="--step-cache"):
        StepCacheArgs(method="magic").validate()
    with pytest.raises(ConfigError, match="--step-cache-config"):
        StepCacheArgs(options='{"threshold": 0.1}').validate()


def test_magcache_needs_the_servers_calibration(tmp_path) -> None:
    asked = parse_step_cache("magcache")
    with pytest.raises(InvalidRequestError, match="--step-cache-calibration") as raised:
        with_calibration(asked, None)
    assert raised.value.param == "step_cache"
    (tmp_path / "mag.json").write_text('{"mag_ratios": [1.0, 0.98, 0.95]}')
    assert with_calibration(asked, str(tmp_path / "mag.json")).mag_ratios == (1.0, 0.98, 0.95)
    (tmp_path / "bad.json").write_text('{"ratios": []}')
    with pytest.raises(ConfigError, match="calibrate-cache"):
        StepCacheArgs(method="magcache", calibration=str(tmp_path / "bad.json")).validate()
    with pytest.raises(ConfigError, match="--step-cache-calibration"):
        StepCacheArgs(method="magcache").validate()


def test_only_the_method_joins_the_batch_signature() -> None:
    loose = SamplingParams(step_cache=parse_step_cache({"method": "fbcache", "threshold": 0.05}))
    tight = SamplingParams(step_cache=parse_step_cache({"method": "fbcache", "threshold": 0.3, "warmup_steps": 4}))
    assert signature_difference(loose, tight) is None
    assert signature_difference(loose, SamplingParams()) == "sampling_params.step_cache_method"
    assert signature_difference(loose, SamplingParams(step_cache=parse_step_cache("teacache"))) is not None
