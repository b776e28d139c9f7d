"""``ServeConfig``: every setting of ``omni-trio serve``, validated at construction.

Sources, lowest precedence first (:meth:`ServeConfig.from_args`)::

    defaults  <  TOML file (--config FILE)  <  environment  <  explicit command-line flags

The TOML file holds the daemon's settings at its top level and the engine's in an
``[engine]`` table (any :class:`~omni_trio.config.EngineConfig` field, ``model_options`` as a
sub-table)::

    host = "127.0.0.1"
    port = 8000
    replicas = 2
    drain_timeout_s = 30

    [engine]
    model = "builtin:tiny-sd"
    backend = "tractor"
    num_workers = 1

An unknown key (at either level) raises :class:`~omni_trio.errors.InvalidConfigError` naming
it.  The environment holds only the API key (``OMNI_TRIO_API_KEY``; empty means unset), so
that it can stay out of the file and out of ``ps``.  Every flag has a TOML key: the table
:data:`FLAGS` maps each to its key path and is what both the parser and the merge use.

Binding a host that is not loopback without an API key is allowed (a private network, a
proxy doing the authentication) but the daemon logs a loud warning at start
(:attr:`ServeConfig.exposed_without_key`).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..errors import InvalidConfigError

__all__ = [
    "API_KEY_ENV",
    "FLAGS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "Flag",
    "ServeConfig",
    "add_serve_arguments",
]

API_KEY_ENV = "OMNI_TRIO_API_KEY"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIB = 1024 * 1024


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidConfigError(f"{name} must be an integer {bound}, got {value!r}", field=name)


def _check_float(name: str, value: Any, *, positive: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        bound = "> 0" if positive else ">= 0"
        raise InvalidConfigError(
            f"{name} must be a finite number {bound}, got {value!r}", field=name
        )


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything
    else, including the wildcards ``0.0.0.0`` and ``::`` and other host names."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Configuration of the daemon: HTTP listener, API key, replicas, drain, limits, logs and
    the engine every replica runs.

    The request limits (``max_*``) are the HTTP layer's and are checked before a request
    reaches an engine; the engine's own limits (``engine.max_steps`` ...) still apply after
    them and default higher.  ``api_key`` is never shown in ``repr``.
    """

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the listening line on stdout says which)
    api_key: str | None = field(default=None, repr=False)
    model_name: str | None = None  # the name /v1/models lists; default engine.model
    replicas: int = 1
    # SIGTERM/SIGINT: stop admitting, wait this long for in-flight requests, abort the rest.
    drain_timeout_s: float = 30.0
    max_queue_len: int = 64  # requests in flight (queued + running), all replicas; then 429
    max_body_bytes: int = 1_000_000
    max_prompt_chars: int = 4000
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    max_steps: int = 200
    # response_format=url: images kept this long, in at most this many bytes (oldest evicted).
    url_ttl_s: float = 600.0
    url_store_max_bytes: int = 256 * MIB
    log_format: str = "text"
    log_level: str = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise InvalidConfigError("host must be a non-empty string", field="host")
        _check_int("port", self.port, minimum=0, maximum=65535)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidConfigError("api_key must be a non-empty string or unset", field="api_key")
        if self.model_name is not None and (
            not isinstance(self.model_name, str) or not self.model_name
        ):
            raise InvalidConfigError(
                "model_name must be a non-empty string or unset", field="model_name"
            )
        _check_int("replicas", self.replicas, minimum=1)
        _check_float("drain_timeout_s", self.drain_timeout_s)
        _check_int("max_queue_len", self.max_queue_len, minimum=1)
        _check_int("max_body_bytes", self.max_body_bytes, minimum=1)
        _check_int("max_prompt_chars", self.max_prompt_chars, minimum=1)
        _check_int("max_n", self.max_n, minimum=1)
        _check_int("max_pixels", self.max_pixels, minimum=1)
        _check_int("max_steps", self.max_steps, minimum=1)
        _check_float("url_ttl_s", self.url_ttl_s, positive=True)
        _check_int("url_store_max_bytes", self.url_store_max_bytes, minimum=1)
        if self.log_format not in LOG_FORMATS:
            raise InvalidConfigError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}",
                field="log_format",
            )
        level = self.log_level.lower() if isinstance(self.log_level, str) else self.log_level
        if level not in LOG_LEVELS:
            raise InvalidConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}",
                field="log_level",
            )
        object.__setattr__(self, "log_level", level)
        engine = self.engine
        if isinstance(engine, Mapping):
            engine = _engine_from_dict(engine)
        if not isinstance(engine, EngineConfig):
            raise InvalidConfigError(
                f"engine must be an EngineConfig or a table, got {engine!r}", field="engine"
            )
        object.__setattr__(self, "engine", engine)
        for name in ("drain_timeout_s", "url_ttl_s"):
            object.__setattr__(self, name, float(getattr(self, name)))

    # -- derived -------------------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.engine.model

    @property
    def bind(self) -> str:
        """``host:port`` as hypercorn takes it (IPv6 hosts in brackets)."""
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    @property
    def exposed_without_key(self) -> bool:
        """Listening beyond loopback with no API key: anyone who can reach the port can
        generate.  Allowed, but the daemon logs a warning."""
        return self.api_key is None and not is_loopback(self.host)

    def replace(self, **changes: Any) -> ServeConfig:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidConfigError(
                f"unknown ServeConfig field(s): {', '.join(unknown)}", field=unknown[0]
            )
        return dataclasses.replace(self, **changes)

    # -- sources -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServeConfig:
        """Build from a nested mapping (the TOML layout: daemon keys at the top, engine keys
        under ``"engine"``); unknown keys raise :class:`InvalidConfigError` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in set(data) - known)
        if unknown:
            raise InvalidConfigError(
                f"unknown setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                field=unknown[0],
            )
        fields = dict(data)
        if "engine" in fields and isinstance(fields["engine"], Mapping):
            fields["engine"] = _engine_from_dict(fields["engine"])
        return cls(**fields)

    @classmethod
    def from_toml(
        cls,
        path: str | os.PathLike[str],
        *,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ServeConfig:
        """Load ``path``, then apply the environment (``OMNI_TRIO_API_KEY``), then
        ``overrides`` (ServeConfig fields; ``engine`` may be a mapping merged key by key into
        the file's ``[engine]`` table).  A missing or malformed file, an unknown key or a bad
        value raises :class:`InvalidConfigError`."""
        data = _load_toml(Path(path))
        data = _merge(data, _env_settings(os.environ if environ is None else environ))
        return _build(_merge(data, overrides), source=str(path))

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
    ) -> ServeConfig:
        """Merge defaults < ``--config`` file < environment < explicit flags (a flag left at
        ``None`` was not given).  Raises :class:`InvalidConfigError`, also when no model is
        named anywhere (the daemon has no default model)."""
        data: dict[str, Any] = {}
        source = "command line"
        config_path = getattr(args, "config", None)
        if config_path is not None:
            data = _load_toml(Path(config_path))
            source = f"{config_path} and the command line"
        data = _merge(data, _env_settings(os.environ if environ is None else environ))
        data = _merge(data, _flag_settings(args))
        engine = data.get("engine", {})
        if isinstance(engine, Mapping) and "model" not in engine:
            raise InvalidConfigError(
                "no model given: pass --model or set model in the [engine] table of --config",
                field="engine.model",
            )
        return _build(data, source=source)


def _engine_from_dict(data: Mapping[str, Any]) -> EngineConfig:
    try:
        return EngineConfig.from_dict(data)
    except InvalidConfigError as exc:
        field_name = f"engine.{exc.field}" if exc.field else "engine"
        raise InvalidConfigError(f"[engine] {exc}", field=field_name) from None
    except TypeError as exc:  # a non-string key
        raise InvalidConfigError(f"[engine] {exc}", field="engine") from None


def _build(data: Mapping[str, Any], *, source: str) -> ServeConfig:
    try:
        return ServeConfig.from_dict(data)
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"{exc} (from {source})", field=exc.field) from None


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``; the ``engine`` tables (and their ``model_options``) merge key
    by key, so a flag changes one engine field and keeps the file's others."""
    merged = dict(base)
    for key, value in top.items():
        if key == "engine" and isinstance(value, EngineConfig):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if key == "engine" and isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            engine = dict(merged[key])
            for name, item in value.items():
                old = engine.get(name)
                if name == "model_options" and isinstance(old, Mapping):
                    engine[name] = {**old, **item}
                else:
                    engine[name] = item
            merged[key] = engine
        else:
            merged[key] = value
    return merged


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise InvalidConfigError(f"config file {str(path)!r} not found", field="config") from None
    except OSError as exc:
        raise InvalidConfigError(
            f"cannot read config file {str(path)!r}: {exc.strerror or exc}", field="config"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfigError(
            f"config file {str(path)!r} is not valid TOML: {exc}", field="config"
        ) from None


def _env_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    key = environ.get(API_KEY_ENV)
    return {"api_key": key} if key else {}


# -- command-line flags ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and the TOML key path it sets (``("engine", "model")`` is the
    ``model`` key of the ``[engine]`` table)."""

    option: str
    path: tuple[str, ...]
    help: str
    type: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False  # --flag / --no-flag

    @property
    def dest(self) -> str:
        return "serve_" + "_".join(self.path)


def _key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; VALUE is read as a TOML value (``0.05``, ``true``, ``"x"``) and falls
    back to the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key.strip(), parsed


FLAGS: tuple[Flag, ...] = (
    Flag(
        "--model",
        ("engine", "model"),
        "model to serve: a built-in name or a diffusers dir",
        metavar="M",
    ),
    Flag(
        "--model-name",
        ("model_name",),
        "name listed by /v1/models (default: the model)",
        metavar="NAME",
    ),
    Flag(
        "--model-option",
        ("engine", "model_options"),
        "a model option KEY=VALUE (repeatable; e.g. step_delay_s=0.05 for builtin:echo)",
        type=_key_value,
        metavar="KEY=VALUE",
    ),
    Flag(
        "--backend",
        ("engine", "backend"),
        "executor: inproc (threads), tractor (worker processes) or ray (Ray actors)",
        choices=("inproc", "tractor", "ray"),
    ),
    Flag(
        "--ray-address",
        ("engine", "ray_address"),
        "backend ray: the Ray cluster to join (default $RAY_ADDRESS, else a local Ray)",
        metavar="ADDR",
    ),
    Flag("--workers", ("engine", "num_workers"), "workers per replica", type=int, metavar="N"),
    Flag(
        "--replicas", ("replicas",), "independent engines behind the router", type=int, metavar="K"
    ),
    Flag(
        "--max-num-seqs",
        ("engine", "max_num_seqs"),
        "requests fused into one forward",
        type=int,
        metavar="N",
    ),
    Flag(
        "--threads", ("engine", "torch_threads"), "torch threads per worker", type=int, metavar="N"
    ),
    Flag("--device", ("engine", "device"), "torch device (default: cuda if present)"),
    Flag(
        "--cache-dir", ("engine", "cache_dir"), "where built-in models are created", metavar="DIR"
    ),
    Flag(
        "--step-execution",
        ("engine", "step_execution"),
        "run requests step by step (fair interleaving, step-level abort)",
        boolean=True,
    ),
    Flag(
        "--streaming",
        ("engine", "streaming_output"),
        "stream step previews (SSE partial images; implies --step-execution)",
        boolean=True,
    ),
    Flag("--warmup", ("engine", "warmup"), "warm every replica up before ready", boolean=True),
    Flag("--host", ("host",), "address to bind (default 127.0.0.1: loopback only)"),
    Flag("--port", ("port",), "TCP port (default 8000; 0 picks a free one)", type=int),
    Flag(
        "--api-key",
        ("api_key",),
        f"require this bearer key (or env {API_KEY_ENV})",
        metavar="KEY",
    ),
    Flag(
        "--drain-timeout",
        ("drain_timeout_s",),
        "on SIGTERM/SIGINT, seconds to let in-flight requests finish",
        type=float,
        metavar="S",
    ),
    Flag(
        "--max-queue-len",
        ("max_queue_len",),
        "requests in flight (queued and running) before 429",
        type=int,
        metavar="N",
    ),
    Flag("--max-body-bytes", ("max_body_bytes",), "largest request body", type=int, metavar="N"),
    Flag("--max-prompt-chars", ("max_prompt_chars",), "longest prompt", type=int, metavar="N"),
    Flag("--max-n", ("max_n",), "most images per request (n)", type=int, metavar="N"),
    Flag("--max-pixels", ("max_pixels",), "largest width*height", type=int, metavar="N"),
    Flag("--max-steps", ("max_steps",), "most num_inference_steps", type=int, metavar="N"),
    Flag(
        "--url-ttl",
        ("url_ttl_s",),
        "seconds a response_format=url image is kept",
        type=float,
        metavar="S",
    ),
    Flag(
        "--url-store-max-bytes",
        ("url_store_max_bytes",),
        "memory for response_format=url images",
        type=int,
        metavar="N",
    ),
    Flag("--log-format", ("log_format",), "log lines as text or JSON", choices=LOG_FORMATS),
    Flag("--log-level", ("log_level",), "least severe level logged", choices=LOG_LEVELS),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and every flag of :data:`FLAGS` to ``parser``; each defaults to None
    ("not given") so the merge can tell an explicit flag from a default."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file with any of these settings (flags override it)",
    )
    for flag in FLAGS:
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": None, "help": flag.help}
        if flag.boolean:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.path == ("engine", "model_options"):
            kwargs.update(action="append", type=flag.type, metavar=flag.metavar)
        else:
            if flag.type is not None:
                kwargs["type"] = flag.type
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            if flag.choices is None:
                kwargs["metavar"] = flag.metavar or flag.path[-1].upper()
        parser.add_argument(flag.option, **kwargs)


def _flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if flag.path == ("engine", "model_options"):
            value = dict(value)
        target = data
        for part in flag.path[:-1]:
            target = target.setdefault(part, {})
        target[flag.path[-1]] = value
    return data
