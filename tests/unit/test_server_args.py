"""ServerArgs: public name resolution, start-up validation naming the flag, --config files, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffuserve import cli
from diffuserve.config.server_args import EMBEDDED_MODEL_NAME, ServerArgs, load_config_file
from diffuserve.errors import ConfigError
from tests.conftest import log_messages


@pytest.mark.parametrize(
    ("kwargs", "public"),
    [
        ({}, EMBEDDED_MODEL_NAME),
        ({"model_path": "/ckpt/flux"}, "flux"),  # issue 22 item 5: the folder's name, never the server's path
        ({"model_path": "/ckpt/flux/"}, "flux"),
        ({"model_path": "ckpt/flux"}, "flux"),
        ({"model_path": "/ckpt/flux", "model_id": "FLUX.1-dev"}, "FLUX.1-dev"),
        ({"model_path": "/ckpt/flux", "model_id": "FLUX.1-dev", "served_model_name": "prod"}, "prod"),
        ({"served_model_name": "prod"}, "prod"),
    ],
)
def test_public_name_resolution_order(kwargs, public):
    args = ServerArgs(**kwargs)
    assert args.public_model_name == public
    assert args.model_names[0] == public
    if "model_path" in kwargs:
        assert "flux" in args.model_names  # the folder name also matches batching rules and `model`


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"batching_max_size": 0}, "--batching-max-size"),
        ({"batching_delay_ms": -1}, "--batching-delay-ms"),
        ({"max_queue_size": -1}, "--max-queue-size"),
        ({"request_timeout_s": -5}, "--request-timeout-s"),
        ({"port": 70000}, "--port"),
        ({"max_request_bytes": 10}, "--max-request-bytes"),
        ({"model_path": "/no/such/folder"}, "--model-path"),
        ({"batching_config": "/no/such/rules.json"}, "--batching-config"),
    ],
)
def test_invalid_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerArgs(**kwargs).validate()


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("DIFFUSERVE_API_KEY", "from-env")
    assert ServerArgs().resolved_api_key() == "from-env"
    assert ServerArgs(api_key="flag").resolved_api_key() == "flag"


def test_config_file_json_and_yaml(tmp_path: Path):
    known = {"port", "batching_max_size", "enable_batching_metrics"}
    (tmp_path / "a.json").write_text(json.dumps({"--port": 8000, "batching-max-size": 4}))
    assert load_config_file(str(tmp_path / "a.json"), known) == {"port": 8000, "batching_max_size": 4}
    (tmp_path / "b.yaml").write_text("port: 9000\nenable_batching_metrics: true\n")
    assert load_config_file(str(tmp_path / "b.yaml"), known) == {"port": 9000, "enable_batching_metrics": True}
    (tmp_path / "c.json").write_text(json.dumps({"prot": 1}))
    with pytest.raises(ConfigError, match="Did you mean 'port'"):
        load_config_file(str(tmp_path / "c.json"), known)
    (tmp_path / "d.json").write_text("{broken")
    with pytest.raises(ConfigError, match="not valid"):
        load_config_file(str(tmp_path / "d.json"), known)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(str(tmp_path / "missing.json"), known)


def test_command_line_beats_config_file(tmp_path: Path):
    config = tmp_path / "serve.json"
    config.write_text(
        json.dumps(
            {
                "port": 8000,
                "batching_max_size": "4",
                "enable_batching_metrics": "true",
                "component_residency": ["dit=component-offload"],
                "performance_mode": "memory",
            }
        )
    )
    ns = cli._build_parser().parse_args(["serve", "--config", str(config), "--port", "9001"])
    values = cli._merge_config_file(ns)
    args = cli._server_args(values, str(config))
    assert args.http.port == 9001  # the flag wins
    assert args.batching.max_size == 4 and args.batching.enable_metrics is True
    assert args.deployment.component_residency == ["dit=component-offload"]
    assert args.deployment.performance_mode == "memory"


def test_cli_start_up_errors_exit_2_naming_the_flag(capsys):
    assert cli.main(["serve", "--batching-max-size", "0"]) == 2
    assert "--batching-max-size" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--output-file-name", "../up"]) == 2
    assert "--output-file-name" in capsys.readouterr().err


def test_bool_flags_accept_true_false_and_bare():
    parser = cli._build_parser()
    assert parser.parse_args(["serve", "--enable-warmup", "false"]).enable_warmup is False
    assert parser.parse_args(["serve", "--enable-batching-metrics"]).enable_batching_metrics is True
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--enable-warmup", "maybe"])


def test_thread_default_leaves_a_core_for_serving(monkeypatch):
    from diffuserve.launch.setup import resolve_num_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert resolve_num_threads(None, "cpu") == 7
    assert resolve_num_threads(3, "cpu") == 3
    assert resolve_num_threads(None, "cuda") is None
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert resolve_num_threads(None, "cpu") == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolve_num_threads(None, "cpu") is None
    with pytest.raises(ConfigError, match="--num-threads"):
        ServerArgs(num_threads=0).validate()


# -- flags owned by their config: one declaration per flag, the same CLI as before -----------------------
SNAPSHOT = Path(__file__).with_name("cli_flags_snapshot.json")
"""serve / generate / plan flags as they were before the flags moved onto their sub-configs (commit f87b464), plus
`plan --backend` and `plan --batching-mode` (issue 18: the plan refuses what start-up refuses), plus the `LoRA` flags
of serve (issue 20), plus the `Quantization` flags of serve, generate and plan and `--transformer-path` (issue 28), plus
`--allowed-media-domains` and `--media-fetch-timeout-s` of serve (issue 32), plus serve's `--batching-max-tokens` and
`--batching-order` (issue 31)."""


def flag_table(command: str) -> dict[str, dict]:
    """dest -> what `diffuserve COMMAND --help` and `--config` show of the flag: names, section, default
    (the dataclass default where the flag has one), choices, nargs and metavar."""
    from diffuserve.config.argparse_dataclass import flag_dest, flag_fields
    from diffuserve.config.deployment import DeploymentArgs
    from diffuserve.config.server_args import SECTIONS

    owners = [cls() for cls in (*SECTIONS.values(), DeploymentArgs)]
    defaults = {flag_dest(f): getattr(owner, f.name) for owner in owners for f in flag_fields(type(owner))}
    sub = cli._subparsers(cli._build_parser())[command]
    table = {}
    for group in sub._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            default = defaults[action.dest] if action.dest in defaults else action.default
            table[action.dest] = {
                "flags": list(action.option_strings),
                "group": group.title,
                "default": json.loads(json.dumps(default, default=str)),
                "choices": None if action.choices is None else [str(c) for c in action.choices],
                "nargs": action.nargs,
                "metavar": action.metavar,
                "kind": type(action).__name__,
            }
    return table


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
def test_flags_groups_and_defaults_are_unchanged(command):
    assert flag_table(command) == json.loads(SNAPSHOT.read_text())[command]


def test_each_flag_is_declared_once_on_its_sub_config():
    import dataclasses

    from diffuserve.config.argparse_dataclass import flag_commands, flag_dest, flag_fields
    from diffuserve.config.deployment import DeploymentArgs
    from diffuserve.config.server_args import SECTIONS

    owners: dict[str, str] = {}
    for cls in [*SECTIONS.values(), DeploymentArgs]:
        for f in flag_fields(cls):
            assert flag_dest(f) not in owners, (
                f"{flag_dest(f)} declared by {owners.get(flag_dest(f))} and {cls.__name__}"
            )
            owners[flag_dest(f)] = cls.__name__
            assert f.metadata.get("help") and f.metadata.get("group"), f"{cls.__name__}.{f.name}: help and group"
            assert set(flag_commands(cls, f)) <= {"serve", "generate", "plan"}
    # ServerArgs declares no flag itself: its fields are the sub-configs; a flag's flat name is a keyword, not an
    # attribute (code reads the section).
    assert [f.name for f in dataclasses.fields(ServerArgs)] == [*SECTIONS, "deployment", "config"]
    args = ServerArgs(batching_max_size=3, port=8000)
    assert args.batching.max_size == 3 and args.http.port == 8000
    assert not hasattr(args, "batching_max_size") and not hasattr(args, "port")
    # Every flag a subcommand has comes from a config dataclass, except the command's own inputs.
    own = {
        "serve": {"config"},
        "plan": {"config", "gpu_memory_gib", "json"},
        "generate": {
            "config",
            "prompt",
            "negative_prompt",
            "width",
            "height",
            "num_inference_steps",
            "guidance_scale",
            "true_cfg_scale",
            "seed",
            "num_outputs_per_prompt",
            "output_path",
            "output_file_name",
            "output_format",
            "num_frames",
            "fps",
            "generate_audio",
            "image_path",
            "strength",
            "mask_path",
            "padding_mask_crop",
        },
    }
    for command, extra in own.items():
        assert set(flag_table(command)) - set(owners) == extra


def test_replace_and_flat_keywords_copy_sub_configs():
    import dataclasses

    args = ServerArgs(model_path="/ckpt", batching_max_size=2)
    other = dataclasses.replace(args, model_path=None)
    assert other.model.model_path is None and other.batching.max_size == 2
    assert args.model.model_path == "/ckpt", "replace must not write into the original's sub-configs"
    with pytest.raises(TypeError, match="batching_max_szie"):
        ServerArgs(batching_max_szie=2)


def test_batching_mode_is_a_str_enum_behind_the_argparse_choices():
    from diffuserve.config.batching import BatchingConfig, BatchingMode

    parser = cli._build_parser()
    serve = {a.dest: a for a in cli._subparsers(parser)["serve"]._actions}
    assert serve["batching_mode"].choices == [m.value for m in BatchingMode]
    args = cli._server_args(cli._merge_config_file(parser.parse_args(["serve", "--batching-mode", "dynamic"])), None)
    assert args.batching.mode is BatchingMode.DYNAMIC and args.batching.mode == "dynamic"
    assert json.dumps({"mode": args.batching.mode}) == '{"mode": "dynamic"}' and f"{args.batching.mode}" == "dynamic"
    assert BatchingConfig(mode="continuous").dynamic is False and BatchingConfig(mode="continuous", max_size=2).dynamic


def test_a_flag_is_validated_once_with_one_message():
    from diffuserve.config.batching import BatchingConfig
    from diffuserve.engine.engine import EngineConfig
    from diffuserve.engine.scheduler import BatchingConfig as SchedulerBatchingConfig

    assert SchedulerBatchingConfig is BatchingConfig  # the engine imports the flags' owner, no copy
    with pytest.raises(ConfigError) as from_args:
        ServerArgs(batching_max_size=0).validate()
    with pytest.raises(ConfigError) as from_config:
        BatchingConfig(max_size=0).validate()
    assert (
        from_args.value.message
        == from_config.value.message
        == ("--batching-max-size: 0 must be >= 1 (1 turns merging off).")
    )
    assert EngineConfig().max_queue_size == ServerArgs().engine.max_queue_size == 256


def test_store_flags_fail_at_start_naming_the_flag():
    assert ServerArgs(results_db="postgresql://u:p@db:5432/d", media_store="s3://b/p").validate() is None
    for flags, message in [
        ({"results_db": "sqlite:///x"}, "--results-db: 'sqlite:///x' is not a PostgreSQL URL"),
        ({"media_store": "s3:/b"}, "--media-store: 's3:/b' is not an S3 URL"),
        ({"s3_endpoint_url": "http://x"}, "--s3-endpoint-url: only applies with --media-store"),
        ({"media_presign_s": 60}, "--media-presign-s: needs --media-store"),
        ({"owner_timeout_s": 3, "result_sweep_interval_s": 2}, "--owner-timeout-s: 3 must exceed"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ServerArgs(**flags).validate()


def test_merging_modes_that_never_merge_warn_and_both_schedulers_take_max_loras(caplog):
    """`--batching-mode dynamic` (or continuous) with the default `--batching-max-size 1` merges nothing: one warning
    line says so and what to set. Both schedulers read `--max-loras` from their config when LoRA is on."""
    import logging

    from diffuserve.launch.root import build_batcher

    with caplog.at_level(logging.WARNING, logger="diffuserve"):
        build_batcher(ServerArgs(batching_mode="dynamic"))
    warned = log_messages(caplog, level=logging.WARNING)
    assert warned == [
        "--batching-mode dynamic with --batching-max-size 1: no two requests will ever be merged (each batch runs "
        "one request); set --batching-max-size N (e.g. 4) to merge up to N rows."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffuserve"):
        build_batcher(ServerArgs())  # singleton: nothing to say
        build_batcher(ServerArgs(batching_mode="dynamic", batching_max_size=4))
    assert not caplog.records
    for mode in ("dynamic", "continuous"):
        lora = ServerArgs(batching_mode=mode, batching_max_size=4, lora_modules=["a=/a"], max_loras=2)
        assert build_batcher(lora).config.max_adapters == 2
        assert build_batcher(ServerArgs(batching_mode=mode, batching_max_size=4)).config.max_adapters is None


def test_step_cache_is_a_section_and_its_flag_a_keyword():
    from diffuserve.config.step_cache_args import StepCacheArgs

    assert ServerArgs(step_cache="fbcache").step_cache == StepCacheArgs(method="fbcache")
    assert ServerArgs(step_cache=StepCacheArgs(method="teacache"), step_cache_config="{}").step_cache.options == "{}"
