"""The `gpupool` command without a server: `gpupool env` (shell and notebook forms), `gpupool run`,
`gpupool config`'s trust rows, `gpupool login --help`, reading info replies of other protocol
versions, and usage errors. The commands that talk to servers are tested in test_login*.py,
test_status_smi.py, test_doctor.py, test_install_system.py and test_client_install.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CLIENT = REPO / "client"


def gpupool(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = dict(env)
    full["PYTHONPATH"] = str(CLIENT)
    return subprocess.run([sys.executable, "-m", "gpupool", *args], capture_output=True,
                          text=True, env=full, timeout=60)


@pytest.fixture
def shim_dir(tmp_path: Path) -> Path:
    (tmp_path / "libcuda.so.1").write_bytes(b"\x7fELF not really")
    return tmp_path


def test_env_prints_the_library_path(shim_dir: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir), "LD_LIBRARY_PATH": "/opt/x"}
    proc = gpupool("env", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"export LD_LIBRARY_PATH={shim_dir}:/opt/x"


def test_run_puts_the_shim_first_and_sets_the_server(shim_dir: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)}
    env.pop("LD_LIBRARY_PATH", None)
    proc = gpupool("run", "--server", "10.9.8.7:7070", "--", "sh", "-c",
                   'echo "$LD_LIBRARY_PATH|$GPUPOOL_SERVER"; exit 7', env=env)
    assert proc.returncode == 7  # the program's own exit status
    assert proc.stdout.strip() == f"{shim_dir}|10.9.8.7:7070"


def test_missing_shim_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(tmp_path)}
    proc = gpupool("run", "--", "true", env=env)
    assert proc.returncode == 1
    assert "libcuda.so.1 not found" in proc.stderr and str(tmp_path) in proc.stderr


def test_run_needs_a_command(shim_dir: Path) -> None:
    proc = gpupool("run", env={**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)})
    assert proc.returncode == 2 and "nothing to run" in proc.stderr


def test_unknown_program(shim_dir: Path) -> None:
    proc = gpupool("run", "--", "/nonexistent/prog",
                   env={**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)})
    assert proc.returncode == 127 and "cannot run /nonexistent/prog" in proc.stderr


def test_env_for_notebooks(shim_dir: Path) -> None:
    (shim_dir / "libnvidia-ml.so.1").write_bytes(b"\x7fELF not really either")
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir), "LD_LIBRARY_PATH": "/opt/x"}
    proc = gpupool("env", "--format", "python", env=env)
    assert proc.returncode == 0, proc.stderr
    code = proc.stdout
    # Runnable Python that sets the variable for child processes and loads both shims here
    # (checked without loading the fake files: ctypes.CDLL is replaced).
    loaded: list[tuple[str, int]] = []
    fake_ctypes = type("ctypes", (), {"RTLD_GLOBAL": 256,
                                      "CDLL": staticmethod(lambda p, mode: loaded.append((p, mode)))})
    fake_os = type("os", (), {"environ": {"LD_LIBRARY_PATH": "/kernel/lib"}})
    exec(code.replace("import ctypes, os", ""), {"ctypes": fake_ctypes, "os": fake_os})
    assert fake_os.environ["LD_LIBRARY_PATH"] == f"{shim_dir}:/kernel/lib"
    assert loaded == [(str(shim_dir / "libcuda.so.1"), 256),
                      (str(shim_dir / "libnvidia-ml.so.1"), 256)]
    proc = gpupool("env", "--format", "ipython", env=env)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == f"%env LD_LIBRARY_PATH={shim_dir}:/opt/x"
    assert second.startswith("import ctypes; ctypes.CDLL(") and "libnvidia-ml.so.1" in second
    proc = gpupool("env", "--help", env=env)
    assert "first cell of a Jupyter notebook" in proc.stdout


def test_usage_errors_exit_2() -> None:
    for args in (("frobnicate",), ("status", "--bogus"), ()):
        proc = gpupool(*args, env=dict(os.environ))
        assert proc.returncode == 2, (args, proc.stderr)


def test_login_help_says_how_the_token_and_the_identity_are_given() -> None:
    proc = gpupool("login", "--help", env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--token-file FILE" in text and "'-': from standard input" in text
    assert "visible to other users in `ps` and kept in the shell's history" in text
    assert "--fingerprint SHA256:..." in text and "no question asked (scripts)" in text
    assert "--plain" in text and "cross the network unencrypted" in text


def test_config_shows_each_servers_pin_and_where_it_comes_from(tmp_path: Path) -> None:
    pin = "SHA256:" + "A" * 43
    path = tmp_path / "c.toml"
    path.write_text(f'[[servers]]\naddress = "a:1"\ntls_fingerprint = "{pin}"\n'
                    '[[servers]]\naddress = "b:1"\n'
                    '[[servers]]\naddress = "c:1"\ntls = false\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["GPUPOOL_CONFIG"] = str(path)
    proc = gpupool("config", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split()[:1] in (["tls"], ["tls_fingerprint"])]
    assert rows == [["tls", "yes", "default"], ["tls_fingerprint", pin, f"{path}:3"],
                    ["tls", "yes", "default"], ["tls_fingerprint", "(none)", "default"],
                    ["tls", "no", "(plain", "TCP,", "unencrypted)", f"{path}:8"]]


def test_info_replies_of_older_and_newer_servers_are_read() -> None:
    """A 1.3 server's reply ends before fingerprint and fleet_servers, a 1.6 server's before
    shared_gpus, share_views and lease_gpus (read as empty); a newer 1.x appends fields
    (ignored); anything else short is still an error."""
    import gpupool_protocol as gp
    from gpupool.wire.info import decode_reply

    old = gp.InfoReply(result=0, major=gp.MAJOR, minor=3, server="old").encode()[:-20]
    reply = decode_reply(old)
    assert reply.server == "old" and reply.fingerprint == "" and reply.fleet_servers == []
    older = gp.InfoReply(result=0, major=gp.MAJOR, minor=6, server="1.6", fingerprint="f",
                         fleet_servers=[gp.InfoFleetServer(server="s")]).encode()[:-12]
    reply = decode_reply(older)
    assert reply.fingerprint == "f" and [s.server for s in reply.fleet_servers] == ["s"]
    assert reply.shared_gpus == [] and reply.share_views == [] and reply.lease_gpus == []
    with pytest.raises(gp.ProtocolError):  # a 1.6 reply cut anywhere else
        decode_reply(gp.InfoReply(result=0, major=gp.MAJOR, minor=6).encode()[:-16])
    newer = gp.InfoReply(result=0, major=gp.MAJOR, minor=gp.MINOR + 1, fingerprint="x").encode()
    assert decode_reply(newer + b"more").fingerprint == "x"
    with pytest.raises(gp.ProtocolError):
        decode_reply(gp.InfoReply(result=0, major=gp.MAJOR, minor=gp.MINOR).encode()[:-8])
