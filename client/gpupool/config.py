"""The client configuration: one file (a TOML subset) plus GPUPOOL_* environment variables,
read by the shims' own reader (client/common/client_config.c; docs/client-configuration.md)
through libgpupool-config.so (client/config/binding.c), so that `gpupool config`, `status`,
`doctor` and `login` see exactly what a program run with `gpupool run` sees: one reader, not two
kept equal. This module turns its answers into data classes, and writes the file for
`gpupool login`.

- The file: $GPUPOOL_CONFIG when set (it must exist; "none" reads no file; "~/" is the home
  folder), else ${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml when it exists, else
  /etc/gpupool/config.toml when it exists, else none. One file only, never merged.
- The subset, the values and the environment's overrides: client_config.c's opening comment.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool.shim import CONFIG_LIB_NAME, ShimNotFound, config_library

DEFAULT_PORT = "7070"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_PROBE_TIMEOUT = 2.0  # also what probe_timeout = 0 means for a probe (never forever)
SYSTEM_FILE = Path("/etc/gpupool/config.toml")
PATH_KEYS = ("tls_ca", "tls_cert", "tls_key")
BLANKS = " \t\n\r\f\v"  # stripped from both ends of every value
ERROR_CAP = 16384
VALUE_CAP = 8448  # the longest setting the reader keeps (file_reason), with room


class ConfigError(Exception):
    """A configuration that cannot be used: one line, saying what, where and what to do."""


@dataclass
class ServerConfig:
    """One server after every override (the C struct gp_server_config)."""

    address: str  # as written, without tls://
    host: str
    port: str
    tls: bool = True  # TLS unless the configuration says tls = false (GPUPOOL_TLS=0)
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_prefix: bool = False  # written tls://... (TLS whatever else says)
    tls_fingerprint: str = ""  # the pinned identity, "SHA256:..." ("" none)
    compression: str = "off"  # GPUPOOL_COMPRESSION, else its own, else the top level's
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from

    @property
    def written(self) -> str:
        """The address as the user wrote it (tls:// only where written so: TLS is the
        default)."""
        return f"tls://{self.address}" if self.tls_prefix else self.address

    @property
    def key(self) -> tuple[str, str]:
        """(host, port) as the reader compares them: the host's ASCII letters in any case."""
        return (_ascii_lower(self.host), self.port)


@dataclass
class ClientConfig:
    """The effective client settings (the C struct gp_client_config) and where each came from."""

    servers: list[ServerConfig] = field(default_factory=list)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    gpu: str = ""
    model: str = ""
    min_memory: int = 0
    gpus: int = 1  # how many GPUs the process takes, all or nothing
    memory: int = 0  # bytes of a shared GPU to ask for; 0: a whole GPU
    spread: bool = False  # gpus > 1 may come from several servers of a fleet (issue 37)
    spread_copy: str = "auto"  # peer copies between a spread lease's servers: auto|server|client
    keep_gpu: bool = False  # the server never detaches this process's idle lease
    compression: str = "off"  # top level (or GPUPOOL_COMPRESSION): the servers' default
    file: str = ""  # the file read, "" for none
    file_reason: str = ""  # why that file (or why none)
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the file's content, as written


def _ascii_lower(text: str) -> str:
    return "".join(c.lower() if "A" <= c <= "Z" else c for c in text)


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# ------------------------------------------------------------------------------ the library
_WARN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_VISIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)
# enum gp_config_visit (client_config.h)
(VISIT_TABLE, VISIT_ARRAY_TABLE, VISIT_STRING, VISIT_INTEGER, VISIT_FLOAT, VISIT_BOOL,
 VISIT_ARRAY, VISIT_ITEM) = range(1, 9)
_libraries: dict[str, ctypes.CDLL] = {}


