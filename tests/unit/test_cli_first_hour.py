"""What a new user meets first in the CLI: --config checked per command, clean errors with exit 2,
did-you-mean for misspelt flags, help texts, output names, the row cap's plan of pipeline calls,
prompt token counting, and the error counter of /metrics. No weights are loaded here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffuserve import cli
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.executor.batch_runner import plan_calls, split_request
from diffuserve.generate import output_names
from diffuserve.sampling import SamplingParams


def _config(tmp_path: Path, data: dict, name: str = "c.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _merge(argv: list[str]) -> dict:
    parser = cli._build_parser()
    return cli._merge_config_file(parser.parse_args(argv), parser)


def test_generate_config_accepts_generation_keys(tmp_path: Path):
    config = _config(
        tmp_path,
        {
            "prompt": ["a cat", "a dog"],
            "output-path": "out",
            "num-inference-steps": "3",
            "num_outputs_per_prompt": 2,
            "seed": 5,
            "batching-max-size": 2,
        },
    )
    values = _merge(["generate", "--config", config, "--seed", "9"])
    assert values["prompt"] == ["a cat", "a dog"] and values["output_path"] == "out"
    assert values["num_inference_steps"] == 3 and values["num_outputs_per_prompt"] == 2
    assert values["seed"] == 9, "the command line wins over the file"
    assert _merge(["generate", "--config", _config(tmp_path, {"prompt": "one"})])["prompt"] == ["one"]
    # A prompt on the command line replaces the file's list.
    assert _merge(["generate", "--config", config, "--prompt", "x"])["prompt"] == ["x"]


@pytest.mark.parametrize(
    ("command", "key", "owner"),
    [
        ("generate", "port", "serve"),
        ("generate", "api-key", "serve"),
        ("generate", "batching-delay-ms", "serve"),
        ("serve", "prompt", "generate"),
        ("serve", "output-path", "generate"),
    ],
)
def test_config_key_of_another_command_names_it(tmp_path: Path, capsys, command, key, owner):
    config = _config(tmp_path, {key: "1"})
    assert cli.main([command, "--config", config]) == 2
    err = capsys.readouterr().err
    assert f"diffuserve {owner}" in err and repr(key) in err and config in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"port": "abc"}, ["'port'", "'abc'", "--port", "an integer"]),
        ({"port": 1.5}, ["'port'", "1.5", "an integer"]),
        ({"enable-warmup": "maybe"}, ["'enable-warmup'", "'maybe'", "true or false"]),
        ({"log-level": "verbose"}, ["'log-level'", "'verbose'", "debug, info, warning, error"]),
        ({"batching-max-size": True}, ["'batching-max-size'", "True", "an integer"]),
        ({"component-residency": {"dit": "resident"}}, ["'component-residency'"]),
    ],
)
def test_bad_config_values_exit_2_with_file_key_value_and_allowed(tmp_path: Path, capsys, data, expected):
    config = _config(tmp_path, data)
    assert cli.main(["serve", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffuserve serve: configuration error: --config " + config)
    for part in expected:
        assert part in err, err
    assert "Traceback" not in err


def test_bad_config_value_in_a_real_process_has_no_traceback(tmp_path: Path):
    config = _config(tmp_path, {"port": "abc"}, "serve.json")
    out = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "serve", "--config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "'abc'" in out.stderr and "--port" in out.stderr


def test_yaml_config_values_are_coerced_like_flags(tmp_path: Path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 8001\nenable-warmup: 'false'\ncomponent-residency: dit=component-offload vae=resident\n")
    values = _merge(["serve", "--config", str(path)])
    assert values["port"] == 8001 and values["enable_warmup"] is False
    assert values["component_residency"] == ["dit=component-offload", "vae=resident"]


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["serve", "--batching-max-szie", "3"], "--batching-max-size"),
        (["generate", "--prompt", "x", "--num-inferense-steps", "2"], "--num-inference-steps"),
        (["bench", "--concurency", "2"], "--concurrency"),
    ],
)
def test_unknown_flag_shows_subcommand_usage_and_closest_flag(capsys, argv, suggestion):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: diffuserve {argv[0]} ")
    assert f"did you mean {suggestion}?" in err


def test_generate_needs_a_prompt_from_flags_or_config(tmp_path: Path, capsys):
    assert cli.main(["generate", "--config", _config(tmp_path, {"seed": 1})]) == 2
    assert "--prompt is required" in capsys.readouterr().err


def test_make_tiny_and_bench_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["make-tiny", "--help"])
    text = capsys.readouterr().out
    from diffuserve.family_spec import tiny_builds

    # argparse may wrap a line after a hyphen inside a name (`qwen-` / `image-edit`): rejoin those.
    assert "Model family: " + ", ".join(sorted(tiny_builds())) in " ".join(text.split()).replace("- ", "-")
    assert {"flux", "wan"} <= set(tiny_builds()) and "{tiny,36m}" in text
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in (
        "(default: http://127.0.0.1:30010)",
        "(default: 32)",
        "(default: inf)",
        "(default: 1)",
        "(default: images)",
        "(default: 0)",
        "--allow-failures",
    ):
        assert shown in text, shown


def test_output_names_index_prompts_and_outputs_the_same_with_or_without_a_stem():
    derived = output_names(["a cat", "a dog"], 2, None)
    named = output_names(["a cat", "a dog"], 2, "pets")
    assert derived == [["a_cat_0_0", "a_cat_0_1"], ["a_dog_1_0", "a_dog_1_1"]]
    assert named == [["pets_0_0", "pets_0_1"], ["pets_1_0", "pets_1_1"]]
    assert output_names(["a cat"], 1, None) == [["a_cat"]] and output_names(["a cat"], 1, "x") == [["x"]]
    # Equal prompts never overwrite each other.
    assert len({n for row in output_names(["same", "same"], 1, None) for n in row}) == 2


def test_row_cap_splits_a_request_keeping_each_rows_seed():
    big = SamplingParams(prompt="p", n=5, seed=100)
    parts = split_request(big, 2)
    assert [(p.n, p.seed) for p in parts] == [(2, 100), (2, 102), (1, 104)]
    assert split_request(big, 8) == [big]
    unseeded = split_request(SamplingParams(prompt="p", n=3, seed=None), 2)
    assert unseeded[1].seed == unseeded[0].seed + 2, "one drawn seed continues across parts"
    small = SamplingParams(prompt="q", n=1, seed=7)
    calls = plan_calls([big, small], 2)
    assert [[(i, first, p.n) for i, first, p in call] for call in calls] == [
        [(0, 0, 2)],
        [(0, 2, 2)],
        [(0, 4, 1), (1, 0, 1)],
    ]
    assert all(sum(p.n for _, _, p in call) <= 2 for call in calls)
    assert len(plan_calls([big, small], None)) == 1 and len(plan_calls([big, small], 6)) == 1


def test_prompt_token_counting_with_real_tokenizers():
    from diffuserve.models.tiny import build_tokenizers
    from diffuserve.pipelines.prompt_limits import PromptTokens, TextEncoderLimit

    clip, t5 = build_tokenizers(t5_max_length=64)
    limits = [TextEncoderLimit("text_encoder (CLIP)", clip, 77), TextEncoderLimit("text_encoder_2 (T5)", t5, 64)]
    assert PromptTokens(limits).count({"prompt": "a red fox", "negative_prompt": None}).truncations == ()
    long = " ".join(["fox"] * 100)
    found = PromptTokens(limits).count({"prompt": long, "negative_prompt": "blurry"}).truncations
    assert [(f.field, f.encoder) for f in found] == [
        ("prompt", "text_encoder (CLIP)"),
        ("prompt", "text_encoder_2 (T5)"),
    ]
    clip_tokens = found[0].tokens
    assert clip_tokens == len(clip(long)["input_ids"]) > 77
    assert found[0].message.startswith(f"prompt is {clip_tokens} tokens for text_encoder (CLIP), which takes 77")


def test_error_responses_are_counted_by_status_and_reason():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = EngineMetrics()
    metrics.observe_error(401, "invalid_api_key")
    metrics.observe_error(401, "invalid_api_key")
    metrics.observe_error(429, "queue_full")
    text = metrics.render()[0].decode()
    samples = {
        (s.labels["status"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "diffuserve_error_responses_total"
    }
    assert samples == {("401", "invalid_api_key"): 2.0, ("429", "queue_full"): 1.0}


def test_component_residency_error_lists_components_once_and_what_groups_cover():
    from diffuserve.errors import ConfigError
    from tests.unit.test_deployment import plan_for

    with pytest.raises(ConfigError) as bad:
        plan_for("flux", component_residency=["dti=resident"])
    message = bad.value.message
    assert "unknown component or group 'dti'. Did you mean 'dit'?" in message
    components = message.split("This model's components: ", 1)[1].split(".", 1)[0]
    assert components == "transformer, text_encoder, text_encoder_2, vae"
    assert (
        "Groups: dit (transformer); text_encoder (text_encoder, text_encoder_2); image_encoder (none in this "
        "model); vae (vae); other (none in this model); all (every component)."
    ) in message


def test_reject_truncated_prompts_is_a_400_naming_the_field():
    """The server-side check (server/common.py) with the FLUX limits and the real tiny tokenizers."""
    from types import SimpleNamespace

    from diffuserve.errors import InvalidRequestError
    from diffuserve.models.tiny import build_tokenizers
    from diffuserve.pipelines.prompt_limits import PromptTokens, TextEncoderLimit
    from diffuserve.sampling import ModelDescription
    from diffuserve.server.common import check_prompt

    clip, t5 = build_tokenizers(t5_max_length=64)
    limits = [TextEncoderLimit("text_encoder (CLIP)", clip, 77), TextEncoderLimit("text_encoder_2 (T5)", t5, 64)]
    model = ModelDescription(family="flux", prompt_tokens=PromptTokens(limits))

    def ctx(reject: bool) -> SimpleNamespace:
        return SimpleNamespace(
            engine=SimpleNamespace(model=model),
            args=SimpleNamespace(limits=SimpleNamespace(reject_truncated_prompts=reject)),
        )

    long = " ".join(["fox"] * 70)
    counts = [len(clip(long)["input_ids"]), len(t5(long)["input_ids"])]
    assert check_prompt(ctx(False), {"prompt": "a fox", "negative_prompt": long}).warnings == [
        f"negative_prompt is {counts[0]} tokens for text_encoder (CLIP), which takes 77; "
        f"the last {counts[0] - 77} tokens are cut off",
        f"negative_prompt is {counts[1]} tokens for text_encoder_2 (T5), which takes 64; "
        f"the last {counts[1] - 64} tokens are cut off",
    ]
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt(ctx(True), {"prompt": long, "negative_prompt": None})
    assert refused.value.param == "prompt" and refused.value.http_status == 400
    assert "--reject-truncated-prompts" in refused.value.message
    assert check_prompt(ctx(True), {"prompt": "a fox", "negative_prompt": None}).warnings == []


@pytest.mark.parametrize(
    ("command", "sections"),
    [
        (
            "serve",
            [
                "Model",
                "Server",
                "Results store",
                "Batching",
                "Admission, limits and security",
                "LoRA",
                "ControlNet",
                "Quantization",
                "Distributed launch (several ranks, several hosts)",
            ],
        ),
        (
            "generate",
            [
                "Generation",
                "Model",
                "Server",
                "Batching",
                "ControlNet",
                "Quantization",
                "Distributed launch (several ranks, several hosts)",
            ],
        ),
        ("plan", ["Admission, limits and security", "Quantization"]),
    ],
)
def test_help_sections_keep_their_order(capsys, command, sections):
    """The flags come from the sub-configs (config/), each in its `--help` section, in the order users know."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    titles = [line[:-1] for line in capsys.readouterr().out.splitlines() if line.endswith(":") and line[:1].isupper()]
    deployment = [
        "Deployment: performance mode and residency",
        "Deployment: layer-wise offload",
        "Deployment: compile and CUDA graphs",
        "Deployment: GPUs and parallelism",
    ]
    assert titles == sections + deployment
