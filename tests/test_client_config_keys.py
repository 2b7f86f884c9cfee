"""The key table of the client configuration (client/common/client_config_keys.c) is the one
list of keys: the reader dispatches through it, its variables are the ones the reader reads,
docs/client-configuration.md's table and `gpupool config --help` come from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from gpupool import config as cc
from gpupool import config_keys

DOC = REPO / "docs" / "client-configuration.md"
FINGERPRINT = "SHA256:" + "A" * 43

# A value each variable accepts, with the others it needs (a client certificate needs its key).
ENV_VALUES: dict[str, dict[str, str]] = {
    "GPUPOOL_TOKEN": {"GPUPOOL_TOKEN": "gpt_x"},
    "GPUPOOL_TLS": {"GPUPOOL_TLS": "0"},
    "GPUPOOL_TLS_CA": {"GPUPOOL_TLS_CA": "/ca.pem"},
    "GPUPOOL_TLS_CERT": {"GPUPOOL_TLS_CERT": "/c.pem", "GPUPOOL_TLS_KEY": "/k.pem"},
    "GPUPOOL_TLS_KEY": {"GPUPOOL_TLS_CERT": "/c.pem", "GPUPOOL_TLS_KEY": "/k.pem"},
    "GPUPOOL_TLS_FINGERPRINT": {"GPUPOOL_TLS_FINGERPRINT": FINGERPRINT},
    "GPUPOOL_CONNECT_TIMEOUT": {"GPUPOOL_CONNECT_TIMEOUT": "5"},
    "GPUPOOL_PROBE_TIMEOUT": {"GPUPOOL_PROBE_TIMEOUT": "5"},
    "GPUPOOL_COMPRESSION": {"GPUPOOL_COMPRESSION": "lz4"},
    "GPUPOOL_SERVER": {},
    "GPUPOOL_KEEP_GPU": {"GPUPOOL_KEEP_GPU": "1"},
    "GPUPOOL_GPU": {"GPUPOOL_GPU": "1"},
    "GPUPOOL_GPU_MODEL": {"GPUPOOL_GPU_MODEL": "H100"},
    "GPUPOOL_MIN_MEMORY": {"GPUPOOL_MIN_MEMORY": "1G"},
    "GPUPOOL_GPUS": {"GPUPOOL_GPUS": "2"},
    "GPUPOOL_SPREAD": {"GPUPOOL_SPREAD": "1"},
    "GPUPOOL_SPREAD_COPY": {"GPUPOOL_SPREAD_COPY": "client"},
    "GPUPOOL_MEMORY": {"GPUPOOL_MEMORY": "8GiB"},
}
# The names `gpupool config` gives the top-level settings the file's keys feed.
TOP_SOURCES = {"servers": "servers", "gpu": "gpu", "model": "model", "min_memory": "min_memory",
               "gpus": "gpus", "spread": "spread", "spread_copy": "spread_copy",
               "memory": "memory",
               "connect_timeout": "connect_timeout", "probe_timeout": "probe_timeout",
               "compression": "compression", "keep_gpu": "keep_gpu"}


@pytest.fixture(scope="module")
def keys(native_build: Path) -> list[config_keys.ConfigKey]:
    del native_build  # built: gpupool.shim finds the library in build/client
    return config_keys.config_keys()


def written(key: config_keys.ConfigKey, value: str) -> str:
    """A file that sets key (in its table) to value."""
    if key.table == "servers":
        extra = "" if key.name == "address" else "address = 'gpu1:7070'\n"
        return f"[[servers]]\n{extra}{key.name} = {value}\n"
    if key.table == "requirements":
        return f"[requirements]\n{key.name} = {value}\n"
    return f"{key.name} = {value}\n"


def test_the_doc_has_the_generated_key_table(keys: list[config_keys.ConfigKey]) -> None:
    assert config_keys.markdown_table(keys) in DOC.read_text(), (
        "docs/client-configuration.md is out of date: paste the output of "
        "`python -m gpupool.config_keys` over its key table")


def test_the_table_names_every_key_once(keys: list[config_keys.ConfigKey]) -> None:
    where = [(k.table, k.name) for k in keys]
    assert len(where) == len(set(where))
    assert {k.table for k in keys} == {"", "requirements", "servers"}
    for k in keys:
        assert k.type and k.values and k.default and k.doc, k


def test_every_key_goes_to_its_setter(keys: list[config_keys.ConfigKey], tmp_path: Path) -> None:
    """A value of the wrong type is refused naming the key: the reader knows every key of the
    table (an unknown key would only be warned about)."""
    for k in keys:
        path = tmp_path / f"{k.table or 'top'}-{k.name}.toml"
        path.write_text(written(k, "'x'" if k.type == "boolean" else "true"))
        path.chmod(0o600)
        with pytest.raises(cc.ConfigError, match=rf"^{path}:\d+: .*{k.name}"):
            cc.load({"HOME": "/nonexistent-home", "GPUPOOL_CONFIG": str(path)})


def test_a_key_not_in_the_table_is_warned_about(tmp_path: Path, native_build: Path) -> None:
    del native_build
    path = tmp_path / "config.toml"
    path.write_text("[requirements]\ngpu_count = 2\n")
    path.chmod(0o600)
    warnings: list[str] = []
    cc.load({"HOME": "/nonexistent-home", "GPUPOOL_CONFIG": str(path)}, warn=warnings.append)
    assert warnings == [f"{path}:2: unknown setting 'gpu_count' in [requirements] ignored "
                        "(known there: gpu, model, min_memory, gpus, spread, spread_copy, memory)"]


def test_every_variable_of_the_table_is_read(keys: list[config_keys.ConfigKey]) -> None:
    """Each key's variable, set alone (with a server), is where `gpupool config` says that
    setting comes from."""
    assert {k.env for k in keys if k.env} == set(ENV_VALUES)
    for k in keys:
        if not k.env:
            continue
        env = {"HOME": "/nonexistent-home", "GPUPOOL_CONFIG": "none",
               "GPUPOOL_SERVER": "gpu1:7070", **ENV_VALUES[k.env]}
        cfg = cc.load(env)
        if k.table == "servers":
            assert cfg.servers[0].sources.get(k.name) == k.env, (k, cfg.servers[0].sources)
        else:
            sources = cfg.sources if k.name in TOP_SOURCES else cfg.servers[0].sources
            assert sources.get(TOP_SOURCES.get(k.name, k.name)) == k.env, (k, sources)


def test_config_help_lists_every_key(keys: list[config_keys.ConfigKey]) -> None:
    out = subprocess.run([sys.executable, "-m", "gpupool", "config", "--help"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    for k in keys:
        label = f"{config_keys.TABLE_HEADERS[k.table]} {k.name}".strip()
        assert any(x.startswith(f"  {label} ") and k.doc in x and k.env in x for x in lines), (
            k, out)


def test_the_user_guide_names_every_variable_the_client_reads(
        keys: list[config_keys.ConfigKey]) -> None:
    """docs/user-guide.md's table of environment variables has a row for each variable of the
    key table and each GPUPOOL_* the client's C code reads (the shims, the reader), so a new one
    cannot reach users undocumented."""
    guide = (REPO / "docs" / "user-guide.md").read_text()
    rows = "\n".join(line for line in guide.splitlines() if line.startswith("| `GPUPOOL_"))
    documented = set(re.findall(r"`(GPUPOOL_[A-Z_]+)`", rows))
    read: set[str] = set()
    for folder in ("client/shim", "client/common", "client/nvml"):
        for path in (REPO / folder).glob("*.c"):
            read |= set(re.findall(r'"(GPUPOOL_[A-Z_]+)"', path.read_text()))
    wanted = {k.env for k in keys if k.env} | read
    assert len(read) > 15, sorted(read)
    assert not wanted - documented, f"not in docs/user-guide.md's table: {sorted(wanted - documented)}"
