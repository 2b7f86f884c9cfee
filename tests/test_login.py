"""`gpupool login` / `logout` against a real gpupoold (TLS with its own identity, as gpupoold
serves by default): the identity is settled before anything secret is sent (--fingerprint for
scripts; without a terminal and without it, refused with the fix), then the server is asked
(info) with the token, and the token and the pin are written only if it accepts; the file is
private (0600 in a 0700 folder); programs then find the server, its token and its pin through
the file alone. The terminal dialogue itself is in test_login_tty.py; what crosses the wire
before the user said yes, and the fleet's pins, in test_login_trust.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme
from conftest import REPO, GpupoolServer, wait_until
from gpupool import config as cc
from gpupool import login as lg

BAD_TOKEN = "gpt_000000000000_not-a-real-token"
OTHER_PIN = "SHA256:" + "A" * 43  # a valid fingerprint that no daemon of these tests has


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user whose home is tmp_path: no GPUPOOL_* variables, the working tree's package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "xdg"),
               PYTHONPATH=str(REPO / "client"))
    env.update(extra)
    return env


def gpupool(env: dict[str, str], *args: str, stdin: str = "",
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command without a terminal (a new session: no /dev/tty), `stdin` on standard input."""
    try:
        return subprocess.run([sys.executable, "-m", "gpupool", *args], env=env, input=stdin,
                              capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"gpupool {' '.join(args)} still running after {timeout} s: {exc.stdout!r} "
                    f"{exc.stderr!r}", pytrace=False)