def _library() -> ctypes.CDLL:
    """libgpupool-config.so (gpupool.shim.config_library)."""
    try:
        path = str(config_library())
    except ShimNotFound as exc:
        raise ConfigError(f"cannot read the configuration: {exc}") from None
    lib = _libraries.get(path)
    if lib is not None:
        return lib
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration: {CONFIG_LIB_NAME} does not load "
                          f"({exc}); reinstall the gpupool package or set GPUPOOL_SHIM_DIR to "
                          "a folder with gpupool's libraries") from None
    lib.gpupool_config_load.restype = ctypes.c_void_p
    lib.gpupool_config_load.argtypes = [ctypes.POINTER(ctypes.c_char_p), _WARN, _VISIT,
                                        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.gpupool_config_free.argtypes = [ctypes.c_void_p]
    lib.gpupool_config_free.restype = None
    lib.gpupool_config_servers.argtypes = [ctypes.c_void_p]
    lib.gpupool_config_get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                       ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                       ctypes.c_size_t]
    lib.gpupool_config_split_address.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                 ctypes.c_size_t, ctypes.c_char_p,
                                                 ctypes.c_size_t, ctypes.c_char_p,
                                                 ctypes.c_size_t]
    # The trust rules of the shims (client/common/tls.c), for the command's own connections.
    lib.gpupool_config_trust.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                         ctypes.c_size_t]
    lib.gpupool_fingerprint_of_cert.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.c_char_p, ctypes.c_size_t]
    lib.gpupool_check_pin.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    _libraries[path] = lib
    return lib


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "surrogateescape")


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class _Document:
    """The file's tables and values as written (what `gpupool login` rewrites), built from the
    reader's visits in file order."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.table: dict[str, Any] = self.data
        self.failure: BaseException | None = None  # raised after the C call returns

    def visit(self, kind: int, key: str, text: str) -> None:
        data = self.data
        if kind in (VISIT_TABLE, VISIT_ARRAY_TABLE):
            key = text  # the table's name
        if kind == VISIT_TABLE:
            if key not in data:
                data[key] = {}
            # A table named like an earlier key: its values are not kept.
            self.table = data[key] if isinstance(data[key], dict) else {}
        elif kind == VISIT_ARRAY_TABLE:
            entries = data.setdefault(key, [])
            if isinstance(entries, list):
                entries.append({})
                self.table = entries[-1]
            else:
                self.table = {}
        elif kind == VISIT_STRING:
            self.table[key] = text
        elif kind == VISIT_INTEGER:
            self.table[key] = int(text)
        elif kind == VISIT_FLOAT:
            self.table[key] = float(text)
        elif kind == VISIT_BOOL:
            self.table[key] = text == "true"
        elif kind == VISIT_ARRAY:
            self.table[key] = []
        elif kind == VISIT_ITEM:
            self.table[key].append(text)


def _envp(env: Mapping[str, str]) -> Any:
    items = [_bytes(f"{k}={v}") for k, v in env.items() if "=" not in k and "\0" not in k + v]
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def _read(env: Mapping[str, str], warnings: list[str], doc: _Document | None,
          ) -> tuple[ctypes.CDLL, int]:
    """The reader's configuration (a pointer to free with gpupool_config_free)."""
    lib = _library()

    def on_warn(_ctx: Any, line: bytes | None) -> None:
        warnings.append(_text(line))

    def on_visit(_ctx: Any, kind: int, key: bytes | None, text: bytes | None) -> None:
        if doc is None or doc.failure is not None:
            return
        try:
            doc.visit(kind, _text(key), _text(text))
        except Exception as exc:  # noqa: BLE001 - a ctypes callback cannot raise: kept for later
            doc.failure = exc

    err = ctypes.create_string_buffer(ERROR_CAP)
    warn_cb, visit_cb = _WARN(on_warn), _VISIT(on_visit)  # alive until the call returns
    cfg = lib.gpupool_config_load(_envp(env), warn_cb, visit_cb, _bytes(str(SYSTEM_FILE)), err,
                                  ERROR_CAP)
    if doc is not None and doc.failure is not None:
        if cfg:
            lib.gpupool_config_free(cfg)
        raise doc.failure
    if not cfg:
        raise ConfigError(_text(err.value))
    return lib, cfg


def _get(lib: ctypes.CDLL, cfg: int, server: int, key: str) -> tuple[str, str]:
    out = ctypes.create_string_buffer(VALUE_CAP)
    src = ctypes.create_string_buffer(VALUE_CAP)
    if lib.gpupool_config_get(cfg, server, key.encode(), out, VALUE_CAP, src, VALUE_CAP) != 0:
        raise AssertionError(f"libgpupool-config.so has no setting {key!r}")  # a bug of ours
    return _text(out.value), _text(src.value)


