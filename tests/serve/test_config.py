"""ServeConfig: defaults, validation naming the field, TOML loading, and the precedence
flags > environment > TOML file > defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from omni_trio.config import EngineConfig
from omni_trio.errors import InvalidConfigError
from omni_trio.serve.config import (
    API_KEY_ENV,
    API_KEYS_ENV,
    FLAGS,
    ServeConfig,
    add_serve_arguments,
    is_loopback,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = ServeConfig()
    assert config.host == "127.0.0.1"
    assert config.port == 8000
    assert config.api_key is None
    assert config.replicas == 1
    assert config.drain_timeout_s == 30.0
    assert config.max_queue_len == 64
    assert config.restart_wait_s == 60.0
    assert config.max_body_bytes == 1_000_000
    assert config.max_prompt_chars == 4000
    assert config.max_n == 4
    assert config.max_pixels == 1024 * 1024
    assert config.max_steps == 200
    assert config.url_ttl_s == 600.0
    assert config.url_store_max_bytes == 256 * 1024 * 1024
    assert config.api_keys == () and config.public_url is None
    assert config.max_connections == 1000
    assert config.keep_alive_timeout_s == 5.0
    assert config.body_read_timeout_s == 30.0
    assert config.send_timeout_s == 30.0
    assert config.max_connection_buffer_bytes == 1024 * 1024
    assert config.max_response_bytes_in_flight == 256 * 1024 * 1024
    assert config.log_format == "text"
    assert config.log_level == "info"
    assert config.engine == EngineConfig()
    assert config.served_model_name == config.engine.model
    assert config.bind == "127.0.0.1:8000"
    assert not config.exposed_without_key


def test_api_key_not_in_repr() -> None:
    assert "s3cret" not in repr(ServeConfig(api_key="s3cret"))
    assert "s3cret" not in repr(ServeConfig(api_keys=("s3cret", "other")))


def test_api_keys_from_toml_and_env(tmp_path: Path) -> None:
    path = write(tmp_path, 'api_keys = ["k1", "k2", "k1"]\n[engine]\nmodel = "builtin:echo"\n')
    config = ServeConfig.from_toml(path, environ={})
    assert config.api_keys == ("k1", "k2")  # once each
    assert config.all_api_keys == ("k1", "k2")
    config = ServeConfig.from_toml(path, environ={API_KEYS_ENV: " e1, e2 ,", API_KEY_ENV: "k0"})
    assert config.api_keys == ("e1", "e2")
    assert config.all_api_keys == ("k0", "e1", "e2")
    assert not ServeConfig(host="0.0.0.0", api_keys=("k",)).exposed_without_key


def test_public_url_is_checked_and_normalised() -> None:
    assert ServeConfig(public_url="https://x.example/omni/").public_url == "https://x.example/omni"
    assert ServeConfig(public_url="http://[::1]:8000").public_url == "http://[::1]:8000"
    for bad in ("ftp://x", "x.example", "https://", "https://u:p@x", "http://x/?q=1", "http://x:y"):
        with pytest.raises(InvalidConfigError) as info:
            ServeConfig(public_url=bad)
        assert info.value.field == "public_url"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("host", ""),
        ("port", -1),
        ("port", 65536),
        ("port", "80"),
        ("port", True),
        ("api_key", ""),
        ("model_name", ""),
        ("replicas", 0),
        ("stage", "thread"),
        ("drain_timeout_s", -1.0),
        ("drain_timeout_s", float("nan")),
        ("max_queue_len", 0),
        ("restart_wait_s", 0),
        ("restart_wait_s", -1.0),
        ("restart_wait_s", float("inf")),
        ("max_body_bytes", 0),
        ("max_prompt_chars", 0),
        ("max_n", 0),
        ("max_pixels", 0),
        ("max_steps", 0),
        ("url_ttl_s", 0),
        ("url_store_max_bytes", 0),
        ("api_keys", "one-string"),
        ("api_keys", ("",)),
        ("api_keys", ("has space",)),
        ("public_url", 3),
        ("max_connections", 0),
        ("keep_alive_timeout_s", 0),
        ("body_read_timeout_s", 0),
        ("body_read_timeout_s", float("inf")),
        ("send_timeout_s", -1),
        ("max_connection_buffer_bytes", 1000),
        ("max_response_bytes_in_flight", 0),
        ("log_format", "xml"),
        ("log_level", "loud"),
        ("engine", 3),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_engine_table_errors_are_prefixed() -> None:
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig.from_dict({"engine": {"num_workers": 0}})
    assert info.value.field == "engine.num_workers"
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig.from_dict({"engine": {"modle": "x"}})
    assert info.value.field == "engine.modle"


def test_normalises() -> None:
    config = ServeConfig(log_level="WARNING", drain_timeout_s=5, engine={"model": "builtin:echo"})  # type: ignore[arg-type]
    assert config.log_level == "warning"
    assert isinstance(config.drain_timeout_s, float)
    assert config.engine == EngineConfig(model="builtin:echo")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert ServeConfig(host=host).exposed_without_key is not loopback
    assert not ServeConfig(host=host, api_key="k").exposed_without_key


def test_ipv6_bind() -> None:
    assert ServeConfig(host="::1", port=9).bind == "[::1]:9"


def test_from_toml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
host = "0.0.0.0"
port = 9000
replicas = 2
drain_timeout_s = 5
restart_wait_s = 7
log_format = "json"

[engine]
model = "builtin:echo"
num_workers = 2
backend = "tractor"

[engine.model_options]
step_delay_s = 0.5
""",
    )
    config = ServeConfig.from_toml(path, environ={})
    assert (config.host, config.port, config.replicas) == ("0.0.0.0", 9000, 2)
    assert config.drain_timeout_s == 5.0
    assert config.restart_wait_s == 7.0 and isinstance(config.restart_wait_s, float)
    assert config.log_format == "json"
    assert config.engine.model == "builtin:echo"
    assert config.engine.num_workers == 2
    assert config.engine.backend == "tractor"
    assert dict(config.engine.model_options) == {"step_delay_s": 0.5}
    # overrides: one engine field changes, the file's others stay
    # (3 workers cannot split guidance: cfg_parallel off)
    overrides = {"num_workers": 3, "cfg_parallel": False}
    config = ServeConfig.from_toml(path, environ={}, port=1, engine=overrides)
    assert config.port == 1
    assert config.engine.num_workers == 3
    assert config.engine.backend == "tractor"


