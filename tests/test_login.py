"""`gpupool login` / `logout` against a real gpupoold: the server is asked (info) before anything
is written; the file is private (0600 in a 0700 folder); a refused token or an unreachable
server writes nothing; programs then find the server through the file alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
from conftest import REPO, GpupoolServer, run_client
from gpupool import config as cc
from gpupool import login as lg

BAD_TOKEN = "gpt_000000000000_not-a-real-token"


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user whose home is tmp_path: no GPUPOOL_* variables, the working tree's package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "xdg"),
               PYTHONPATH=str(REPO / "client"))
    env.update(extra)
    return env


def gpupool(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_client([sys.executable, "-m", "gpupool", *args], env=env, timeout=60)


def user_file(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "gpupool" / "config.toml"


def test_login_writes_a_private_file_then_programs_use_it(gpupool_server: GpupoolServer,
                                                          tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", gpupool_server.address, "--token", gpupool_server.token)
    assert proc.returncode == 0, proc.stderr
    path = user_file(tmp_path)
    assert f"logged in to {gpupool_server.address}" in proc.stdout and str(path) in proc.stdout
    assert "token tests (user)" in proc.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    data, _ = cc.read_file(path)
    assert data["servers"] == [{"address": gpupool_server.address,
                                "token": gpupool_server.token}]
    # No variable names the server: status finds it (and the token) in the file.
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    assert f"{gpupool_server.address}: gpupoold" in proc.stdout and "you are tests (user)" in \
        proc.stdout
    # A second login to the same server replaces its token and keeps everything else.
    other = gpupool_server.create_token("second")
    data["requirements"] = {"model": "H100"}
    data["servers"].append({"address": "elsewhere:7070"})
    cc.write_file(path, data)
    proc = gpupool(env, "login", gpupool_server.address, "--token", other)
    assert proc.returncode == 0, proc.stderr
    data, _ = cc.read_file(path)
    assert data["requirements"] == {"model": "H100"}
    assert data["servers"] == [{"address": gpupool_server.address, "token": other},
                               {"address": "elsewhere:7070"}]
    # logout removes the entry and its token, and says so for an unknown one.
    proc = gpupool(env, "logout", gpupool_server.address)
    assert proc.returncode == 0, proc.stderr
    assert f"logged out of {gpupool_server.address}" in proc.stdout
    data, text = cc.read_file(path)
    assert data["servers"] == [{"address": "elsewhere:7070"}] and other not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    proc = gpupool(env, "logout", gpupool_server.address)
    assert proc.returncode == 1
    assert f"{gpupool_server.address} is not a server of {path}" in proc.stderr


def test_a_refused_token_writes_nothing(gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", gpupool_server.address, "--token", BAD_TOKEN)
    assert proc.returncode == 1
    assert f"{gpupool_server.address} refused the token" in proc.stderr
    assert "nothing was written" in proc.stderr
    assert not user_file(tmp_path).exists() and not user_file(tmp_path).parent.exists()
    # An existing file stays exactly as it was.
    cc.write_file(user_file(tmp_path), {"servers": [{"address": gpupool_server.address,
                                                     "token": gpupool_server.token}]})
    before = user_file(tmp_path).read_bytes()
    proc = gpupool(env, "login", gpupool_server.address, "--token", BAD_TOKEN)
    assert proc.returncode == 1 and "refused the token" in proc.stderr
    assert user_file(tmp_path).read_bytes() == before


def test_an_unreachable_server_writes_nothing(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", "127.0.0.1:1", "--token", BAD_TOKEN)
    assert proc.returncode == 1
    assert "cannot log in to 127.0.0.1:1: connection refused; nothing was written" in proc.stderr
    assert not user_file(tmp_path).exists()


@pytest.mark.parametrize(("args", "code", "what"), [
    (("login", "h:x", "--token", "t"), 2, "'h:x' is not a server address (host, host:port"),
    (("login", "h:1", "--token", " "), 2, "--token is empty"),
    (("login", "h:1", "--token", "t", "--tls-ca", "/nonexistent/ca.pem"), 1,
     "--tls-ca /nonexistent/ca.pem: no such file"),
    (("login", "h:1"), 2, "the following arguments are required: --token"),
    (("logout", "h:1"), 1, "does not exist: not logged in to h:1"),
])
def test_usage_errors(tmp_path: Path, args: tuple[str, ...], code: int, what: str) -> None:
    proc = gpupool(cli_env(tmp_path), *args)
    assert proc.returncode == code and what in proc.stderr, proc.stderr


def test_a_broken_file_is_not_overwritten(gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    path = user_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("servers = [\n")
    proc = gpupool(cli_env(tmp_path), "login", gpupool_server.address, "--token",
                   gpupool_server.token)
    assert proc.returncode == 1 and f"{path}:" in proc.stderr and "fix or remove" in proc.stderr
    assert path.read_text() == "servers = [\n"


def test_login_system_writes_the_system_file(gpupool_server: GpupoolServer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Never the machine's real /etc: the system file's path is moved into tmp_path.
    system = tmp_path / "etc" / "gpupool" / "config.toml"
    monkeypatch.setattr(lg, "SYSTEM_FILE", system)
    rc = lg.cmd_login(gpupool_server.address, gpupool_server.token, None, True,
                      cli_env(tmp_path))
    assert rc == 0, capsys.readouterr().err
    # Every user's programs read it: readable by all, unlike a user's own file.
    assert stat.S_IMODE(system.stat().st_mode) == 0o644
    assert stat.S_IMODE(system.parent.stat().st_mode) == 0o755
    assert not user_file(tmp_path).exists()
    assert lg.cmd_logout(gpupool_server.address, True, cli_env(tmp_path)) == 0
    assert "servers" not in cc.read_file(system)[0]


def test_login_with_tls(native_build: Path, start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file = tmp_path / "server.key", tmp_path / "server.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    for n, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(cert_file), append=n > 0)
    config = tmp_path / "gpupoold.toml"
    config.write_text(f'tls_cert = "{cert_file}"\ntls_key = "{key_file}"\n')
    server = start_daemon("--config", str(config), build_dir=native_build)
    env = cli_env(tmp_path)
    # Without the CA, the certificate is not trusted: nothing written.
    proc = gpupool(env, "login", f"tls://{server.address}", "--token", server.token)
    assert proc.returncode == 1 and "certificate was not accepted" in proc.stderr
    assert not user_file(tmp_path).exists()
    proc = gpupool(env, "login", server.address, "--token", server.token, "--tls-ca",
                   str(ca_file))
    assert proc.returncode == 0, proc.stderr
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [{"address": server.address, "token": server.token,
                                "tls_ca": str(ca_file), "tls": True}]
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    assert f"{server.address}: gpupoold 0.1.0 on" in proc.stdout and "TLSv1" in proc.stdout
