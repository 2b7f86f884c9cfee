"""`gpupool login` in a real terminal (tmux: send-keys, capture-pane), as ssh's first connection:
it shows the server's fingerprint and asks; "yes" pins it and the token, typed without echo, is
sent and written; "no" writes nothing. After the server's key changed (a new identity on the
same port), the next login is refused with the loud message and the file stays as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO, GpupoolServer, require, wait_until
from gpupool import config as cc


class Tmux:
    """One tmux server of our own (its socket in a short temporary folder: a socket path has
    at most 107 bytes) with one shell, started with `env` (which the shell inherits)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="gpt-tmux-")
        self.socket = os.path.join(self.folder, "s")
        self.env = env
        self.run("-f", "/dev/null", "new-session", "-d", "-s", "login", "-x", "220", "-y", "50",
                 "bash --norc --noprofile")

    def run(self, *args: str) -> str:
        proc = subprocess.run(["tmux", "-S", self.socket, *args], env=self.env,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"tmux {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def type(self, text: str) -> None:
        """`text` typed (literally), then Enter."""
        self.run("send-keys", "-t", "login", "-l", text)
        self.run("send-keys", "-t", "login", "Enter")

    def screen(self) -> str:
        """What the terminal shows (wrapped lines joined), with its scrollback."""
        return self.run("capture-pane", "-p", "-J", "-t", "login", "-S", "-500").rstrip("\n")

    def wait_for(self, text: str, timeout: float = 30) -> str:
        def shown() -> str | None:
            screen = self.screen()
            return screen if text in screen else None

        try:
            return wait_until(f"{text!r} on the terminal", shown, timeout=timeout, interval=0.1)
        except AssertionError:
            raise AssertionError(f"{text!r} not on the terminal after {timeout} s:\n"
                                 f"{self.screen()}") from None

    def clear(self) -> None:
        self.run("send-keys", "-t", "login", "clear", "Enter")
        self.run("clear-history", "-t", "login")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], env=self.env,
                       capture_output=True, timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[], Tmux]]:
    require(shutil.which("tmux"), "tmux is needed to drive gpupool login in a real terminal "
                                  "(apt-get install tmux)")
    made: list[Tmux] = []

    def make() -> Tmux:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "TMUX"))}
        env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "xdg"),
                   PYTHONPATH=str(REPO / "client"), PS1="$ ", TERM="xterm")
        made.append(Tmux(env))
        return made[-1]

    yield make
    for t in made:
        t.close()


def login_command(address: str, *args: str) -> str:
    # The exit status as "EXIT=N", a text the command line itself does not show.
    return " ".join([sys.executable, "-m", "gpupool", "login", address, *args,
                     '; echo "EX""IT=$?"'])


def test_login_asks_pins_and_refuses_a_changed_key(native_build: Path, start_daemon,  # type: ignore[no-untyped-def]
                                                   terminal: Callable[[], Tmux],
                                                   tmp_path: Path) -> None:
    first: GpupoolServer = start_daemon(build_dir=native_build)
    assert first.fingerprint is not None
    path = tmp_path / "xdg" / "gpupool" / "config.toml"
    tmux = terminal()

    # The question, with the fingerprint, before anything is written (or sent).
    tmux.type(login_command(first.address))
    screen = tmux.wait_for("Pin it and continue (yes/no)?")
    assert f"The identity of gpupool server {first.address} is\n    {first.fingerprint}\n" in \
        screen, screen
    assert "Check it against what `gpupoold fingerprint` prints on the server" in screen
    assert not path.exists()
    tmux.type("maybe")
    tmux.wait_for("Please type 'yes', 'no' or the fingerprint:")
    tmux.type("yes")
    # Then the token, typed without echo.
    tmux.wait_for(f"Token for {first.address} (gpt_..., not shown):")
    tmux.type(first.token)
    screen = tmux.wait_for("EXIT=")
    assert "EXIT=0" in screen, screen
    assert f"logged in to {first.address}" in screen and first.token not in screen
    data, _ = cc.read_file(path)
    assert data["servers"] == [{"address": first.address, "token": first.token,
                                "tls_fingerprint": first.fingerprint}]

    # "no": nothing written (another file, so the first one stays for what follows).
    tmux.clear()
    other = tmp_path / "other.toml"
    tmux.type(f"GPUPOOL_CONFIG={other} " + login_command(first.address, "--token", first.token))
    tmux.wait_for("Pin it and continue (yes/no)?")
    tmux.type("no")
    screen = tmux.wait_for("EXIT=")
    assert "EXIT=1" in screen and "not confirmed" in screen, screen
    assert "nothing was sent and nothing was written" in screen
    assert not other.exists()

    # The server's key changes: a new identity (another state directory) on the same port.
    port = first.port
    assert first.stop() == 0
    second: GpupoolServer = start_daemon("--listen", f"127.0.0.1:{port}", build_dir=native_build)
    assert second.address == first.address and second.fingerprint not in (None, first.fingerprint)
    before = path.read_bytes()
    tmux.clear()
    tmux.type(login_command(second.address, "--token", second.token))
    screen = tmux.wait_for("EXIT=")
    assert "EXIT=1" in screen, screen
    assert f"WARNING: THE IDENTITY OF SERVER {second.address} HAS CHANGED: it presents " \
           f"{second.fingerprint}, but the pinned one is {first.fingerprint}" in screen, screen
    assert "Pin it and continue" not in screen  # no question: a pinned key is never re-asked
    assert f"gpupool login {second.address} --fingerprint SHA256:..." in screen
    assert path.read_bytes() == before
    # Re-pinned on purpose, with the new key as the operator would read it to the user.
    tmux.clear()
    tmux.type(login_command(second.address, "--token", second.token, "--fingerprint",
                            str(second.fingerprint)))
    screen = tmux.wait_for("EXIT=")
    assert "EXIT=0" in screen, screen
    assert cc.read_file(path)[0]["servers"][0]["tls_fingerprint"] == second.fingerprint