def _settings(lib: ctypes.CDLL, cfg: int) -> ClientConfig:
    out = ClientConfig()

    def top(key: str) -> str:
        value, source = _get(lib, cfg, -1, key)
        if source:
            out.sources[key] = source
        return value

    out.file, out.file_reason = top("file"), top("file_reason")
    out.connect_timeout = float(top("connect_timeout"))
    out.probe_timeout = float(top("probe_timeout"))
    out.compression = top("compression")
    out.gpu, out.model = top("gpu"), top("model")
    out.min_memory = int(top("min_memory"))
    out.gpus, out.memory = int(top("gpus")), int(top("memory"))
    out.keep_gpu = top("keep_gpu") == "1"
    out.spread = top("spread") == "1"
    out.spread_copy = top("spread_copy")
    top("servers")
    for i in range(lib.gpupool_config_servers(cfg)):
        srv = ServerConfig(address="", host="", port="")
        for key in ("address", "host", "port", "token", *PATH_KEYS, "compression", "tls",
                    "tls_prefix", "tls_fingerprint"):
            value, source = _get(lib, cfg, i, key)
            setattr(srv, key, value == "1" if key in ("tls", "tls_prefix") else value)
            if source:
                srv.sources[key] = source
        out.servers.append(srv)
    return out


def load(env: Mapping[str, str] | None = None,
         warn: Callable[[str], None] | None = None) -> ClientConfig:
    """The effective configuration. ConfigError (one line) when it cannot be used; warnings go
    to `warn` (default: stderr, "gpupool: ..."), and are also kept in .warnings."""
    env = os.environ if env is None else env
    warnings: list[str] = []
    doc = _Document()
    try:
        lib, cfg = _read(env, warnings, doc)
    finally:  # what was warned about before an error is said too, as the shims say it
        for msg in warnings:
            if warn is None:
                print(f"gpupool: {msg}", file=sys.stderr)
            else:
                warn(msg)
    try:
        out = _settings(lib, cfg)
    finally:
        lib.gpupool_config_free(cfg)
    out.data = doc.data
    out.warnings = warnings
    return out


def read_file(path: Path) -> tuple[dict[str, Any], str]:
    """The content of a config file (checked as the shims check it) as written, and its text."""
    env = {"GPUPOOL_CONFIG": str(path)}
    home = os.environ.get("HOME")
    if home:
        env["HOME"] = home  # "~/" in its paths
    doc = _Document()
    lib, cfg = _read(env, [], doc)
    lib.gpupool_config_free(cfg)
    return doc.data, Path(path).read_text(encoding="utf-8", errors="surrogateescape")


def split_address(text: str) -> tuple[str, str, str, bool]:
    """("host:port" as written without tls://, host, port, tls://) of a server address as the
    reader takes it: host, host:port, [v6]:port, tls://host:port. ValueError when it is not
    one."""
    address, host, port = (ctypes.create_string_buffer(512) for _ in range(3))
    rc = _library().gpupool_config_split_address(_bytes(text), address, 512, host, 512, port,
                                                 512)
    if rc < 0:
        raise ValueError(f"{text.strip(BLANKS)!r} is not a server address (host, host:port, "
                         "[v6]:port or tls://host:port, the port from 1 to 65535)")
    return _text(address.value), _text(host.value), _text(port.value), rc == 1


# ------------------------------------------------------------------------------ trust
FINGERPRINT_CAP = 64  # "SHA256:" + 43 base64 characters, and the NUL


def server_desc(srv: ServerConfig) -> str:
    """"host:port" as the shims name a server in their messages (gp_server_desc)."""
    return srv.address if ":" in srv.address else f"{srv.host}:{srv.port}"


def _one_server(srv: ServerConfig) -> dict[str, str]:
    """The environment block that makes the reader see `srv` alone, with its trust settings:
    how a ServerConfig built here (or by `gpupool login`) is judged by the C rules."""
    env = {"GPUPOOL_CONFIG": "none", "GPUPOOL_SERVER": srv.written,
           "GPUPOOL_TLS": "1" if srv.tls else "0"}
    if srv.tls_fingerprint:
        env["GPUPOOL_TLS_FINGERPRINT"] = srv.tls_fingerprint
    if srv.tls_ca:
        env["GPUPOOL_TLS_CA"] = srv.tls_ca
    return env


def trust_problem(srv: ServerConfig) -> str:
    """"" when `srv` may be sent a token (plain TCP by choice, or TLS with a pin or a CA), else
    the shims' one line (gp_tls_trusted: what, and the command that fixes it). The rule is the
    C one, asked through libgpupool-config.so, so the command and programs never disagree.
    ConfigError when the settings themselves are not valid (a malformed pin)."""
    lib, cfg = _read(_one_server(srv), [], None)
    try:
        err = ctypes.create_string_buffer(ERROR_CAP)
        if lib.gpupool_config_trust(cfg, 0, err, ERROR_CAP) == 0:
            return ""
        return _text(err.value)
    finally:
        lib.gpupool_config_free(cfg)