def test_toml_unknown_keys_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, 'hots = "x"\nprot = 1\n[engine]\nmodel = "builtin:echo"\n')
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig.from_toml(path, environ={})
    assert info.value.field == "hots"
    assert "hots" in str(info.value) and "prot" in str(info.value)
    path = write(tmp_path, '[engine]\nmodel = "builtin:echo"\nwrokers = 2\n')
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig.from_toml(path, environ={})
    assert info.value.field == "engine.wrokers"
    assert "wrokers" in str(info.value)


def test_toml_bad_value_names_field_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = "eighty"\n')
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig.from_toml(path, environ={})
    assert info.value.field == "port"
    assert str(path) in str(info.value)


def test_toml_missing_or_malformed(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="not found") as info:
        ServeConfig.from_toml(tmp_path / "nope.toml")
    assert info.value.field == "config"
    with pytest.raises(InvalidConfigError, match="not valid TOML"):
        ServeConfig.from_toml(write(tmp_path, "port = = 3\n"))


def test_every_flag_has_a_toml_key() -> None:
    data: dict[str, object] = {}
    for flag in FLAGS:
        target = data
        for part in flag.path[:-1]:
            target = target.setdefault(part, {})  # type: ignore[assignment]
        assert isinstance(target, dict)
        target[flag.path[-1]] = None
    names = set(ServeConfig.__dataclass_fields__)
    engine_names = set(EngineConfig.__dataclass_fields__)
    assert set(data) - {"engine"} <= names
    assert set(data["engine"]) <= engine_names  # type: ignore[arg-type]


def test_from_args_defaults() -> None:
    config = ServeConfig.from_args(parse("--model", "builtin:echo"), environ={})
    # The daemon's one engine default of its own: fork-server workers where safe.
    engine = EngineConfig(model="builtin:echo", worker_start_method="auto")
    assert config == ServeConfig(engine=engine)