def user_file(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "gpupool" / "config.toml"


def token_file(tmp_path: Path, token: str, name: str = "token") -> Path:
    path = tmp_path / name
    path.write_text(token + "\n")
    return path


def test_login_with_fingerprint_writes_the_pin_then_programs_use_it(
        gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    server = gpupool_server
    assert server.fingerprint is not None
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", server.address, "--token-file",
                   str(token_file(tmp_path, server.token)), "--fingerprint", server.fingerprint)
    assert proc.returncode == 0, proc.stderr
    path = user_file(tmp_path)
    assert f"logged in to {server.address}" in proc.stdout and str(path) in proc.stdout
    assert "token tests (user)" in proc.stdout
    assert f"identity {server.fingerprint} pinned" in proc.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    data, _ = cc.read_file(path)
    assert data["servers"] == [{"address": server.address, "token": server.token,
                                "tls_fingerprint": server.fingerprint}]
    # No variable names the server: status finds it, the token and the pin in the file.
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    assert f"{server.address}: gpupoold" in proc.stdout and "you are tests (user)" in \
        proc.stdout
    assert "TLSv1.3, pinned identity" in proc.stdout
    # A second login to the same server, the token on standard input: the token is replaced,
    # the pin (the same key: no question) and everything else kept.
    other = server.create_token("second")
    data["requirements"] = {"model": "H100"}
    data["servers"].append({"address": "elsewhere:7070"})
    cc.write_file(path, data)
    proc = gpupool(env, "login", server.address, "--token-file", "-", stdin=other + "\n")
    assert proc.returncode == 0, proc.stderr
    data, text = cc.read_file(path)
    assert data["requirements"] == {"model": "H100"}
    assert data["servers"] == [{"address": server.address, "token": other,
                                "tls_fingerprint": server.fingerprint},
                               {"address": "elsewhere:7070"}]
    assert server.token not in text
    # logout removes the entry, its token and its pin, and says so for an unknown one.
    proc = gpupool(env, "logout", server.address)
    assert proc.returncode == 0, proc.stderr
    assert f"logged out of {server.address}" in proc.stdout
    data, text = cc.read_file(path)
    assert data["servers"] == [{"address": "elsewhere:7070"}] and other not in text
    assert server.fingerprint not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    proc = gpupool(env, "logout", server.address)
    assert proc.returncode == 1
    assert f"{server.address} is not a server of {path}" in proc.stderr


def test_without_a_terminal_or_fingerprint_nothing_is_sent(gpupool_server: GpupoolServer,
                                                          tmp_path: Path) -> None:
    server = gpupool_server
    assert server.fingerprint is not None
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", server.address, "--token", server.token)
    assert proc.returncode == 1
    assert (f"the identity of gpupool server {server.address} ({server.fingerprint}) cannot be "
            "confirmed without a terminal: nothing was sent and nothing was written") in \
        proc.stderr, proc.stderr
    assert f"`gpupool login {server.address} --fingerprint SHA256:...`" in proc.stderr
    assert not user_file(tmp_path).exists()

    # The token never reached the server: it has no record of its use, which it has (written
    # in the background) once a login with the fingerprint sent it.
    def last_used() -> object:
        tokens = server.get_json("/api/v1/tokens")["tokens"]
        return next(t["last_used"] for t in tokens if t["name"] == "tests")

    time.sleep(0.5)
    assert last_used() is None
    proc = gpupool(env, "login", server.address, "--token", server.token, "--fingerprint",
                   server.fingerprint)
    assert proc.returncode == 0, proc.stderr
    wait_until("the token's use recorded", last_used, timeout=10)


def test_a_wrong_fingerprint_is_refused(gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    server = gpupool_server
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", server.address, "--token", server.token, "--fingerprint",
                   OTHER_PIN)
    assert proc.returncode == 1
    assert (f"the identity of gpupool server {server.address} is {server.fingerprint}, not the "
            f"--fingerprint {OTHER_PIN} you gave: nothing was sent and nothing was written") in \
        proc.stderr, proc.stderr
    assert not user_file(tmp_path).exists()


def test_a_changed_identity_is_refused_loudly_and_repinned_only_on_purpose(
        gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    """The file pins another key for this address (the server was reinstalled, or someone is in
    the middle): login refuses before sending the token, and leaves the file as it was;
    --fingerprint with the key the server really has re-pins it."""
    server = gpupool_server
    path = user_file(tmp_path)
    cc.write_file(path, {"servers": [{"address": server.address, "token": "gpt_old",
                                      "tls_fingerprint": OTHER_PIN}]})
    before = path.read_bytes()
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", server.address, "--token", server.token)
    assert proc.returncode == 1
    err = proc.stderr
    assert f"WARNING: THE IDENTITY OF SERVER {server.address} HAS CHANGED: it presents " \
           f"{server.fingerprint}, but the pinned one is {OTHER_PIN}" in err, err
    assert "someone is in the middle of this connection" in err
    assert f"The pin is in {path}; nothing was sent to the server and the file is unchanged" \
        in err
    assert f"gpupool login {server.address} --fingerprint SHA256:..." in err
    assert f"`gpupool logout {server.address}`, then `gpupool login {server.address}`" in err
    assert path.read_bytes() == before
    # Programs and status refuse it the same way, before sending anything.
    proc = gpupool(env, "status")
    assert proc.returncode == 1
    assert f"{server.address}: not trusted: WARNING: THE IDENTITY OF SERVER {server.address} " \
           "HAS CHANGED" in proc.stdout, proc.stdout
    # A --fingerprint that is not the server's is refused too; the right one re-pins.
    proc = gpupool(env, "login", server.address, "--token", server.token, "--fingerprint",
                   "SHA256:" + "B" * 42 + "A")
    assert proc.returncode == 1 and "nothing was written" in proc.stderr
    assert path.read_bytes() == before
    assert server.fingerprint is not None
    proc = gpupool(env, "login", server.address, "--token", server.token, "--fingerprint",
                   server.fingerprint)
    assert proc.returncode == 0, proc.stderr
    assert f"replacing the pinned identity of {server.address} ({OTHER_PIN}) with " \
           f"{server.fingerprint}" in proc.stderr
    data, _ = cc.read_file(path)
    assert data["servers"] == [{"address": server.address, "token": server.token,
                                "tls_fingerprint": server.fingerprint}]


def test_a_refused_token_writes_nothing(gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    server = gpupool_server
    assert server.fingerprint is not None
    env = cli_env(tmp_path)
    args = ("login", server.address, "--token", BAD_TOKEN, "--fingerprint", server.fingerprint)
    proc = gpupool(env, *args)
    assert proc.returncode == 1
    assert f"{server.address} refused the token" in proc.stderr
    assert "nothing was written" in proc.stderr
    assert not user_file(tmp_path).exists() and not user_file(tmp_path).parent.exists()
    # An existing file stays exactly as it was.
    cc.write_file(user_file(tmp_path), {"servers": [{"address": server.address,
                                                     "token": server.token}]})
    before = user_file(tmp_path).read_bytes()
    proc = gpupool(env, *args)
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
    (("login", "h:1", "--token", " "), 2, "--token gave an empty token"),
    (("login", "h:1", "--token", "t", "--tls-ca", "/nonexistent/ca.pem"), 1,
     "--tls-ca /nonexistent/ca.pem: no such file"),
    (("login", "h:1"), 2, "no token and no terminal to ask for it: give it with --token-file "
                          "FILE, or --token-file - on standard input"),
    (("login", "h:1", "--token-file", "/nonexistent/t"), 2,
     "--token-file /nonexistent/t: No such file or directory"),
    (("login", "h:1", "--token", "t", "--token-file", "-"), 2,
     "argument --token-file: not allowed with argument --token"),
    (("login", "h:1", "--token", "t", "--fingerprint", "SHA256:abc"), 2,
     "--fingerprint 'SHA256:abc' is not a fingerprint: give what `gpupoold fingerprint` prints"),
    (("login", "h:1", "--token", "t", "--fingerprint", " "), 2, "--fingerprint '' is not a "
                                                                "fingerprint"),
    (("login", "h:1", "--token", "t", "--plain", "--fingerprint", OTHER_PIN), 2,
     "--plain (no TLS) contradicts --fingerprint"),
    (("login", "tls://h:1", "--token", "t", "--plain"), 2, "--plain (no TLS) contradicts tls://"),
    (("logout", "h:1"), 1, "does not exist: not logged in to h:1"),
])
def test_usage_errors(tmp_path: Path, args: tuple[str, ...], code: int, what: str) -> None:
    proc = gpupool(cli_env(tmp_path), *args)
    assert proc.returncode == code and what in proc.stderr, proc.stderr
    assert not user_file(tmp_path).exists()


def test_an_empty_token_on_standard_input(tmp_path: Path) -> None:
    proc = gpupool(cli_env(tmp_path), "login", "h:1", "--token-file", "-", stdin="\n")
    assert proc.returncode == 2
    assert "standard input gave an empty token" in proc.stderr, proc.stderr


def test_a_broken_file_is_not_overwritten(gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    path = user_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("servers = [\n")
    assert gpupool_server.fingerprint is not None
    proc = gpupool(cli_env(tmp_path), "login", gpupool_server.address, "--token",
                   gpupool_server.token, "--fingerprint", gpupool_server.fingerprint)
    assert proc.returncode == 1 and f"{path}:" in proc.stderr and "fix or remove" in proc.stderr
    assert path.read_text() == "servers = [\n"


def test_login_system_writes_the_system_file(gpupool_server: GpupoolServer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Never the machine's real /etc: the system file's path is moved into tmp_path.
    system = tmp_path / "etc" / "gpupool" / "config.toml"
    monkeypatch.setattr(lg, "SYSTEM_FILE", system)
    rc = lg.cmd_login(lg.LoginArgs(url=gpupool_server.address, token=gpupool_server.token,
                                   fingerprint=gpupool_server.fingerprint, system=True),
                      cli_env(tmp_path))
    assert rc == 0, capsys.readouterr().err
    # Every user's programs read it: readable by all, unlike a user's own file.
    assert stat.S_IMODE(system.stat().st_mode) == 0o644
    assert stat.S_IMODE(system.parent.stat().st_mode) == 0o755
    assert not user_file(tmp_path).exists()
    assert cc.read_file(system)[0]["servers"][0]["tls_fingerprint"] == gpupool_server.fingerprint
    assert lg.cmd_logout(gpupool_server.address, True, cli_env(tmp_path)) == 0
    assert "servers" not in cc.read_file(system)[0]


def test_login_with_a_ca(native_build: Path, start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An operator's own certificate: the CA vouches for the server, no question is asked."""
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
    # Without the CA or a pin, and no terminal to ask: nothing written.
    proc = gpupool(env, "login", f"tls://{server.address}", "--token", server.token)
    assert proc.returncode == 1 and "cannot be confirmed without a terminal" in proc.stderr
    assert not user_file(tmp_path).exists()
    # Another CA: the certificate is not accepted.
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    proc = gpupool(env, "login", server.address, "--token", server.token, "--tls-ca", str(other))
    assert proc.returncode == 1 and "certificate was not accepted" in proc.stderr
    assert not user_file(tmp_path).exists()
    proc = gpupool(env, "login", server.address, "--token", server.token, "--tls-ca",
                   str(ca_file))
    assert proc.returncode == 0, proc.stderr
    assert f"certificate verified with {ca_file}" in proc.stdout
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [{"address": server.address, "token": server.token,
                                "tls_ca": str(ca_file)}]
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    assert f"{server.address}: gpupoold 0.1.0 on" in proc.stdout
    assert "TLSv1.3, certificate verified" in proc.stdout


def test_plain_tcp_only_when_said_so(plain_server: GpupoolServer, gpupool_server: GpupoolServer,
                                    tmp_path: Path) -> None:
    """A daemon with tls = "off": login without --plain cannot make TLS work and says what to
    do; with --plain it warns that the token crosses in clear and writes tls = false. A TLS
    login later writes tls = true over it."""
    server = plain_server
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", server.address, "--token", server.token)
    assert proc.returncode == 1
    assert "the server does not speak TLS on this port" in proc.stderr, proc.stderr
    assert f"`gpupool login {server.address} --plain`" in proc.stderr
    assert not user_file(tmp_path).exists()
    proc = gpupool(env, "login", server.address, "--token", server.token, "--plain")
    assert proc.returncode == 0, proc.stderr
    assert f"WARNING: plain TCP to {server.address} (--plain): the token and everything your " \
           "programs send cross the network unencrypted" in proc.stderr
    assert "plain TCP, unencrypted" in proc.stdout
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [{"address": server.address, "token": server.token,
                                "tls": False}]
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    assert "plain TCP)" in proc.stdout
    # Every plain login says so again: without --plain, login tries TLS (the entry's
    # tls = false notwithstanding), and the token does not cross in clear.
    before = user_file(tmp_path).read_bytes()
    proc = gpupool(env, "login", server.address, "--token", server.token)
    assert proc.returncode == 1 and "does not speak TLS" in proc.stderr, proc.stderr
    assert user_file(tmp_path).read_bytes() == before
    # A server that says tls = false in the file and serves TLS now: a TLS login turns it on.
    tls = gpupool_server
    assert tls.fingerprint is not None
    data, _ = cc.read_file(user_file(tmp_path))
    data["servers"].append({"address": tls.address, "token": "gpt_old", "tls": False})
    cc.write_file(user_file(tmp_path), data)
    proc = gpupool(env, "login", tls.address, "--token", tls.token, "--fingerprint",
                   tls.fingerprint)
    assert proc.returncode == 0, proc.stderr
    assert cc.read_file(user_file(tmp_path))[0]["servers"][1] == {
        "address": tls.address, "token": tls.token, "tls": True,
        "tls_fingerprint": tls.fingerprint}


OLD_CLIENT_FILE = """\
# gpupool client configuration (docs/user-guide.md); written by `gpupool login`.
# Keep it private (mode 0600): it holds tokens.

[[servers]]
address = "{address}"
token = "{token}"
"""


def test_a_file_of_the_previous_release_gets_the_one_line_fix(
        gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    """What the previous release's `gpupool login` wrote (address and token, no pin, no tls):
    every command, and a program, refuses the server at once with the command that fixes it,
    never a hang or a TLS error."""
    server = gpupool_server
    path = user_file(tmp_path)
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text(OLD_CLIENT_FILE.format(address=server.address, token=server.token))
    path.chmod(0o600)
    env = cli_env(tmp_path)
    fix = (f"no pinned identity for {server.address}: nothing was sent; run `gpupool login "
           f"{server.address}`")
    for command in ("status", "smi"):
        start = time.monotonic()
        proc = gpupool(env, command)
        assert proc.returncode == 1
        assert f"{server.address}: not trusted: {fix}" in proc.stdout, proc.stdout
        assert time.monotonic() - start < 10
    proc = gpupool(env, "doctor", timeout=180)
    assert proc.returncode == 1
    assert f"FAIL  {server.address}: identity: {fix}" in proc.stdout, proc.stdout
    assert f"      fix: `gpupool login {server.address}` shows the server's identity" in \
        proc.stdout
    # A CUDA program (our libcuda.so.1) says the same line and stops at cuInit.
    program = ("import ctypes, sys; sys.exit(ctypes.CDLL('libcuda.so.1').cuInit(0))")
    run_env = {**env, "LD_LIBRARY_PATH": str(server.build_dir / "client")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", program], env=run_env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert fix in proc.stderr, proc.stderr
    assert time.monotonic() - start < 10
    # And the fix works: login pins it (for the test, --fingerprint instead of the question).
    assert server.fingerprint is not None
    proc = gpupool(env, "login", server.address, "--token-file", "-", "--fingerprint",
                   server.fingerprint, stdin=server.token)
    assert proc.returncode == 0, proc.stderr
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
