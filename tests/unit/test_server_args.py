"""ServerArgs: public name resolution, start-up validation naming the flag, --config files, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffuserve import cli
from diffuserve.config.server_args import EMBEDDED_MODEL_NAME, ServerArgs, load_config_file
from diffuserve.errors import ConfigError


@pytest.mark.parametrize(("kwargs", "public"), [
    ({}, EMBEDDED_MODEL_NAME),
    ({"model_path": "/ckpt/flux"}, "/ckpt/flux"),
    ({"model_path": "/ckpt/flux", "model_id": "FLUX.1-dev"}, "FLUX.1-dev"),
    ({"model_path": "/ckpt/flux", "model_id": "FLUX.1-dev", "served_model_name": "prod"}, "prod"),
    ({"served_model_name": "prod"}, "prod"),
])
def test_public_name_resolution_order(kwargs, public):
    args = ServerArgs(**kwargs)
    assert args.public_model_name == public
    assert args.model_names[0] == public
    if "model_path" in kwargs:
        assert "flux" in args.model_names  # the folder name also matches batching rules and `model`


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"batching_max_size": 0}, "--batching-max-size"),
    ({"batching_delay_ms": -1}, "--batching-delay-ms"),
    ({"max_queue_size": -1}, "--max-queue-size"),
    ({"request_timeout_s": -5}, "--request-timeout-s"),
    ({"port": 70000}, "--port"),
    ({"max_request_bytes": 10}, "--max-request-bytes"),
    ({"model_path": "/no/such/folder"}, "--model-path"),
    ({"batching_config": "/no/such/rules.json"}, "--batching-config"),
])
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
    config.write_text(json.dumps({"port": 8000, "batching_max_size": "4", "enable_batching_metrics": "true",
                                  "component_residency": ["dit=component-offload"], "performance_mode": "memory"}))
    ns = cli._build_parser().parse_args(["serve", "--config", str(config), "--port", "9001"])
    values = cli._merge_config_file(ns)
    args = cli._server_args(values, str(config))
    assert args.port == 9001  # the flag wins
    assert args.batching_max_size == 4 and args.enable_batching_metrics is True
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
