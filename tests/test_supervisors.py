"""The OS supervisor files under supervisors/: each parses and carries the settings the daemon
relies on (notify, watchdog, drain-aware stop timeouts, probes on /health and /ready).
``systemd-analyze verify`` checks the unit when it is installed."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omni_trio.serve.config import ServeConfig

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

ROOT = Path(__file__).resolve().parents[1]
SUPERVISORS = ROOT / "supervisors"
UNIT = SUPERVISORS / "systemd" / "omni-trio.service"
SERVE_TOML = SUPERVISORS / "systemd" / "serve.toml"
SUPERVISORD = SUPERVISORS / "supervisord" / "omni-trio.conf"
K8S = SUPERVISORS / "kubernetes" / "deployment.yaml"


def _seconds(text: str) -> float:
    """A systemd time span of plain seconds or ``Ns``/``Nmin`` (all these files use)."""
    match = re.fullmatch(r"(\d+)(s|min)?", text.strip())
    assert match, text
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return parser


def _unit_values(section: str, key: str) -> list[str]:
    """Every value of a key systemd allows to repeat (configparser keeps only the last)."""
    values, current = [], None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and line.partition("=")[0].strip() == key:
            values.append(line.partition("=")[2].strip())
    return values


def _example_config() -> ServeConfig:
    return ServeConfig.from_toml(SERVE_TOML, environ={})


def test_systemd_unit_has_the_required_settings() -> None:
    service = _unit()["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "Restart": "on-failure",
        "RestartSec": "2",
        "KillMode": "mixed",
        "KillSignal": "SIGTERM",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DynamicUser": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "EnvironmentFile": "-/etc/omni-trio/env",
        "RestartPreventExitStatus": "2",
    }
    for key, value in expected.items():
        assert service.get(key) == value, key
    assert _seconds(service["WatchdogSec"]) == 30
    assert service["ExecStart"] == (
        "/opt/omni-trio/.venv/bin/omni-trio serve --config /etc/omni-trio/serve.toml"
    )
    assert "OMP_WAIT_POLICY=PASSIVE" in _unit_values("Service", "Environment")
    assert "/var/cache/omni-trio" in service["ReadWritePaths"]
    # PrivateDevices=yes would hide the GPU; /dev/shm (the workers' image transfer) stays
    # either way, but the unit must not silently turn it on.
    assert service.get("PrivateDevices", "no") == "no"


def test_systemd_stop_timeout_exceeds_drain() -> None:
    service = _unit()["Service"]
    config = _example_config()
    budget = config.drain_timeout_s + config.engine.close_timeout_s
    assert _seconds(service["TimeoutStopSec"]) > budget


def test_example_serve_toml_is_valid() -> None:
    config = _example_config()
    assert config.host == "127.0.0.1"
    assert config.api_key is None  # the key comes from the EnvironmentFile
    assert config.log_format == "json"


def _verify_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's console script (verify checks
    that the binary exists)."""
    script = shutil.which("omni-trio", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the omni-trio console script is not installed in this environment")
    unit = tmp_path / "omni-trio.service"
    unit.write_text(UNIT.read_text().replace("/opt/omni-trio/.venv/bin/omni-trio", script))
    return unit


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = _verify_copy(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line for line in (result.stdout + result.stderr).splitlines() if "omni-trio.service" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def _supervisord() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(
        strict=False, interpolation=None, inline_comment_prefixes=(";",)
    )
    parser.read(SUPERVISORD)
    return parser


def test_supervisord_program() -> None:
    program = _supervisord()["program:omni-trio"]
    assert program["command"] == (
        "/opt/omni-trio/.venv/bin/omni-trio serve --config /etc/omni-trio/serve.toml"
    )
    assert program["stopsignal"] == "TERM"
    assert program["autorestart"] == "unexpected"
    assert program["exitcodes"] == "0"
    # the daemon stops its own workers; a group-wide SIGTERM would kill tractor workers mid-drain
    assert program["stopasgroup"] == "false"
    assert program["killasgroup"] == "true"
    assert "OMP_WAIT_POLICY" in program["environment"]
    config = _example_config()
    assert int(program["stopwaitsecs"]) > config.drain_timeout_s + config.engine.close_timeout_s


def _k8s_documents() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(K8S.read_text()) if doc]


def test_kubernetes_manifests_parse_and_probe() -> None:
    docs = _k8s_documents()
    kinds = {doc["kind"]: doc for doc in docs}
    assert set(kinds) == {"Deployment", "Service", "Secret"}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    args = container["args"]
    assert "--host=0.0.0.0" in args
    drain = next(float(a.split("=", 1)[1]) for a in args if a.startswith("--drain-timeout="))
    assert pod["terminationGracePeriodSeconds"] > drain + 30  # + the engine's close timeout
    env = {e["name"]: e for e in container["env"]}
    secret_ref = env["OMNI_TRIO_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == kinds["Secret"]["metadata"]["name"]
    assert secret_ref["key"] in kinds["Secret"]["stringData"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert "resources" in container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = kinds["Service"]["spec"]
    assert service["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["targetPort"] in ports


def test_kubernetes_required_strings() -> None:
    # Without PyYAML, at least the essentials are there.
    text = K8S.read_text()
    for needle in (
        "kind: Deployment",
        "kind: Service",
        "kind: Secret",
        "path: /health",
        "path: /ready",
        "medium: Memory",
        "terminationGracePeriodSeconds:",
        "--host=0.0.0.0",
    ):
        assert needle in text, needle


def test_every_supervisor_file_is_documented() -> None:
    readme = (SUPERVISORS / "README.md").read_text()
    for path in (UNIT, SERVE_TOML, SUPERVISORD, K8S):
        assert str(path.relative_to(SUPERVISORS)) in readme, path
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "supervisors/" in operations