def check_fingerprint(text: str) -> str:
    """`text` (stripped) when it is a fingerprint as `gpupoold fingerprint` prints it, by the
    reader's own rule (gp_fingerprint_valid); ConfigError otherwise."""
    value = text.strip(BLANKS)
    try:
        if not value:  # the reader takes an empty variable as unset: no fingerprint either
            raise ConfigError(value)
        lib, cfg = _read({"GPUPOOL_CONFIG": "none", "GPUPOOL_TLS_FINGERPRINT": value}, [], None)
    except ConfigError:
        raise ConfigError(f"{value[:100]!r} is not a fingerprint: give what `gpupoold "
                          "fingerprint` prints on the server, \"SHA256:\" and 43 base64 "
                          "characters") from None
    lib.gpupool_config_free(cfg)
    return value


def fingerprint_of_cert(der: bytes) -> str:
    """"SHA256:..." of a DER certificate's public key, as the shims compute it. ConfigError
    when it is not a certificate."""
    out = ctypes.create_string_buffer(FINGERPRINT_CAP)
    err = ctypes.create_string_buffer(ERROR_CAP)
    if _library().gpupool_fingerprint_of_cert(der, len(der), out, FINGERPRINT_CAP, err,
                                              ERROR_CAP) != 0:
        raise ConfigError(_text(err.value))
    return _text(out.value)


def check_pin(der: bytes, expected: str, desc: str) -> str:
    """"" when the DER certificate's key is the pinned `expected`, else the shims' loud
    "identity has changed" message for server `desc` (host:port): one comparison, the C one."""
    err = ctypes.create_string_buffer(ERROR_CAP)
    if _library().gpupool_check_pin(der, len(der), _bytes(expected), _bytes(desc), err,
                                    ERROR_CAP) == 0:
        return ""
    return _text(err.value)


# ------------------------------------------------------------------------------ files
def home_folder(env: Mapping[str, str]) -> str:
    """$HOME, else the password database's home; "" when neither is known."""
    home = env.get("HOME") or ""
    if home:
        return home
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir or ""
    except KeyError:
        return ""


def expand_home(text: str, env: Mapping[str, str]) -> str:
    """"~" / "~/x" -> the home folder (/x), as the reader expands GPUPOOL_CONFIG. ConfigError
    when there is no home folder."""
    if text[:1] == "~" and (len(text) == 1 or text[1] == "/"):
        home = home_folder(env)
        if not home:
            raise ConfigError(f"{text}: ~ stands for the home folder, and HOME is not set")
        return home + text[1:]
    return text


def default_user_file(env: Mapping[str, str]) -> Path | None:
    """${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml, None without a home folder."""
    xdg = env.get("XDG_CONFIG_HOME") or ""
    if xdg:
        return Path(f"{xdg}/gpupool/config.toml")
    home = home_folder(env)
    return Path(f"{home}/.config/gpupool/config.toml") if home else None


# ------------------------------------------------------------------------------ writing
def _quote(value: str) -> str:
    out = []
    for c in value:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format_number(value)
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(_quote(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} in the config file's TOML subset")


def dumps(data: dict[str, Any]) -> str:
    """`data` (as read_file returns it) in the TOML subset, top-level keys first."""
    lines = ["# gpupool client configuration (docs/user-guide.md); written by `gpupool login`.",
             "# Keep it private (mode 0600): it holds tokens."]
    tables = {"requirements", "servers"}
    for key, value in data.items():
        if key in tables and isinstance(value, (dict, list)) and not (
                key == "servers" and value and all(isinstance(v, str) for v in value)):
            continue
        lines.append(f"{key} = {_value(value)}")
    req = data.get("requirements")
    if isinstance(req, dict) and req:
        lines += ["", "[requirements]"]
        lines += [f"{k} = {_value(v)}" for k, v in req.items()]
    servers = data.get("servers")
    if isinstance(servers, list) and servers and all(isinstance(s, dict) for s in servers):
        for entry in servers:
            lines += ["", "[[servers]]"]
            lines += [f"{k} = {_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def write_file(path: Path, data: dict[str, Any], mode: int = 0o600, dir_mode: int = 0o700,
               ) -> None:
    """Write `data` to `path` atomically (a temporary file in the same folder, fsync, then
    rename), the file with `mode` and a new folder with `dir_mode`. A symlinked config file
    stays a symlink: its target is what gets rewritten (in the target's folder)."""
    text = dumps(data)
    target = Path(os.path.realpath(path))
    target.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.chmod(target, mode)  # an existing file keeps no wider mode than asked
    try:  # the rename itself on disk (best effort: not every file system can sync a folder)
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