def test_the_daemon_forks_workers_from_a_fork_server_unless_told_otherwise(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, '[engine]\nmodel = "builtin:echo"\n')
    assert ServeConfig.from_toml(path, environ={}).engine.worker_start_method == "auto"
    path = write(tmp_path, '[engine]\nmodel = "builtin:echo"\nworker_start_method = "trio"\n')
    assert ServeConfig.from_toml(path, environ={}).engine.worker_start_method == "trio"
    told = ServeConfig.from_args(parse("--config", str(path)), environ={})
    assert told.engine.worker_start_method == "trio"
    # A library config keeps trio: its engine may run anywhere (a child process, CUDA).
    assert EngineConfig().worker_start_method == "trio"


def test_from_args_needs_a_model() -> None:
    with pytest.raises(InvalidConfigError, match="--model") as info:
        ServeConfig.from_args(parse(), environ={})
    assert info.value.field == "engine.model"


def test_from_args_maps_every_flag(tmp_path: Path) -> None:
    args = parse(
        "--model", "builtin:echo",
        "--model-name", "echo",
        "--model-option", "step_delay_s=0.25",
        "--backend", "ray",
        "--ray-address", "10.0.0.5:6379",
        "--workers", "2",
        "--data-parallel", "2",
        "--replicas", "3",
        "--stage", "process",
        "--max-num-seqs", "2",
        "--threads", "1",
        "--device", "cpu",
        "--cache-dir", str(tmp_path),
        "--streaming",
        "--no-warmup",
        "--scheduling-policy", "priority",
        "--priority-aging-ticks", "4",
        "--host", "::1",
        "--port", "0",
        "--api-key", "k",
        "--drain-timeout", "2.5",
        "--max-queue-len", "7",
        "--restart-wait", "12.5",
        "--max-body-bytes", "100",
        "--max-prompt-chars", "10",
        "--max-n", "2",
        "--max-pixels", "4096",
        "--max-steps", "9",
        "--url-ttl", "60",
        "--url-store-max-bytes", "1000",
        "--public-url", "https://img.example",
        "--max-connections", "50",
        "--keep-alive-timeout", "2",
        "--body-read-timeout", "3",
        "--send-timeout", "4",
        "--max-connection-buffer-bytes", "65536",
        "--max-response-bytes-in-flight", "5000",
        "--log-format", "json",
        "--log-level", "debug",
    )  # fmt: skip
    config = ServeConfig.from_args(args, environ={})
    assert config.served_model_name == "echo"
    assert config.engine == EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": 0.25},
        backend="ray",
        ray_address="10.0.0.5:6379",
        num_workers=2,
        data_parallel_size=2,
        max_num_seqs=2,
        torch_threads=1,
        device="cpu",
        cache_dir=str(tmp_path),
        streaming_output=True,
        step_execution=True,
        warmup=False,
        scheduling_policy="priority",
        priority_aging_ticks=4,
        worker_start_method="auto",
    )
    assert (config.host, config.port, config.api_key, config.replicas) == ("::1", 0, "k", 3)
    assert config.stage == "process"
    assert config.drain_timeout_s == 2.5
    assert config.restart_wait_s == 12.5
    assert (config.max_queue_len, config.max_body_bytes, config.max_prompt_chars) == (7, 100, 10)
    assert (config.max_n, config.max_pixels, config.max_steps) == (2, 4096, 9)
    assert (config.url_ttl_s, config.url_store_max_bytes) == (60.0, 1000)
    assert (config.public_url, config.max_connections) == ("https://img.example", 50)
    assert (config.keep_alive_timeout_s, config.body_read_timeout_s) == (2.0, 3.0)
    assert config.send_timeout_s == 4.0
    assert config.max_connection_buffer_bytes == 65536
    assert config.max_response_bytes_in_flight == 5000
    assert (config.log_format, config.log_level) == ("json", "debug")


