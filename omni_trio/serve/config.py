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
it.  The environment holds only the API keys (``OMNI_TRIO_API_KEY``: one key;
``OMNI_TRIO_API_KEYS``: more, comma-separated; empty means unset), so that they can stay out
of the file and out of ``ps``.  Every flag has a TOML key: the table :data:`FLAGS` maps each to
its key path and is what both the parser and the merge use (``api_keys`` has no flag).

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
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..errors import InvalidConfigError

__all__ = [
    "API_KEYS_ENV",
    "API_KEY_ENV",
    "WEBHOOK_SECRET_ENV",
    "FLAGS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "Flag",
    "ServeConfig",
    "add_serve_arguments",
    "engine_config_from_toml",
]

API_KEY_ENV = "OMNI_TRIO_API_KEY"
API_KEYS_ENV = "OMNI_TRIO_API_KEYS"
WEBHOOK_SECRET_ENV = "OMNI_TRIO_WEBHOOK_SECRET"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIB = 1024 * 1024
# The smallest per-connection read-ahead buffer (also HttpLimits' minimum): reads of 16 KiB,
# two of them queued for the app, one being handed over and h11's own (see serve.http).
MIN_CONNECTION_BUFFER_BYTES = 64 * 1024


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


def _check_key(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise InvalidConfigError(f"{name} must be non-empty strings without whitespace", field=name)


def _public_url(value: Any) -> str:
    """``scheme://host[:port][/prefix]`` (http or https, no query, fragment or user info),
    without a trailing slash."""
    message = (
        "public_url must be an http(s) URL such as 'https://images.example.com' or "
        f"'http://10.0.0.5:8000/omni' (no query or fragment), got {value!r}"
    )
    if not isinstance(value, str):
        raise InvalidConfigError(message, field="public_url")
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise InvalidConfigError(message, field="public_url") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.query
        or parts.fragment
        or not value.isprintable()
        or any(c.isspace() for c in value)
    ):
        raise InvalidConfigError(message, field="public_url")
    return value.rstrip("/")


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
    # More keys.  Each key owns the requests made with it: another key cannot see, cancel
    # or collide with them (docs/operations.md, "Security and limits").
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Per API key, the priorities its requests may ask for ([priority_ranges] in the TOML:
    # "<key>" = [min, max]); a key not listed gets the engine's min_priority..max_priority.
    priority_ranges: Mapping[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    # scheme://host[:port][/prefix] in front of file URLs (response_format=url); default:
    # the address the client connected to (never the Host header).
    public_url: str | None = None
    model_name: str | None = None  # the name /v1/models lists; default engine.model
    replicas: int = 1
    # Where each replica's engine runs: "inline" (this process) or "process" (a stage
    # process per replica, omni_trio.runtime.stage); None: inline, but process for several
    # tractor replicas (one tractor runtime per process).
    stage: str | None = None
    # SIGTERM/SIGINT: stop admitting, wait this long for in-flight requests, abort the rest.
    drain_timeout_s: float = 30.0
    max_queue_len: int = 64  # requests in flight (queued + running), all replicas; then 429
    # Refuse (503 + Retry-After) a generation whose estimated queue wait, at the measured
    # service rate, exceeds this (None: only its own timeout is checked).
    max_queue_wait_s: float | None = None
    # A generation admitted while every replica's worker group is restarting waits in the
    # queue at most this long for its replica to be ready, then gets 503 + Retry-After
    # (unless its own timeout is shorter).
    restart_wait_s: float = 60.0
    # Idempotency-Key: how long after a request ended a resubmission with its key replays
    # its answer, and the bytes of answers kept for that (past it the oldest are dropped).
    idempotency_ttl_s: float = 3600.0
    idempotency_max_bytes: int = 64 * MIB
    # Jobs (POST /v1/jobs): a finished job is kept this long after it ended, all finished
    # jobs within this many bytes (results and events; the oldest dropped past it).
    job_ttl_s: float = 3600.0
    job_max_bytes: int = 256 * MIB
    # Job webhooks: each call's body signed (HMAC-SHA256) with this secret; None: no
    # webhooks.  Only to these hosts (empty: any; a webhook is a call to an address a
    # client chose).
    webhook_secret: str | None = field(default=None, repr=False)
    webhook_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 1_000_000
    max_prompt_chars: int = 4000
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    max_steps: int = 200
    # /v1/images/edits and /variations: the multipart body, and each picture's width * height.
    max_upload_bytes: int = 16 * MIB
    max_upload_pixels: int = 4096 * 4096
    # response_format=url: images kept this long, in at most this many bytes (oldest evicted).
    url_ttl_s: float = 600.0
    url_store_max_bytes: int = 256 * MIB
    # Slow and stalled clients (omni_trio.serve.http):
    max_connections: int = 1000  # open connections; beyond it new ones get 503 and are closed
    # An idle keep-alive connection, or one whose request head is not complete, is closed
    # after this.
    keep_alive_timeout_s: float = 5.0
    body_read_timeout_s: float = 30.0  # the whole request body must arrive within it (408)
    send_timeout_s: float = 30.0  # each 64 KiB of a response must be taken within it
    # Request bytes read ahead of the app for one connection.
    max_connection_buffer_bytes: int = MIB
    # Response bytes held for clients: each generation's estimated answer from admission to
    # its end, every answer while it is written; beyond it new generations and file
    # downloads get 429.
    max_response_bytes_in_flight: int = 256 * MIB
    # Write each image's recipe (prompt, seed, steps, ...) into it: PNG text chunks, JPEG/WebP
    # EXIF UserComment (omni_trio.serve.images.image_metadata).
    image_metadata: bool = True
    log_format: str = "text"
    log_level: str = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise InvalidConfigError("host must be a non-empty string", field="host")
        _check_int("port", self.port, minimum=0, maximum=65535)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidConfigError("api_key must be a non-empty string or unset", field="api_key")
        keys = self.api_keys
        if isinstance(keys, str) or not isinstance(keys, list | tuple):
            raise InvalidConfigError("api_keys must be a list of strings", field="api_keys")
        for key in keys:
            _check_key("api_keys", key)
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        object.__setattr__(self, "priority_ranges", self._checked_priority_ranges())
        if self.public_url is not None:
            object.__setattr__(self, "public_url", _public_url(self.public_url))
        if self.model_name is not None and (
            not isinstance(self.model_name, str) or not self.model_name
        ):
            raise InvalidConfigError(
                "model_name must be a non-empty string or unset", field="model_name"
            )
        _check_int("replicas", self.replicas, minimum=1)
        if self.stage is not None and self.stage not in ("inline", "process"):
            raise InvalidConfigError(
                f"stage must be inline or process, got {self.stage!r}", field="stage"
            )
        _check_float("drain_timeout_s", self.drain_timeout_s)
        _check_int("max_queue_len", self.max_queue_len, minimum=1)
        if self.max_queue_wait_s is not None:
            _check_float("max_queue_wait_s", self.max_queue_wait_s, positive=True)
        _check_float("restart_wait_s", self.restart_wait_s, positive=True)
        _check_float("idempotency_ttl_s", self.idempotency_ttl_s, positive=True)
        _check_int("idempotency_max_bytes", self.idempotency_max_bytes, minimum=0)
        _check_float("job_ttl_s", self.job_ttl_s, positive=True)
        _check_int("job_max_bytes", self.job_max_bytes, minimum=0)
        if self.webhook_secret is not None and (
            not isinstance(self.webhook_secret, str) or not self.webhook_secret
        ):
            raise InvalidConfigError(
                "webhook_secret must be a non-empty string or unset", field="webhook_secret"
            )
        hosts = self.webhook_hosts
        if isinstance(hosts, str):  # the flag: comma-separated
            hosts = tuple(h.strip() for h in hosts.split(",") if h.strip())
        if not isinstance(hosts, list | tuple) or not all(
            isinstance(h, str) and h and h.strip() == h and "/" not in h for h in hosts
        ):
            raise InvalidConfigError(
                "webhook_hosts must be a list of host names", field="webhook_hosts"
            )
        object.__setattr__(self, "webhook_hosts", tuple(h.lower() for h in hosts))
        _check_int("max_body_bytes", self.max_body_bytes, minimum=1)
        _check_int("max_upload_bytes", self.max_upload_bytes, minimum=1)
        _check_int("max_upload_pixels", self.max_upload_pixels, minimum=64)
        _check_int("max_prompt_chars", self.max_prompt_chars, minimum=1)
        _check_int("max_n", self.max_n, minimum=1)
        _check_int("max_pixels", self.max_pixels, minimum=1)
        _check_int("max_steps", self.max_steps, minimum=1)
        _check_float("url_ttl_s", self.url_ttl_s, positive=True)
        _check_int("url_store_max_bytes", self.url_store_max_bytes, minimum=1)
        _check_int("max_connections", self.max_connections, minimum=1)
        _check_float("keep_alive_timeout_s", self.keep_alive_timeout_s, positive=True)
        _check_float("body_read_timeout_s", self.body_read_timeout_s, positive=True)
        _check_float("send_timeout_s", self.send_timeout_s, positive=True)
        _check_int(
            "max_connection_buffer_bytes",
            self.max_connection_buffer_bytes,
            minimum=MIN_CONNECTION_BUFFER_BYTES,
        )
        _check_int("max_response_bytes_in_flight", self.max_response_bytes_in_flight, minimum=1)
        if not isinstance(self.image_metadata, bool):
            raise InvalidConfigError(
                f"image_metadata must be true or false, got {self.image_metadata!r}",
                field="image_metadata",
            )
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
        for name in (
            "drain_timeout_s",
            "restart_wait_s",
            "job_ttl_s",
            "url_ttl_s",
            "keep_alive_timeout_s",
            "body_read_timeout_s",
            "send_timeout_s",
        ):
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
    def all_api_keys(self) -> tuple[str, ...]:
        """``api_key`` and ``api_keys`` together (each once): what a client may present."""
        first = (self.api_key,) if self.api_key is not None else ()
        return tuple(dict.fromkeys((*first, *self.api_keys)))

    @property
    def exposed_without_key(self) -> bool:
        """Listening beyond loopback with no API key: anyone who can reach the port can
        generate.  Allowed, but the daemon logs a warning."""
        return not self.all_api_keys and not is_loopback(self.host)

    def _checked_priority_ranges(self) -> dict[str, tuple[int, int]]:
        ranges = self.priority_ranges
        if not isinstance(ranges, Mapping):
            raise InvalidConfigError(
                "priority_ranges must map API keys to [min, max]", field="priority_ranges"
            )
        known = set(self.all_api_keys)
        checked: dict[str, tuple[int, int]] = {}
        for key, bounds in ranges.items():
            if key not in known:  # never echo the value: it is (meant to be) a secret
                raise InvalidConfigError(
                    "priority_ranges names a key that is not one of api_key / api_keys",
                    field="priority_ranges",
                )
            if (
                not isinstance(bounds, list | tuple)
                or len(bounds) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
                or bounds[0] > bounds[1]
            ):
                raise InvalidConfigError(
                    f"priority_ranges values must be [min, max] integers with min <= max, "
                    f"got {bounds!r}",
                    field="priority_ranges",
                )
            checked[key] = (int(bounds[0]), int(bounds[1]))
        return checked

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
        """Load ``path``, then apply the environment (the API keys), then
        ``overrides`` (ServeConfig fields; ``engine`` may be a mapping merged key by key into
        the file's ``[engine]`` table).  A missing or malformed file, an unknown key or a bad
        value raises :class:`InvalidConfigError`."""
        data = _merge(DAEMON_DEFAULTS, _load_toml(Path(path)))
        data = _merge(data, _env_settings(os.environ if environ is None else environ))
        return _build(_merge(data, overrides), source=str(path))

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
    ) -> ServeConfig:
        """Merge defaults < ``--config`` file < environment < explicit flags (a flag left at
        ``None`` was not given).  Raises :class:`InvalidConfigError`, also when no model is
        named anywhere (the daemon has no default model)."""
        data: dict[str, Any] = _merge({"engine": {}}, DAEMON_DEFAULTS)
        source = "command line"
        config_path = getattr(args, "config", None)
        if config_path is not None:
            data = _merge(data, _load_toml(Path(config_path)))
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


def engine_config_from_toml(
    path: str | os.PathLike[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """The engine of a ``serve --config`` file: ``defaults`` < its ``[engine]`` table <
    ``overrides`` (EngineConfig fields).  The whole file is checked as a :class:`ServeConfig`
    (its daemon keys too), so a bad or unknown key at either level raises
    :class:`InvalidConfigError` naming it and the file.  ``omni-trio generate --config`` and
    ``demo --config`` read the same files through this."""
    data = _load_toml(Path(path))
    engine = data.get("engine", {})
    if isinstance(engine, Mapping):
        data["engine"] = {**(defaults or {}), **engine, **(overrides or {})}
    source = f"{path} and the command line" if overrides else str(path)
    return _build(data, source=source).engine


# What the daemon sets differently from a library EngineConfig, below everything a file, the
# environment or a flag says: tractor workers forked from a preloaded fork server where that
# is safe (a restarted worker serves in a fraction of a second instead of seconds).
DAEMON_DEFAULTS: Mapping[str, Any] = {"engine": {"worker_start_method": "auto"}}


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
    settings: dict[str, Any] = {}
    key = environ.get(API_KEY_ENV)
    if key:
        settings["api_key"] = key
    secret = environ.get(WEBHOOK_SECRET_ENV)
    if secret:
        settings["webhook_secret"] = secret
    keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if keys:
        settings["api_keys"] = keys
    return settings


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


def lora_arg(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora`` (a LoRA adapter requests may name)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH (a diffusers LoRA directory or builtin:shapes-outline), "
            f"got {text!r}"
        )
    return name.strip(), path.strip()


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
        "--lora",
        ("engine", "loras"),
        "a LoRA adapter requests may name: NAME=PATH, PATH a diffusers LoRA directory or "
        "builtin:shapes-outline (repeatable; listed by /v1/models)",
        type=lora_arg,
        metavar="NAME=PATH",
    ),
    Flag(
        "--max-loras",
        ("engine", "max_loras"),
        "LoRA adapters each worker keeps loaded (least recently used unloaded)",
        type=int,
        metavar="N",
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
        "--data-parallel",
        ("engine", "data_parallel_size"),
        "worker processes per replica, each running different requests (implies --workers)",
        type=int,
        metavar="N",
    ),
    Flag(
        "--replicas", ("replicas",), "independent engines behind the router", type=int, metavar="K"
    ),
    Flag(
        "--stage",
        ("stage",),
        "where each replica's engine runs: inline (this process) or process (a child process "
        "per replica; the default for --replicas K > 1 with --backend tractor)",
        choices=("inline", "process"),
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
    Flag(
        "--scheduling-policy",
        ("engine", "scheduling_policy"),
        "who runs next: fifo (arrival order), priority (the request's priority, lower first; "
        "preempts in step mode) or fair (round-robin across image shapes)",
        choices=("fifo", "priority", "fair"),
    ),
    Flag(
        "--priority-aging-ticks",
        ("engine", "priority_aging_ticks"),
        "under --scheduling-policy priority, a later request passes an earlier one only "
        "within (their priority difference x N) ticks of it (default 16): smaller bounds the "
        "worse priorities' wait at overload",
        type=int,
        metavar="N",
    ),
    Flag("--warmup", ("engine", "warmup"), "warm every replica up before ready", boolean=True),
    Flag("--host", ("host",), "address to bind (default 127.0.0.1: loopback only)"),
    Flag("--port", ("port",), "TCP port (default 8000; 0 picks a free one)", type=int),
    Flag(
        "--api-key",
        ("api_key",),
        f"require this bearer key (or env {API_KEY_ENV}; more keys: env {API_KEYS_ENV})",
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
    Flag(
        "--max-queue-wait",
        ("max_queue_wait_s",),
        "refuse (503 + Retry-After) a generation whose estimated queue wait at the measured "
        "service rate exceeds S seconds (default: only its own timeout is checked)",
        type=float,
        metavar="S",
    ),
    Flag(
        "--restart-wait",
        ("restart_wait_s",),
        "seconds a generation admitted while every replica restarts waits for one to be "
        "ready before 503 + Retry-After (default 60)",
        type=float,
        metavar="S",
    ),
    Flag(
        "--idempotency-ttl",
        ("idempotency_ttl_s",),
        "seconds after a request ended that a resubmission with its Idempotency-Key replays "
        "its answer",
        type=float,
        metavar="S",
    ),
    Flag(
        "--idempotency-max-bytes",
        ("idempotency_max_bytes",),
        "bytes of answers kept for Idempotency-Key replays (the oldest dropped past it)",
        type=int,
        metavar="N",
    ),
    Flag(
        "--job-ttl",
        ("job_ttl_s",),
        "seconds a finished job (POST /v1/jobs) is kept after it ended",
        type=float,
        metavar="S",
    ),
    Flag(
        "--job-max-bytes",
        ("job_max_bytes",),
        "bytes of finished jobs kept (results and events; the oldest dropped past it)",
        type=int,
        metavar="N",
    ),
    Flag(
        "--webhook-secret",
        ("webhook_secret",),
        f"sign job webhooks with this secret and send them (or env {WEBHOOK_SECRET_ENV})",
        metavar="SECRET",
    ),
    Flag(
        "--webhook-hosts",
        ("webhook_hosts",),
        "comma-separated hosts job webhooks may go to (default: any)",
        metavar="HOSTS",
    ),
    Flag("--max-body-bytes", ("max_body_bytes",), "largest request body", type=int, metavar="N"),
    Flag("--max-prompt-chars", ("max_prompt_chars",), "longest prompt", type=int, metavar="N"),
    Flag("--max-n", ("max_n",), "most images per request (n)", type=int, metavar="N"),
    Flag("--max-pixels", ("max_pixels",), "largest width*height", type=int, metavar="N"),
    Flag("--max-steps", ("max_steps",), "most num_inference_steps", type=int, metavar="N"),
    Flag(
        "--max-upload-bytes",
        ("max_upload_bytes",),
        "largest multipart body of /v1/images/edits and /variations",
        type=int,
        metavar="N",
    ),
    Flag(
        "--max-upload-pixels",
        ("max_upload_pixels",),
        "largest width*height of an uploaded picture (read from its header, before decoding)",
        type=int,
        metavar="N",
    ),
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
    Flag(
        "--public-url",
        ("public_url",),
        "scheme://host[:port][/prefix] for file URLs (default: the address connected to)",
        metavar="URL",
    ),
    Flag(
        "--max-connections",
        ("max_connections",),
        "open connections; beyond it new ones get 503 and are closed",
        type=int,
        metavar="N",
    ),
    Flag(
        "--keep-alive-timeout",
        ("keep_alive_timeout_s",),
        "seconds an idle connection (or an incomplete request head) is kept",
        type=float,
        metavar="S",
    ),
    Flag(
        "--body-read-timeout",
        ("body_read_timeout_s",),
        "seconds the whole request body may take to arrive (then 408)",
        type=float,
        metavar="S",
    ),
    Flag(
        "--send-timeout",
        ("send_timeout_s",),
        "seconds a client may take to accept each 64 KiB of a response (then dropped)",
        type=float,
        metavar="S",
    ),
    Flag(
        "--max-connection-buffer-bytes",
        ("max_connection_buffer_bytes",),
        "request bytes read ahead of the app per connection",
        type=int,
        metavar="N",
    ),
    Flag(
        "--max-response-bytes-in-flight",
        ("max_response_bytes_in_flight",),
        "response bytes held for clients (generations' estimated answers from admission, "
        "answers being sent) before new generations and downloads get 429",
        type=int,
        metavar="N",
    ),
    Flag(
        "--metadata",
        ("image_metadata",),
        "write each image's recipe (prompt, seed, steps, guidance, size, model) into it",
        boolean=True,
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
        elif flag.path in (("engine", "model_options"), ("engine", "loras")):
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
        if flag.path in (("engine", "model_options"), ("engine", "loras")):
            value = dict(value)
        target = data
        for part in flag.path[:-1]:
            target = target.setdefault(part, {})
        target[flag.path[-1]] = value
    return data
