"""docker/: what can be checked without a Docker engine - the compose file
parses, its commands exist in the CLI, the environment variables it sets are
the ones the code reads, and the Dockerfile copies what exists."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pgq.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def source_text() -> str:
    return "\n".join(p.read_text() for d in ("pgq", "cluster") for p in (ROOT / d).rglob("*.py"))


def test_compose_defines_three_nodes_and_a_worker():
    services = COMPOSE["services"]
    assert set(services) == {"n1", "n2", "n3", "worker"}
    for name in ("n1", "n2", "n3"):
        command = services[name]["command"]
        assert command[:2] == ["node", "start"] and command[command.index("--name") + 1] == name
        assert command[command.index("--bus") + 1] == f"{name}:7711"
    assert services["n2"]["command"][services["n2"]["command"].index("--join") + 1] == "n1:7711"
    assert services["worker"]["command"][0] == "worker"


@pytest.mark.parametrize("service", ["n1", "n2", "n3", "worker"])
def test_every_compose_command_exists_in_the_cli(service):
    command = [str(part) for part in COMPOSE["services"][service]["command"]]
    result = CliRunner().invoke(cli_main, [*command, "--help"])
    assert result.exit_code == 0, result.output  # unknown commands or options would fail here


def test_every_environment_variable_is_read_by_the_code():
    code = source_text()
    names = set()
    for service in COMPOSE["services"].values():
        names |= set(service.get("environment", {}))
    assert {"PGQ_CLUSTER_SECRET", "PGQ_DSN", "PGQ_EMBEDDED_PASSWORD"} <= names
    unread = sorted(n for n in names if n not in code)
    assert unread == []
    for name in re.findall(r"^ENV (.*?)(?:\n(?! ))", DOCKERFILE, re.M | re.S):
        for variable in re.findall(r"(\w+)=", name):
            assert variable in code or variable == "PYTHONUNBUFFERED", variable


def test_no_known_default_secret_or_password():
    """Every secret in docker/ comes from the environment, with no fallback."""
    for service in COMPOSE["services"].values():
        for name, value in service.get("environment", {}).items():
            if "SECRET" in name or "PASSWORD" in name or name == "PGQ_DSN":
                assert ":?" in str(value) and ":-" not in str(value), (name, value)
    assert "secret" not in DOCKERFILE.lower().replace("pgq_cluster_secret", "")


def test_the_worker_target_imports():
    target = COMPOSE["services"]["worker"]["command"][1]
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_dockerfile_copies_what_exists_and_runs_pgq():
    for source in re.findall(r"^COPY (.+?) \S+$", DOCKERFILE, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["pgq"]' in DOCKERFILE
    default = re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1)
    result = CliRunner().invoke(cli_main, [*yaml.safe_load(default), "--help"])
    assert result.exit_code == 0, result.output


def test_what_the_dockerfile_copies_builds(tmp_path):
    """`pip install .` in the image sees only what the Dockerfile copies:
    pyproject.toml installs bench/ as pgq.bench, which it did not copy, and
    the build stopped (found by a read-only review; no Docker engine here,
    so the same build runs on a copy of exactly those files)."""
    for source, target in re.findall(r"^COPY (.+?) (\S+)$", DOCKERFILE, re.M):
        for path in source.split():
            destination = tmp_path / (path if target in ("./", ".") else target)
            if (ROOT / path).is_dir():
                shutil.copytree(ROOT / path, destination, ignore=shutil.ignore_patterns(
                    "__pycache__", "results", ".venv*"))
            else:
                shutil.copy(ROOT / path, destination)
    # build_py: what `pip install .` runs first, and where it stopped
    built = subprocess.run([sys.executable, "-c", "import setuptools, sys; "
                            "sys.argv = ['setup.py', '-q', 'build_py', '-d', 'built']; setuptools.setup()"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr[-2000:]
    # the build context leaves out what the image does not need
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "bench/results" in ignored


@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(
    ["docker", "info"], capture_output=True).returncode != 0, reason="no Docker engine here")
def test_compose_config_is_valid_for_docker():  # pragma: no cover - needs an engine
    subprocess.run(["docker", "compose", "-f", str(ROOT / "docker" / "compose.yaml"), "config", "-q"],
                   check=True)