def test_data_parallel_alone_implies_its_workers_and_tractor(tmp_path: Path) -> None:
    config = ServeConfig.from_args(
        parse("--model", "builtin:echo", "--data-parallel", "3"), environ={}
    )
    assert (config.engine.num_workers, config.engine.backend) == (3, "tractor")
    path = write(tmp_path, '[engine]\nmodel = "builtin:echo"\ndata_parallel_size = 2\n')
    from_file = ServeConfig.from_args(parse("--config", str(path)), environ={})
    assert (from_file.engine.data_parallel_size, from_file.engine.num_workers) == (2, 2)
    with pytest.raises(InvalidConfigError, match="num_workers must be 2"):
        ServeConfig.from_args(
            parse("--model", "builtin:echo", "--data-parallel", "2", "--workers", "3"),
            environ={},
        )


def test_precedence_flags_env_toml_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
api_key = "from-toml"
port = 9000
replicas = 2
[engine]
model = "builtin:echo"
num_workers = 2
cfg_parallel = false
[engine.model_options]
step_delay_s = 0.5
""",
    )
    env = {API_KEY_ENV: "from-env"}
    # TOML over defaults
    config = ServeConfig.from_args(parse("--config", str(path)), environ={})
    assert (config.api_key, config.port, config.replicas) == ("from-toml", 9000, 2)
    assert config.max_n == 4  # default kept
    # env over TOML
    config = ServeConfig.from_args(parse("--config", str(path)), environ=env)
    assert config.api_key == "from-env"
    # an empty env var is unset
    config = ServeConfig.from_args(parse("--config", str(path)), environ={API_KEY_ENV: ""})
    assert config.api_key == "from-toml"
    # flags over env and TOML; unflagged TOML values (engine ones too) stay
    args = parse("--config", str(path), "--api-key", "from-flag", "--port", "1", "--workers", "3")
    config = ServeConfig.from_args(args, environ=env)
    assert (config.api_key, config.port, config.replicas) == ("from-flag", 1, 2)
    assert config.engine.num_workers == 3
    assert config.engine.model == "builtin:echo"
    # model options merge key by key
    args = parse("--config", str(path), "--model-option", "other=x")
    config = ServeConfig.from_args(args, environ={})
    assert dict(config.engine.model_options) == {"step_delay_s": 0.5, "other": "x"}
    # env applies without a file too
    config = ServeConfig.from_args(parse("--model", "builtin:echo"), environ=env)
    assert config.api_key == "from-env"


def test_model_option_values() -> None:
    args = parse("--model", "m", "--model-option", "a=1", "--model-option", "b=true",
                 "--model-option", "c=hello", "--model-option", 'd="q"')  # fmt: skip
    config = ServeConfig.from_args(args, environ={})
    assert dict(config.engine.model_options) == {"a": 1, "b": True, "c": "hello", "d": "q"}
    with pytest.raises(SystemExit):
        parse("--model-option", "novalue")


def test_boolean_flags_override_toml(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nmodel = "builtin:echo"\nwarmup = false\n')
    assert not ServeConfig.from_args(parse("--config", str(path)), environ={}).engine.warmup
    config = ServeConfig.from_args(parse("--config", str(path), "--warmup"), environ={})
    assert config.engine.warmup


def test_replace() -> None:
    config = ServeConfig().replace(port=1)
    assert config.port == 1
    with pytest.raises(InvalidConfigError) as info:
        ServeConfig().replace(prot=1)
    assert info.value.field == "prot"


def test_priority_ranges_from_toml_name_configured_keys_only(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'api_keys = ["k1", "k2"]\n[priority_ranges]\nk1 = [0, 5]\n'
        '[engine]\nmodel = "builtin:echo"\n',
    )
    config = ServeConfig.from_toml(path, environ={})
    assert config.priority_ranges == {"k1": (0, 5)}
    assert "k1" not in repr(config)
    with pytest.raises(InvalidConfigError, match="not one of api_key") as info:
        ServeConfig(api_keys=("k1",), priority_ranges={"s3cret": (0, 1)})
    assert "s3cret" not in str(info.value)
    for bad in ((5, 0), (0,), ("0", "1"), (True, 2)):
        with pytest.raises(InvalidConfigError, match="priority_ranges"):
            ServeConfig(api_keys=("k1",), priority_ranges={"k1": bad})
