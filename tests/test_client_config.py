"""The client configuration as the `gpupool` command reads it (client/gpupool/config.py, through
the shims' own reader in libgpupool-config.so): which file, the TOML subset, environment
overrides, warnings, writing; and `gpupool config` (docs/client-configuration.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from client_config_example import EXAMPLE
from conftest import REPO
from gpupool import config as cc


def write(tmp_path: Path, text: str, name: str = "config.toml", mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def env_for(path: Path | None, **extra: str) -> dict[str, str]:
    env = {"HOME": "/nonexistent-home", "GPUPOOL_CONFIG": str(path) if path else "none"}
    env.update(extra)
    return env


def load(env: dict[str, str]) -> tuple[cc.ClientConfig, list[str]]:
    warnings: list[str] = []
    return cc.load(env, warn=warnings.append), warnings


# ------------------------------------------------------------------------------ the file
def test_which_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cc, "SYSTEM_FILE", tmp_path / "etc" / "config.toml")
    home = tmp_path / "home"
    # Nothing anywhere: no file.
    cfg, _ = load({"HOME": str(home)})
    assert cfg.file == "" and cfg.servers == []
    # The system file when there is no user file.
    cc.SYSTEM_FILE.parent.mkdir()
    cc.SYSTEM_FILE.write_text('servers = ["sys:1"]\n')
    cfg, _ = load({"HOME": str(home)})
    assert cfg.file == str(cc.SYSTEM_FILE) and [s.address for s in cfg.servers] == ["sys:1"]
    # The user's file wins, never merged with the system file.
    user = home / ".config" / "gpupool" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text('connect_timeout = 3\n')
    cfg, _ = load({"HOME": str(home)})
    assert cfg.file == str(user) and cfg.servers == [] and cfg.connect_timeout == 3
    # XDG_CONFIG_HOME moves the user's file ("" counts as unset).
    xdg = tmp_path / "xdg" / "gpupool" / "config.toml"
    xdg.parent.mkdir(parents=True)
    xdg.write_text('servers = ["xdg:1"]\n')
    cfg, _ = load({"HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert cfg.file == str(xdg)
    cfg, _ = load({"HOME": str(home), "XDG_CONFIG_HOME": ""})
    assert cfg.file == str(user)
    # GPUPOOL_CONFIG: that file, or none at all.
    cfg, _ = load({"HOME": str(home), "GPUPOOL_CONFIG": str(xdg)})
    assert cfg.file == str(xdg)
    cfg, _ = load({"HOME": str(home), "GPUPOOL_CONFIG": "none"})
    assert cfg.file == "" and cfg.connect_timeout == cc.DEFAULT_CONNECT_TIMEOUT
    with pytest.raises(cc.ConfigError, match=r"GPUPOOL_CONFIG=.*missing.toml: No such file or "
                       r"directory; point it at the configuration file, or set "
                       r"GPUPOOL_CONFIG=none to read none"):
        load({"HOME": str(home), "GPUPOOL_CONFIG": str(tmp_path / "missing.toml")})


def test_the_example_of_the_contract(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    cfg, warnings = load(env_for(path, HOME=str(tmp_path)))
    assert warnings == []
    assert cfg.connect_timeout == 10 and cfg.probe_timeout == 2.5
    assert (cfg.gpu, cfg.model, cfg.min_memory) == ("", "H100", 40 << 30)
    one, two, three = cfg.servers
    assert (one.address, one.host, one.port, one.tls, one.token) == (
        "gpu1.example.com:7070", "gpu1.example.com", "7070", False, "gpt_one")
    folder = os.path.realpath(tmp_path)
    assert one.tls_ca == f"{folder}/certs/ca.pem"  # inherited, relative to the file
    assert (two.address, two.port, two.tls, two.token) == ("gpu2.example.com:7071", "7071", True,
                                                           "gpt_default")
    assert two.tls_ca == f"{tmp_path}/ca2.pem"  # ~ is the HOME of the environment given
    assert (three.host, three.port, three.tls) == ("::1", "7072", True)
    assert one.sources["token"] == f"{path}:15" and two.sources["token"] == f"{path}:2"
    assert cfg.sources["model"] == f"{path}:10"


def test_short_form_and_bare_hosts(tmp_path: Path) -> None:
    path = write(tmp_path, 'servers = [\n  "a",\n  "tls://b:99",   # comment\n]\ntoken = "t"\n')
    cfg, _ = load(env_for(path))
    assert [(s.host, s.port, s.tls, s.tls_prefix, s.token) for s in cfg.servers] == [
        ("a", "7070", True, False, "t"), ("b", "99", True, True, "t")]  # TLS by default


def test_min_memory_as_integer_and_gpu_index(tmp_path: Path) -> None:
    path = write(tmp_path, "[requirements]\ngpu = '1'\nmin_memory = 1000\n")
    cfg, _ = load(env_for(path))
    assert cfg.gpu == "1" and cfg.min_memory == 1000


SUBSET_TEXT = "the gpupool configuration is a TOML subset"


# The messages are the C reader's (client/common/client_config.c), word for word.
@pytest.mark.parametrize(("text", "line", "what"), [
    ("[requirements]\ngpu = {a = 1}\n", 2, f"inline tables ({{...}}) are not supported; "
                                           f"{SUBSET_TEXT}"),
    ("requirements.gpu = '1'\n", 1, "dotted keys (requirements.x = ...) are not supported"),
    ('"token" = "x"\n', 1, "quoted keys are not supported; write the key bare"),
    ('token = """x"""\n', 1, 'multi-line strings (""") are not supported; write the value on '
                             "one line"),
    ("\n[servers]\naddress = 'x'\n", 2, "[servers] is not supported: write [[servers]]"),
    ("[[requirements]]\n", 1, "[[requirements]] is not supported: write [requirements]"),
    ("[requirements]\n[requirements]\n", 2, "[requirements] appears twice; merge the two"),
    ("[a.b]\n", 1, "unsupported table header (quoted or dotted names)"),
    ("servers = ['a']\n[[servers]]\naddress = 'b'\n", 2,
     "[[servers]] together with servers = [...] (line 1): use one form"),
    ("servers = [['a']]\n", 1, "the array of servers may only hold strings"),
    ("servers = [1, 2]\n", 1, "the array of servers may only hold strings"),
    ("servers = ['a' 'b']\n", 1, "expected , or ] in the array of servers"),
    ("servers = [\n 'a',\n", 3, "the array of servers has no closing ]"),
    ("token = 'a'\nwhen = 1979-05-27\n", 2, "cannot read the value of when (strings need "
                                             "quotes: when = \"...\"; dates, hex numbers, inf and "
                                             "nan are not supported)"),
    ("probe_timeout = 0x10\n", 1, "cannot read the value of probe_timeout"),
    ("probe_timeout = 007\n", 1, "cannot read the value of probe_timeout"),
    ("token =\n", 1, 'token has no value; write token = "..."'),
    ('token = "a\\bc"\n', 1, "unsupported escape \\b; the supported escapes are"),
    ('token = "\\u12"\n', 1, "\\u needs four hex digits"),
    ('token = "\\ud800"\n', 1, "\\ud800 is not a character a value may hold"),
    ('token = "a\x01b"\n', 1, "a control character inside a string"),
    ('token = "abc\n', 1, 'this string has no closing " on its line'),
    ("token = 'a' 'b'\n", 1, "unexpected text after the value: ''b''"),
    ("token\n", 1, "expected = after token (key = value)"),
    ("token = 'a'\ntoken = 'b'\n", 2, "token is set twice in the same table; keep one"),
])
def test_outside_the_subset_names_file_and_line(tmp_path: Path, text: str, line: int,
                                                what: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cc.ConfigError) as info:
        load(env_for(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: ") and what in msg, msg


@pytest.mark.parametrize(("text", "line", "what"), [
    ("tls = 'yes'\n", 1, "tls must be true or false"),
    ("\nconnect_timeout = -1\n", 2, "connect_timeout must be a number of seconds"),
    ("[requirements]\nmin_memory = '40X'\n", 2, "is not a size"),
    ("[[servers]]\ntoken = 'x'\n", 1, "this [[servers]] entry has no address"),
    ("[requirements]\ngpu = true\n", 2, 'gpu must be a GPU index (1 or "1") or a GPU UUID '
                                       "(prefix) in quotes"),
    ("[requirements]\ngpu = -1\n", 2, "gpu must be a GPU index"),
    ("[[servers]]\naddress = 'h:0'\n", 2, "'h:0' is not a server address"),
    ("[[servers]]\naddress = ' '\n", 1, "this [[servers]] entry has no address"),
    ("tls_cert = 'c.pem'\nservers = ['a']\n", 0, ""),
    ("[requirements]\nmin_memory = -5\n", 2, "min_memory must be a size in quotes"),
    ("[[servers]]\naddress = 'a:b'\n", 2, "'a:b' is not a server address: write host, "
                                           "host:port, [v6]:port or tls://host:port"),
    ("[[servers]]\naddress = 'a:1'\ncompression = 'LZ4'\n[[servers]]\naddress = 'b'\n", 3,
     'server a:1: compression = "LZ4" is not supported'),
    ("[[servers]]\naddress = 'a:1'\ncompression = false\n", 3,
     'compression must be "off" or "lz4"'),
    ("servers = ['ok', 'a b:1']\n", 1, "'a b:1' is not a server address"),
])
def test_bad_values_name_file_and_line(tmp_path: Path, text: str, line: int, what: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cc.ConfigError) as info:
        load(env_for(path))
    msg = str(info.value)
    if line == 0:  # not about one line: the cert without its key
        assert msg == ("server a: tls_cert is set but tls_key is not: set both (a client "
                       "certificate and its key, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY) or "
                       "neither"), msg
        return
    assert msg.startswith(f"{path}:{line}: ") and what in msg, msg


def test_unknown_keys_and_tables_warn_once_each(tmp_path: Path) -> None:
    path = write(tmp_path, "colour = 'blue'\n[requirements]\nspeed = 1\n[[servers]]\n"
                           "address = 'a'\nport = 1\n[extra]\nx = {}\ny = 2\n")
    with pytest.raises(cc.ConfigError, match="inline tables"):  # still TOML subset inside
        load(env_for(path))
    path = write(tmp_path, "colour = 'blue'\n[requirements]\nspeed = 1\n[[servers]]\n"
                           "address = 'a'\nport = 1\n[extra]\nx = 1\ny = 2\n[[more]]\n")
    cfg, warnings = load(env_for(path))
    assert [s.address for s in cfg.servers] == ["a"]
    assert sorted(warnings) == sorted([
        f"{path}:7: unknown table [extra] ignored (known: [requirements], [[servers]])",
        f"{path}:10: unknown table [[more]] ignored (known: [requirements], [[servers]])",
        f"{path}:3: unknown setting 'speed' in [requirements] ignored (known there: gpu, model, "
        "min_memory, gpus, spread, spread_copy, memory)",
        f"{path}:1: unknown setting 'colour' ignored (known there: token, tls, tls_ca, "
        "tls_cert, tls_key, connect_timeout, probe_timeout, compression, servers)",
        f"{path}:6: unknown setting 'port' in [[servers]] ignored (known there: address, token, "
        "tls, tls_ca, tls_cert, tls_key, tls_fingerprint, compression)"])


def test_a_token_readable_by_others_is_warned_about(tmp_path: Path) -> None:
    path = write(tmp_path, 'token = "gpt_x"\n', mode=0o644)
    _, warnings = load(env_for(path, HOME=str(tmp_path)))
    assert warnings == [f"{path} holds a token and is readable by other users (mode 0644): "
                        f"chmod 600 {path}"]
    path.chmod(0o600)
    assert load(env_for(path, HOME=str(tmp_path)))[1] == []
    # Outside the home folder (a system file) or without a token: no warning.
    path.chmod(0o644)
    assert load(env_for(path, HOME=str(tmp_path / "elsewhere")))[1] == []
    no_token = write(tmp_path, 'servers = ["a"]\n', "other.toml", mode=0o644)
    assert load(env_for(no_token, HOME=str(tmp_path)))[1] == []


# ------------------------------------------------------------------------ the environment
def test_environment_overrides_key_by_key(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    cfg, _ = load(env_for(path, GPUPOOL_SERVER=" gpu2.example.com:7071 , new:1,",
                          GPUPOOL_CONNECT_TIMEOUT="0", GPUPOOL_PROBE_TIMEOUT="",
                          GPUPOOL_DEVICE="GPU-ab", GPUPOOL_GPU_MODEL="", GPUPOOL_MIN_MEMORY="80G"))
    # GPUPOOL_SERVER replaces the list; an address of the file keeps its token and TLS.
    two, new = cfg.servers
    assert (two.address, two.tls, two.token) == ("gpu2.example.com:7071", True, "gpt_default")
    assert (new.address, new.tls, new.token) == ("new:1", False, "gpt_default")
    assert cfg.sources["servers"] == "GPUPOOL_SERVER"
    assert cfg.connect_timeout == 0 and cfg.probe_timeout == 2.5  # "" is unset
    assert cfg.gpu == "GPU-ab" and cfg.sources["gpu"] == "GPUPOOL_DEVICE"
    assert cfg.model == "H100" and cfg.min_memory == 80 * 10**9
    cfg, _ = load(env_for(path, GPUPOOL_TOKEN="gpt_env", GPUPOOL_TLS="1",
                          GPUPOOL_TLS_CA="/env/ca.pem", GPUPOOL_GPU="1", GPUPOOL_DEVICE="2"))
    assert {s.token for s in cfg.servers} == {"gpt_env"}
    assert all(s.tls and s.tls_ca == "/env/ca.pem" for s in cfg.servers)
    assert cfg.gpu == "1" and cfg.sources["gpu"] == "GPUPOOL_GPU"
    # tls:// turns TLS on whatever GPUPOOL_TLS says.
    cfg, _ = load(env_for(path, GPUPOOL_TLS="off"))
    assert [s.tls for s in cfg.servers] == [False, True, False]


PER_SERVER = """\
compression = "lz4"
[[servers]]
address = "near:1"
compression = "off"
[[servers]]
address = "far:2"
[[servers]]
address = "blank:3"
compression = " "
"""


def test_per_server_compression_and_its_source(tmp_path: Path) -> None:
    """A [[servers]] table's compression wins over the top level's for that server (a blank
    one is unset); GPUPOOL_COMPRESSION wins over every server's; each says where it came from."""
    path = write(tmp_path, PER_SERVER)
    cfg, _ = load(env_for(path))
    assert (cfg.compression, cfg.sources["compression"]) == ("lz4", f"{path}:1")
    assert [(s.compression, s.sources["compression"]) for s in cfg.servers] == [
        ("off", f"{path}:4"), ("lz4", f"{path}:1"), ("lz4", f"{path}:1")]
    for value in ("off", "lz4"):
        cfg, _ = load(env_for(path, GPUPOOL_COMPRESSION=f" {value} "))
        assert cfg.compression == value
        assert [(s.compression, s.sources["compression"]) for s in cfg.servers] == [
            (value, "GPUPOOL_COMPRESSION")] * 3
    # The reverse: off at the top (here by default), lz4 for one server.
    path = write(tmp_path, '[[servers]]\naddress = "near:1"\n[[servers]]\naddress = "far:2"\n'
                           'compression = "lz4"\n', "reverse.toml")
    cfg, _ = load(env_for(path))
    assert cfg.compression == "off" and "compression" not in cfg.sources
    near, far = cfg.servers
    assert near.compression == "off" and "compression" not in near.sources  # the default
    assert (far.compression, far.sources["compression"]) == ("lz4", f"{path}:5")
    # GPUPOOL_SERVER keeps a file entry's own compression; a new address takes the top level's.
    cfg, _ = load(env_for(path, GPUPOOL_SERVER="far:2,new:3"))
    assert [s.compression for s in cfg.servers] == ["lz4", "off"]
    assert cfg.servers[0].sources["compression"] == f"{path}:5"
    # Refused values name the file, the line and the server; blank in the environment is unset.
    bad = write(tmp_path, '[[servers]]\ncompression = "zstd"\naddress = "far:2"\n', "bad.toml")
    with pytest.raises(cc.ConfigError) as info:
        load(env_for(bad))
    assert str(info.value) == (f'{bad}:2: server far:2: compression = "zstd" is not supported: '
                               'write "off" or "lz4", or leave it out for the top-level '
                               "compression")
    cfg, _ = load(env_for(path, GPUPOOL_COMPRESSION="  "))
    assert [s.compression for s in cfg.servers] == ["off", "lz4"]


def test_gpupool_config_shows_each_servers_compression(tmp_path: Path) -> None:
    path = write(tmp_path, PER_SERVER)
    env = {**os.environ, "GPUPOOL_CONFIG": str(path), "PYTHONPATH": str(REPO / "client")}
    for name in ("GPUPOOL_SERVER", "GPUPOOL_COMPRESSION"):
        env.pop(name, None)

    def rows() -> list[list[str]]:
        proc = subprocess.run([sys.executable, "-m", "gpupool", "config"], capture_output=True,
                              text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [line.split() for line in proc.stdout.splitlines()
                if line.split()[:1] == ["compression"]]

    # The top level's row first, then one per server.
    assert rows() == [["compression", "lz4", f"{path}:1"], ["compression", "off", f"{path}:4"],
                      ["compression", "lz4", f"{path}:1"], ["compression", "lz4", f"{path}:1"]]
    env["GPUPOOL_COMPRESSION"] = "off"
    assert rows() == [["compression", "off", "GPUPOOL_COMPRESSION"]] * 4


@pytest.mark.parametrize(("name", "value", "what"), [
    ("GPUPOOL_TLS", "maybe", "GPUPOOL_TLS=maybe is not understood"),
    ("GPUPOOL_MIN_MEMORY", "40X", "GPUPOOL_MIN_MEMORY=40X is not a size"),
    ("GPUPOOL_CONNECT_TIMEOUT", "soon", "GPUPOOL_CONNECT_TIMEOUT=soon is not a number"),
    ("GPUPOOL_SERVER", "a:b", "GPUPOOL_SERVER: 'a:b' is not a server address: write host:port, "
                              "[v6]:port, host (port 7070) or tls://host:port, separated by "
                              "commas"),
    ("GPUPOOL_SERVER", " , ", "GPUPOOL_SERVER=',' names no server: set "
                              "GPUPOOL_SERVER=host:port"),
    ("GPUPOOL_TLS_CERT", "/c.pem", "server a:1: tls_cert is set but tls_key is not"),
    ("GPUPOOL_CONNECT_TIMEOUT", "+5", "GPUPOOL_CONNECT_TIMEOUT=+5 is not a number of seconds"),
    ("GPUPOOL_PROBE_TIMEOUT", "1_0", "GPUPOOL_PROBE_TIMEOUT=1_0 is not a number of seconds"),
    ("GPUPOOL_PROBE_TIMEOUT", "inf", "GPUPOOL_PROBE_TIMEOUT=inf is not a number of seconds"),
    ("GPUPOOL_PROBE_TIMEOUT", "nan", "GPUPOOL_PROBE_TIMEOUT=nan is not a number of seconds"),
    ("GPUPOOL_SERVER", "h:0", "GPUPOOL_SERVER: 'h:0' is not a server address"),
])
def test_bad_environment_values(name: str, value: str, what: str) -> None:
    with pytest.raises(cc.ConfigError, match=re.escape(what)):
        load(env_for(None, **{"GPUPOOL_SERVER": "a:1", name: value}))


def test_at_most_16_servers() -> None:
    many = ",".join(f"h{i}:1" for i in range(17))
    with pytest.raises(cc.ConfigError, match="GPUPOOL_SERVER names more than 16 servers; keep "
                       "the 16 you prefer"):
        load(env_for(None, GPUPOOL_SERVER=many))


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("123", 123), ("40G", 40 * 10**9), ("40GB", 40 * 10**9), ("40gib", 40 << 30),
    ("1.5T", 1500 * 10**9), ("512 MiB", 512 << 20), (" 2k ", 2000), ("0.5KiB", 512),
    ("40X", None), ("-1", None), ("1.G", None), ("G", None), ("1e3", None),
    ("18446744073709551616", None), ("", 0),  # past 2^64; blank: unset
])
def test_sizes_as_the_shim_reads_them(text: str, value: int | None) -> None:
    env = env_for(None, GPUPOOL_MIN_MEMORY=text)
    if value is None:
        with pytest.raises(cc.ConfigError, match=re.escape(f"GPUPOOL_MIN_MEMORY={text.strip()} "
                                                           "is not a size: write bytes")):
            load(env)
    else:
        cfg, _ = load(env)
        assert cfg.min_memory == value
        assert cfg.sources.get("min_memory") == ("GPUPOOL_MIN_MEMORY" if text else None)


@pytest.mark.parametrize(("text", "parts"), [
    ("h", ("h", "h", "7070", False)), ("h:1", ("h:1", "h", "1", False)),
    ("tls://h:2", ("h:2", "h", "2", True)), ("[fe80::1]:3", ("[fe80::1]:3", "fe80::1", "3", False)),
])
def test_addresses(text: str, parts: tuple[str, str, str, bool]) -> None:
    assert cc.split_address(text) == parts


@pytest.mark.parametrize("text", ["", "h:", ":1", "h:0", "h:x", "[::1]", "http://h:1", "a b:1"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError):
        cc.split_address(text)


# ------------------------------------------------------------------------------ writing
def test_written_files_read_back_the_same(tmp_path: Path) -> None:
    data = {"token": 'q"uote\\back é', "tls_ca": "new\nline\ttab\x01ctl", "tls": True,
            "connect_timeout": 2.5, "probe_timeout": 3, "requirements": {"model": "A100", "min_memory": "40GiB"},
            "servers": [{"address": "tls://h:1", "token": "t1"}, {"address": "g"}]}
    path = tmp_path / "sub" / "config.toml"
    cc.write_file(path, data)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert "\\u0001" in path.read_text()
    # Written faithfully, but no setting may hold a control character: refused as the shims do.
    for read in (lambda: load(env_for(path)), lambda: cc.read_file(path)):
        with pytest.raises(cc.ConfigError, match=r"config.toml:4: tls_ca contains a control"):
            read()
    del data["tls_ca"]
    cc.write_file(path, data)
    back, _ = cc.read_file(path)  # also checks the subset
    assert back == data
    cfg, _ = load(env_for(path))
    assert cfg.servers[0].token == "t1" and cfg.servers[1].token == data["token"]


def test_gpupool_config_shows_each_source(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    env = {**os.environ, "GPUPOOL_CONFIG": str(path), "GPUPOOL_PROBE_TIMEOUT": "7",
           "PYTHONPATH": str(REPO / "client")}
    for name in ("GPUPOOL_SERVER", "GPUPOOL_TOKEN", "GPUPOOL_TLS", "GPUPOOL_GPU_MODEL"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "gpupool", "config"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"config file: {path} (from GPUPOOL_CONFIG)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["probe_timeout"].split()[1:] == ["7", "s", "GPUPOOL_PROBE_TIMEOUT"]
    assert lines["connect_timeout"].split()[1:] == ["10", "s", f"{path}:5"]
    assert lines["requirements.model"].split()[1:] == ["H100", f"{path}:10"]
    assert "1. gpu1.example.com:7070" in out and "2. tls://gpu2.example.com:7071" in out
    assert "gpt_one" not in out and "gpt_default" not in out  # tokens are never printed
    assert "tls:// in the address" in out
    bad = write(tmp_path, "x = {}\n", "bad.toml")
    proc = subprocess.run([sys.executable, "-m", "gpupool", "config"], capture_output=True,
                          text=True, env={**env, "GPUPOOL_CONFIG": str(bad)}, timeout=60)
    assert proc.returncode == 1 and f"{bad}:1: inline tables" in proc.stderr, proc.stderr


def test_writing_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    """A config.toml that is a symlink (dotfiles kept elsewhere) stays one: the target is
    rewritten, atomically, in the target's folder, with mode 0600."""
    target = tmp_path / "dotfiles" / "gpupool.toml"
    target.parent.mkdir()
    target.write_text('servers = ["old:1"]\n')
    target.chmod(0o644)
    link = tmp_path / "home" / ".config" / "gpupool" / "config.toml"
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    cc.write_file(link, {"token": "t", "servers": ["new:1"]})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.stat().st_mode & 0o777 == 0o600
    assert cc.read_file(link)[0] == {"token": "t", "servers": ["new:1"]}
    assert sorted(p.name for p in target.parent.iterdir()) == ["gpupool.toml"]  # no temp left
    assert sorted(p.name for p in link.parent.iterdir()) == ["config.toml"]
    # A link to a link: the final target.
    second = tmp_path / "second.toml"
    second.symlink_to(link)
    cc.write_file(second, {"servers": ["third:1"]})
    assert second.is_symlink() and link.is_symlink()
    assert cc.read_file(target)[0] == {"servers": ["third:1"]}


@pytest.mark.parametrize(("text", "value"), [
    ("10", 10.0), ("2.5", 2.5), ("0", 0.0), ("007.50", 7.5), ("+5", None), ("-1", None),
    ("1_0", None), ("1e3", None), (".5", None), ("5.", None), ("inf", None), ("nan", None),
    ("0x10", None), ("١", None), (" 5\t", 5.0), ("", 10.0),  # blanks stripped; blank: unset
])
def test_seconds_as_the_shim_reads_them(text: str, value: float | None) -> None:
    env = env_for(None, GPUPOOL_CONNECT_TIMEOUT=text)
    if value is None:
        with pytest.raises(cc.ConfigError, match="GPUPOOL_CONNECT_TIMEOUT=.* is not a number of "
                                                 "seconds"):
            load(env)
    else:
        cfg, _ = load(env)
        assert cfg.connect_timeout == value


def test_empty_strings_are_unset_and_values_are_stripped(tmp_path: Path) -> None:
    path = write(tmp_path, 'token = " gpt_d "\ntls_ca = "ca.pem"\n[requirements]\ngpu = 2\n'
                           '[[servers]]\naddress = " a:1 "\ntoken = ""\ntls_ca = "  "\n')
    cfg, _ = load(env_for(path, GPUPOOL_TOKEN=" ", GPUPOOL_GPU_MODEL=" A100\t"))
    (srv,) = cfg.servers
    assert (srv.address, srv.token, srv.tls_ca) == ("a:1", "gpt_d",
                                                    f"{os.path.realpath(tmp_path)}/ca.pem")
    assert srv.sources["token"] == f"{path}:1"  # the default's line: the entry's "" is unset
    assert (cfg.gpu, cfg.model) == ("2", "A100")
