"""The client configuration: one file (TOML) plus GPUPOOL_* environment variables.

The same rules as the shim's C reader (client/shim/client_config.c; docs/dev/issue5-contracts.md
section 3), so that `gpupool config`, `status` and `doctor` see what a program run with
`gpupool run` sees:

- The file: $GPUPOOL_CONFIG when set (it must exist; "none" reads no file), else
  ${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml when it exists, else
  /etc/gpupool/config.toml when it exists, else none. One file only, never merged.
- Only a subset of TOML, the one the C side reads and `gpupool login` writes: comments,
  `key = value` with basic or literal one-line strings (escapes \\" \\\\ \\n \\t \\uXXXX),
  integers, floats, booleans, arrays of strings, the tables [requirements] and [[servers]].
  Anything else is an error naming FILE:LINE; unknown keys get one warning each and are ignored.
- Environment variables override the file key by key; a variable set to "" counts as unset.
"""

from __future__ import annotations

import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on old interpreters only
    import tomli as tomllib

DEFAULT_PORT = "7070"
MAX_SERVERS = 16  # GP_MAX_SERVERS of the C side
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_PROBE_TIMEOUT = 2.0
SYSTEM_FILE = Path("/etc/gpupool/config.toml")
TOKEN_MAX = 4096
TEXT_MAX = 255
PATH_MAX = 4095

SUBSET = ("the gpupool configuration is a TOML subset: comments, key = value with \"strings\", "
          "'strings', integers, floats, true/false and arrays of strings, [requirements] and "
          "[[servers]]")

PATH_HOW = "a file path in quotes"
SIZE_HOW = ("write bytes or a number with a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB "
            "(40*2^30), 512M, 17179869184")
TOP_KEYS = ("token", "tls", "tls_ca", "tls_cert", "tls_key", "connect_timeout", "probe_timeout",
            "servers", "requirements")
REQUIREMENT_KEYS = ("gpu", "model", "min_memory")
SERVER_KEYS = ("address", "token", "tls", "tls_ca", "tls_cert", "tls_key")
PATH_KEYS = ("tls_ca", "tls_cert", "tls_key")
TRUE_WORDS = ("1", "yes", "true", "on")
FALSE_WORDS = ("0", "no", "false", "off")

# Units of min_memory / GPUPOOL_MIN_MEMORY, as the shim reads them (client/shim/requirements.c):
# the SI ones are decimal on purpose (GPUs are sold by decimal sizes).
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
              "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
              "tb": 10**12, "tib": 1 << 40}
SIZE_RE = re.compile(r"[ \t]*([0-9]+)(?:\.([0-9]+))?[ \t]*([A-Za-z]*)[ \t]*")


class ConfigError(Exception):
    """A configuration that cannot be used: one line, saying what, where and what to do."""


@dataclass
class ServerConfig:
    """One server after every override (the C struct gp_server_config)."""

    address: str  # as written, without tls://
    host: str
    port: str
    tls: bool = False
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_prefix: bool = False  # written tls://... (TLS whatever else says)
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from

    @property
    def written(self) -> str:
        """The address as a user writes it (tls:// when it has TLS)."""
        return f"tls://{self.address}" if self.tls else self.address

    @property
    def key(self) -> tuple[str, str]:
        return (self.host.lower(), self.port)


@dataclass
class ClientConfig:
    """The effective client settings (the C struct gp_client_config) and where each came from."""

    servers: list[ServerConfig] = field(default_factory=list)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    gpu: str = ""
    model: str = ""
    min_memory: int = 0
    file: str = ""  # the file read, "" for none
    file_reason: str = ""  # why that file (or why none)
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the file's content, as parsed
    file_defaults: ServerConfig | None = None  # the file's top-level token / TLS settings


# ------------------------------------------------------------------------------ small parsers
def parse_size(text: str) -> int | None:
    """Bytes of "40GiB", "80G", "1.5T", "123": as the shim reads GPUPOOL_MIN_MEMORY. None when it
    is not a size."""
    m = SIZE_RE.fullmatch(text)
    if not m:
        return None
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3).lower()
    if unit not in SIZE_UNITS:
        return None
    mult = SIZE_UNITS[unit]
    frac = frac[:6]  # digits past the sixth cannot matter
    value = int(whole) * mult + (int(frac) * mult // 10 ** len(frac) if frac else 0)
    return value if value < 1 << 64 else None


def parse_bool_word(text: str) -> bool | None:
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


def split_address(text: str) -> tuple[str, str, str, bool]:
    """("host:port" as written without tls://, host, port, tls://) of a server address:
    host, host:port, [v6]:port, tls://host:port. ValueError says what is wrong."""
    s = text.strip()
    prefix = False
    if s.lower().startswith("tls://"):
        prefix = True
        s = s[len("tls://"):]
    if "://" in s:
        raise ValueError(f"server address {text!r}: only tls:// may come before host:port")
    if not s:
        raise ValueError(f"server address {text!r} is empty")
    if ":" not in s and not s.startswith("["):
        host, port = s, DEFAULT_PORT
    elif s.startswith("["):
        close = s.find("]")
        if close < 0 or s[close + 1:close + 2] != ":" or not s[close + 2:]:
            raise ValueError(f"server address {text!r}: write an IPv6 address as [addr]:port")
        host, port = s[1:close], s[close + 2:]
    else:
        host, _, port = s.rpartition(":")
    if not host or not port:
        raise ValueError(f"server address {text!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"server address {text!r}: the port must be a number from 1 to 65535")
    if len(host) > 255 or any(c.isspace() or ord(c) < 0x20 for c in host):
        raise ValueError(f"server address {text!r}: not a host name or address")
    return s, host, port, prefix


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# --------------------------------------------------------------------- the TOML subset check
class _Scan:
    """Checks that a file stays inside the TOML subset the C side reads (tomllib accepts more),
    with the C reader's rules and messages (client/shim/client_config.c). Raises ConfigError
    naming FILE:LINE. Also records the lines of unknown tables (`unknown_tables`)."""

    NUMBER = re.compile(r"[+-]?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?(?=[ \t\r\n#,\]]|$)")

    def __init__(self, text: str, file: str) -> None:
        self.s = text[1:] if text.startswith("\ufeff") else text
        self.i = 0
        self.line = 1
        self.file = file
        self.unknown_tables: dict[str, tuple[int, bool]] = {}  # name -> (line, [[name]])

    def fail(self, what: str, line: int | None = None) -> ConfigError:
        return ConfigError(f"{self.file}:{line or self.line}: {what}")

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def snippet(self) -> str:
        return self.s[self.i:].split("\n", 1)[0][:20]

    def skip_blank(self) -> None:
        while self.peek() in (" ", "\t"):
            self.i += 1

    def skip_array_space(self) -> None:
        while True:
            c = self.peek()
            if c in (" ", "\t", "\r"):
                self.i += 1
            elif c == "\n":
                self.i += 1
                self.line += 1
            elif c == "#":
                while self.peek() not in ("", "\n"):
                    self.i += 1
            else:
                return

    def end_of_line(self, after: str) -> None:
        self.skip_blank()
        if self.peek() == "#":
            while self.peek() not in ("", "\n"):
                self.i += 1
        if self.peek() == "\r" and self.peek(1) == "\n":
            self.i += 1
        if not self.peek():
            return
        if self.peek() != "\n":
            raise self.fail(f"unexpected text after {after}: '{self.snippet()}'; {SUBSET}")
        self.i += 1
        self.line += 1

    def string(self) -> None:
        q = self.peek()
        if self.peek(1) == q and self.peek(2) == q:
            raise self.fail(f"multi-line strings ({q * 3}) are not supported; write the value "
                            "on one line")
        self.i += 1
        while True:
            c = self.peek()
            if c in ("", "\n", "\r"):
                raise self.fail(f"this string has no closing {q} on its line")
            if c == q:
                self.i += 1
                return
            if (ord(c) < 0x20 and c != "\t") or c == "\x7f":
                raise self.fail("a control character inside a string; write it as an escape "
                                "(\\n, \\t, \\uXXXX)")
            if c == "\\" and q == '"':
                e = self.peek(1)
                self.i += 2
                if e in ('"', "\\", "n", "t"):
                    continue
                if e == "u":
                    digits = self.s[self.i:self.i + 4]
                    if not re.fullmatch(r"[0-9A-Fa-f]{4}", digits):
                        raise self.fail("\\u needs four hex digits (\\u00e9)")
                    cp = int(digits, 16)
                    if cp == 0 or 0xD800 <= cp <= 0xDFFF:
                        raise self.fail(f"\\u{cp:04x} is not a character a value may hold")
                    self.i += 4
                    continue
                shown = e if " " <= e < "\x7f" else "?"
                raise self.fail(f"unsupported escape \\{shown}; the supported escapes are \\\" "
                                "\\\\ \\n \\t \\uXXXX (or use a 'literal string')")
            self.i += 1

    def value(self, key: str) -> str:
        """Skips a value; its kind: "str", "array", "bool", "number"."""
        self.skip_blank()
        c = self.peek()
        if c in ("", "\n", "\r", "#"):
            raise self.fail(f"{key} has no value; write {key} = \"...\"")
        if c in ('"', "'"):
            self.string()
            return "str"
        if c == "[":
            self.i += 1
            while True:
                self.skip_array_space()
                c = self.peek()
                if not c:
                    raise self.fail(f"the array of {key} has no closing ]")
                if c == "]":
                    self.i += 1
                    return "array"
                if c not in ('"', "'"):
                    raise self.fail(f"the array of {key} may only hold strings; {SUBSET}")
                self.string()
                self.skip_array_space()
                if self.peek() == ",":
                    self.i += 1
                elif self.peek() != "]":
                    raise self.fail(f"expected , or ] in the array of {key}")
        for word in ("true", "false"):
            if self.s.startswith(word, self.i) and self.peek(len(word)) in (
                    "", " ", "\t", "\r", "\n", "#"):
                self.i += len(word)
                return "bool"
        if c == "{":
            raise self.fail(f"inline tables ({{...}}) are not supported; {SUBSET}")
        m = self.NUMBER.match(self.s, self.i)
        if m:
            self.i = m.end()
            return "number"
        raise self.fail(f"cannot read the value of {key} (strings need quotes: {key} = "
                        "\"...\"; dates, hex numbers, inf and nan are not supported); "
                        f"{SUBSET}")

    def header(self, state: dict[str, Any]) -> str:
        dbl = self.peek(1) == "["
        self.i += 2 if dbl else 1
        self.skip_blank()
        m = re.compile(r"[A-Za-z0-9_-]*").match(self.s, self.i)
        name = m.group(0) if m else ""
        self.i += len(name)
        self.skip_blank()
        if not name or self.peek() in ("", ".", '"', "'"):
            raise self.fail(f"unsupported table header (quoted or dotted names); {SUBSET}")
        if self.peek() != "]" or (dbl and self.peek(1) != "]"):
            raise self.fail(f"this table header has no closing {']]' if dbl else ']'}")
        self.i += 2 if dbl else 1
        line = self.line
        self.end_of_line("the table header")
        if name == "requirements":
            if dbl:
                raise self.fail("[[requirements]] is not supported: write [requirements] (one "
                                "table)", line)
            if state.get("requirements"):
                raise self.fail("[requirements] appears twice; merge the two tables", line)
            state["requirements"] = line
            return "requirements"
        if name == "servers":
            if not dbl:
                raise self.fail("[servers] is not supported: write [[servers]] before each "
                                "server's address = \"...\" (or servers = [\"a:7070\", "
                                "\"b:7070\"] at the top)", line)
            if state.get("short_form"):
                raise self.fail(f"[[servers]] together with servers = [...] (line "
                                f"{state['short_form']}): use one form", line)
            state["tables"] = state.get("tables", 0) + 1
            if state["tables"] > MAX_SERVERS:
                raise self.fail(f"more than {MAX_SERVERS} servers; keep the {MAX_SERVERS} you "
                                "prefer", line)
            return "servers"
        self.unknown_tables.setdefault(name, (line, dbl))
        return "unknown"

    def run(self) -> None:
        section, seen, state = "top", set(), {}  # type: ignore[var-annotated]
        while True:
            self.skip_blank()
            c = self.peek()
            if not c:
                return
            if c in ("\n", "\r", "#"):
                self.end_of_line("the comment")
                continue
            if c == "[":
                section, seen = self.header(state), set()
                continue
            if c in ('"', "'"):
                raise self.fail(f"quoted keys are not supported; write the key bare (token = "
                                f"\"...\"); {SUBSET}")
            m = re.compile(r"[A-Za-z0-9_-]+").match(self.s, self.i)
            if not m:
                raise self.fail(f"expected key = value, a [table] or a comment, not "
                                f"'{self.snippet()}'; {SUBSET}")
            key = m.group(0)
            self.i = m.end()
            self.skip_blank()
            if self.peek() == ".":
                raise self.fail(f"dotted keys ({key}.x = ...) are not supported; {SUBSET}")
            if self.peek() != "=":
                raise self.fail(f"expected = after {key} (key = value)")
            self.i += 1
            line = self.line
            kind = self.value(key)
            if section != "unknown":
                if key in seen:
                    raise self.fail(f"{key} is set twice in the same table; keep one", line)
                seen.add(key)
            if section == "top" and key == "servers" and kind == "array":
                state["short_form"] = line
            self.end_of_line("the value")


def _line_of(text: str, key: str, after: int = 0) -> int:
    """The line where `key = ...` first appears at or after line `after` (1 when not found)."""
    rx = re.compile(rf"^[ \t]*(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')[ \t]*=",
                    re.M)
    for m in rx.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if line >= after:
            return line
    return max(after, 1)


def _header_lines(text: str, header: str) -> list[int]:
    rx = re.compile(r"^[ \t]*\[\[[ \t]*servers[ \t]*\]\]" if header == "servers"
                    else r"^[ \t]*\[[ \t]*requirements[ \t]*\]", re.M)
    return [text.count("\n", 0, m.start()) + 1 for m in rx.finditer(text)]


# ------------------------------------------------------------------------------ the file
def default_user_file(env: Mapping[str, str]) -> Path | None:
    xdg = env.get("XDG_CONFIG_HOME") or ""
    if xdg:
        return Path(xdg) / "gpupool" / "config.toml"
    home = env.get("HOME") or ""
    if not home:
        try:
            home = str(Path.home())
        except RuntimeError:
            return None
    return Path(home) / ".config" / "gpupool" / "config.toml"


def find_file(env: Mapping[str, str]) -> tuple[Path | None, str]:
    """The file to read and why (or None and why none)."""
    explicit = env.get("GPUPOOL_CONFIG") or ""
    if explicit:
        if explicit == "none":
            return None, "GPUPOOL_CONFIG=none: no file is read"
        path = Path(explicit).expanduser()
        if not path.is_file():
            why = "not a file" if path.exists() else "No such file or directory"
            raise ConfigError(f"GPUPOOL_CONFIG={explicit}: {why}; point it at the configuration "
                              "file, or set GPUPOOL_CONFIG=none to read none")
        return path, "from GPUPOOL_CONFIG"
    user = default_user_file(env)
    if user is not None and user.is_file():
        return user, "the user's file"
    if SYSTEM_FILE.is_file():
        return SYSTEM_FILE, "the system file (no user file at " + str(user) + ")"
    return None, f"no file ({user} and {SYSTEM_FILE} do not exist)"


def read_file(path: Path) -> tuple[dict[str, Any], str]:
    """The parsed content of a config file (checked against the subset) and its text."""
    data, text, _ = _parse(path)
    return data, text


def _parse(path: Path) -> tuple[dict[str, Any], str, dict[str, tuple[int, bool]]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}); fix its permissions or "
                          "set GPUPOOL_CONFIG to another file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: this text is not valid UTF-8; save the file as "
                          "UTF-8") from None
    scan = _Scan(text, str(path))
    scan.run()
    try:
        data = tomllib.loads(scan.s)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column \d+\)", msg)
        where = f"{path}:{m.group(1)}" if m else str(path)
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg) if m else msg
        raise ConfigError(f"{where}: {msg}; {SUBSET}") from None
    return data, scan.s, scan.unknown_tables


def _resolve_path(value: str, base: Path) -> str:
    if not value:
        return ""
    if value == "~" or value.startswith("~/"):
        return str(Path(value).expanduser())
    p = Path(value)
    return str(p if p.is_absolute() else base / p)


class _FileReader:
    """Turns the parsed file into settings, with FILE:LINE in every complaint."""

    def __init__(self, path: Path, data: dict[str, Any], text: str,
                 warn: Callable[[str], None], tables: dict[str, tuple[int, bool]]) -> None:
        self.tables = tables  # unknown tables: warned about once, their keys ignored
        self.path = path
        self.data = data
        self.text = text
        self.warn = warn
        self.base = path.resolve().parent

    def err(self, key: str, what: str, after: int = 0) -> ConfigError:
        return ConfigError(f"{self.path}:{_line_of(self.text, key, after)}: {what}")

    def string(self, table: dict[str, Any], key: str, after: int = 0, limit: int = PATH_MAX,
               how: str = "a string") -> str:
        v = table.get(key, "")
        if not isinstance(v, str):
            raise self.err(key, f"{key} must be {how}", after)
        if len(v.encode()) > limit:
            raise self.err(key, f"{key} is longer than {limit} bytes", after)
        if any(ord(c) < 0x20 or c == "\x7f" for c in v):
            raise self.err(key, f"{key} contains a control character", after)
        return v.strip()

    def boolean(self, table: dict[str, Any], key: str, after: int = 0) -> bool:
        v = table.get(key)
        if not isinstance(v, bool):
            raise self.err(key, f"{key} must be true or false", after)
        return v

    def seconds(self, key: str) -> float:
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
            raise self.err(key, f"{key} must be a number of seconds, 0 or more (0: no limit), "
                           f"e.g. {key} = 10")
        return float(v)

    def unknown(self, table: dict[str, Any], section: str, after: int = 0) -> None:
        known, where = {
            "top": ("token, tls, tls_ca, tls_cert, tls_key, connect_timeout, probe_timeout, "
                    "servers", ""),
            "requirements": ("gpu, model, min_memory", " in [requirements]"),
            "servers": ("address, token, tls, tls_ca, tls_cert, tls_key", " in [[servers]]"),
        }[section]
        names = {"top": TOP_KEYS, "requirements": REQUIREMENT_KEYS, "servers": SERVER_KEYS}
        for key in table:
            if key in names[section] or (section == "top" and key in self.tables):
                continue
            line = _line_of(self.text, key, after)
            self.warn(f"{self.path}:{line}: unknown setting '{key}'{where} ignored (known "
                      f"there: {known})")


def _server_from_file(r: _FileReader, entry: dict[str, Any], line: int) -> ServerConfig:
    if "address" not in entry:
        raise ConfigError(f"{r.path}:{line}: this [[servers]] entry has no address; write "
                          "address = \"host:port\" under it")
    written = r.string(entry, "address", line, 511, "a server address in quotes (\"gpu1:7070\")")
    try:
        address, host, port, prefix = split_address(written)
    except ValueError:
        raise r.err("address", f"'{written}' is not a server address: write host, host:port, "
                    "[v6]:port or tls://host:port", line) from None
    srv = ServerConfig(address=address, host=host, port=port, tls_prefix=prefix)
    srv.sources["address"] = f"{r.path}:{_line_of(r.text, 'address', line)}"
    if "token" in entry:
        srv.token = r.string(entry, "token", line, TOKEN_MAX)
        srv.sources["token"] = f"{r.path}:{_line_of(r.text, 'token', line)}"
    if "tls" in entry:
        srv.tls = r.boolean(entry, "tls", line)
        srv.sources["tls"] = f"{r.path}:{_line_of(r.text, 'tls', line)}"
    for key in PATH_KEYS:
        if key in entry:
            setattr(srv, key, _resolve_path(r.string(entry, key, line, how=PATH_HOW), r.base))
            srv.sources[key] = f"{r.path}:{_line_of(r.text, key, line)}"
    r.unknown(entry, "servers", line)
    return srv


def _apply_file(cfg: ClientConfig, path: Path, warn: Callable[[str], None]) -> None:
    data, text, tables = _parse(path)
    cfg.data = data
    r = _FileReader(path, data, text, warn, tables)
    for name, (line, dbl) in tables.items():
        shown = f"[[{name}]]" if dbl else f"[{name}]"
        warn(f"{path}:{line}: unknown table {shown} ignored (known: [requirements], "
             "[[servers]])")
    src = str(path)
    defaults = ServerConfig(address="", host="", port="")
    if "token" in data:
        defaults.token = r.string(data, "token", limit=TOKEN_MAX)
        defaults.sources["token"] = f"{src}:{_line_of(text, 'token')}"
    if "tls" in data:
        defaults.tls = r.boolean(data, "tls")
        defaults.sources["tls"] = f"{src}:{_line_of(text, 'tls')}"
    for key in PATH_KEYS:
        if key in data:
            setattr(defaults, key, _resolve_path(r.string(data, key, how=PATH_HOW), r.base))
            defaults.sources[key] = f"{src}:{_line_of(text, key)}"
    for key in ("connect_timeout", "probe_timeout"):
        if key in data:
            setattr(cfg, key, r.seconds(key))
            cfg.sources[key] = f"{src}:{_line_of(text, key)}"
    req = data.get("requirements", {})
    if not isinstance(req, dict):
        raise r.err("requirements", "requirements must be the table [requirements]")
    req_line = (_header_lines(text, "requirements") or [0])[0]
    for key, how in (("gpu", "a GPU index (\"1\") or a GPU UUID (prefix) in quotes"),
                     ("model", "a part of the GPU name in quotes (\"H100\")")):
        if key in req:
            setattr(cfg, key, r.string(req, key, req_line, TEXT_MAX, how))
            cfg.sources[key] = f"{src}:{_line_of(text, key, req_line)}"
    if "min_memory" in req:
        v = req["min_memory"]
        size: int | None
        if isinstance(v, bool):
            size = None
        elif isinstance(v, int):
            size = v if 0 <= v < 1 << 64 else None
        elif isinstance(v, str):
            size = parse_size(v) if v.strip() else 0
        else:
            size = None
        if size is None and isinstance(v, str):
            raise r.err("min_memory", f"min_memory = \"{v}\" is not a size: {SIZE_HOW}",
                        req_line)
        if size is None:
            raise r.err("min_memory", "min_memory must be a size in quotes (\"40GiB\", \"80G\") "
                        "or bytes as a whole number", req_line)
        cfg.min_memory = size
        cfg.sources["min_memory"] = f"{src}:{_line_of(text, 'min_memory', req_line)}"
    r.unknown(req, "requirements", req_line)
    r.unknown(data, "top")

    servers = data.get("servers", [])
    if not isinstance(servers, list):
        raise r.err("servers", "servers must be an array of addresses, servers = "
                    "[\"gpu1:7070\", \"tls://gpu2:7070\"] (or one [[servers]] table per server)")
    found: list[ServerConfig] = []
    if servers and all(isinstance(s, str) for s in servers):
        line = _line_of(text, "servers")
        if len(servers) > MAX_SERVERS:
            raise ConfigError(f"{path}:{line}: more than {MAX_SERVERS} servers; keep the "
                              f"{MAX_SERVERS} you prefer")
        for s in servers:
            try:
                address, host, port, prefix = split_address(s)
            except ValueError:
                raise ConfigError(f"{path}:{line}: '{s}' is not a server address: write host, "
                                  "host:port, [v6]:port or tls://host:port") from None
            found.append(ServerConfig(address=address, host=host, port=port, tls_prefix=prefix,
                                      sources={"address": f"{src}:{line}"}))
    elif servers:
        if not all(isinstance(s, dict) for s in servers):
            raise r.err("servers", "use either servers = [\"host:port\", ...] or [[servers]] "
                        "tables, not both")
        lines = _header_lines(text, "servers")
        for n, entry in enumerate(servers):
            found.append(_server_from_file(r, entry, lines[n] if n < len(lines) else 1))
    for srv in found:
        _inherit(srv, defaults)
    cfg.servers = found
    cfg.file_defaults = defaults


def _inherit(srv: ServerConfig, defaults: ServerConfig) -> None:
    """Settings the entry does not set itself come from the file's top level."""
    for key in ("token", "tls", *PATH_KEYS):
        if key not in srv.sources and key in defaults.sources:
            setattr(srv, key, getattr(defaults, key))
            srv.sources[key] = defaults.sources[key]


# ------------------------------------------------------------------------ the environment
def _env(env: Mapping[str, str], name: str) -> str:
    return (env.get(name) or "").strip()


def _env_text(env: Mapping[str, str], name: str, limit: int) -> str:
    v = _env(env, name)
    if len(v.encode()) > limit:
        raise ConfigError(f"{name} is longer than {limit} bytes; is it the right value?")
    if any(ord(c) < 0x20 or c == "\x7f" for c in v):
        raise ConfigError(f"{name} contains a control character; set it to a plain value")
    return v


def _apply_env(cfg: ClientConfig, env: Mapping[str, str]) -> None:
    file_defaults = cfg.file_defaults or ServerConfig("", "", "")
    listed = _env(env, "GPUPOOL_SERVER")
    if listed:
        servers = []
        for item in listed.split(","):
            if not item.strip():
                continue
            if len(servers) >= MAX_SERVERS:
                raise ConfigError(f"GPUPOOL_SERVER names more than {MAX_SERVERS} servers; keep "
                                  f"the {MAX_SERVERS} you prefer")
            try:
                address, host, port, prefix = split_address(item)
            except ValueError:
                raise ConfigError(f"GPUPOOL_SERVER: '{item.strip()}' is not a server address: "
                                  f"write host:port, [v6]:port, host (port {DEFAULT_PORT}) or "
                                  "tls://host:port, separated by commas") from None
            srv = ServerConfig(address=address, host=host, port=port, tls_prefix=prefix,
                               sources={"address": "GPUPOOL_SERVER"})
            same = next((s for s in cfg.servers if s.key == srv.key), None)
            if same is not None:  # keeps that entry's token and TLS settings
                for key in ("token", "tls", *PATH_KEYS):
                    setattr(srv, key, getattr(same, key))
                    if key in same.sources:
                        srv.sources[key] = same.sources[key]
                srv.tls_prefix = srv.tls_prefix or same.tls_prefix
            else:
                _inherit(srv, file_defaults)
            servers.append(srv)
        if not servers:
            raise ConfigError(f"GPUPOOL_SERVER='{listed}' names no server: set "
                              "GPUPOOL_SERVER=host:port")
        cfg.servers = servers
        cfg.sources["servers"] = "GPUPOOL_SERVER"
    token = _env_text(env, "GPUPOOL_TOKEN", TOKEN_MAX)
    tls_word = _env(env, "GPUPOOL_TLS")
    tls: bool | None = None
    if tls_word:
        tls = parse_bool_word(tls_word)
        if tls is None:
            raise ConfigError(f"GPUPOOL_TLS={tls_word} is not understood: use 1 (TLS) or 0 "
                              "(plain TCP)")
    paths = {key: _env_text(env, f"GPUPOOL_{key.upper()}", PATH_MAX) for key in PATH_KEYS}
    for srv in cfg.servers:
        if token:
            srv.token = token
            srv.sources["token"] = "GPUPOOL_TOKEN"
        if tls is not None:
            srv.tls = tls
            srv.sources["tls"] = "GPUPOOL_TLS"
        for key, value in paths.items():
            if value:
                setattr(srv, key, value)
                srv.sources[key] = f"GPUPOOL_{key.upper()}"
        if srv.tls_prefix:
            srv.tls = True
            srv.sources["tls"] = "tls:// in the address"
    for key in ("connect_timeout", "probe_timeout"):
        name = f"GPUPOOL_{key.upper()}"
        v = _env(env, name)
        if v:
            try:
                value = float(v)
            except ValueError:
                value = -1.0
            if value < 0 or not math.isfinite(value):
                raise ConfigError(f"{name}={v} is not a number of seconds >= 0 (0: no limit)")
            setattr(cfg, key, value)
            cfg.sources[key] = name
    gpu, gpu_var = _env_text(env, "GPUPOOL_GPU", TEXT_MAX), "GPUPOOL_GPU"
    if not gpu:
        gpu, gpu_var = _env_text(env, "GPUPOOL_DEVICE", TEXT_MAX), "GPUPOOL_DEVICE"
    if gpu:
        cfg.gpu = gpu
        cfg.sources["gpu"] = gpu_var
    model = _env_text(env, "GPUPOOL_GPU_MODEL", TEXT_MAX)
    if model:
        cfg.model = model
        cfg.sources["model"] = "GPUPOOL_GPU_MODEL"
    mem = _env(env, "GPUPOOL_MIN_MEMORY")
    if mem:
        size = parse_size(mem)
        if size is None:
            raise ConfigError(f"GPUPOOL_MIN_MEMORY={mem} is not a size: write bytes or a number "
                              "with a unit (40GiB, 80G, 512M); empty or 0 means any")
        cfg.min_memory = size
        cfg.sources["min_memory"] = "GPUPOOL_MIN_MEMORY"


def _check_servers(cfg: ClientConfig) -> None:
    for srv in cfg.servers:
        if bool(srv.tls_cert) != bool(srv.tls_key):
            have, lack = ("tls_cert", "tls_key") if srv.tls_cert else ("tls_key", "tls_cert")
            raise ConfigError(f"server {srv.address}: {have} is set ({srv.sources.get(have)}) "
                              f"but {lack} is not: set both (a client certificate and its key) "
                              "or neither")


def _permission_warning(path: Path, data: dict[str, Any], env: Mapping[str, str],
                        warn: Callable[[str], None]) -> None:
    servers = data.get("servers")
    has_token = bool(data.get("token")) or (isinstance(servers, list) and any(
        isinstance(s, dict) and s.get("token") for s in servers))
    if not has_token:
        return
    home = env.get("HOME") or ""
    try:
        resolved = path.resolve()
        if not home or not resolved.is_relative_to(Path(home).resolve()):
            return
        mode = stat.S_IMODE(resolved.stat().st_mode)
    except (OSError, ValueError):
        return
    if mode & 0o044:
        warn(f"{path} holds a token and is readable by other users (mode {mode:04o}): "
             f"chmod 600 {path}")


def load(env: Mapping[str, str] | None = None,
         warn: Callable[[str], None] | None = None) -> ClientConfig:
    """The effective configuration. ConfigError (one line) when it cannot be used; warnings go
    to `warn` (default: stderr, "gpupool: ..."), and are also kept in .warnings."""
    env = os.environ if env is None else env
    cfg = ClientConfig()

    def note(msg: str) -> None:
        cfg.warnings.append(msg)
        if warn is None:
            print(f"gpupool: {msg}", file=sys.stderr)
        else:
            warn(msg)

    path, reason = find_file(env)
    cfg.file_reason = reason
    if path is not None:
        cfg.file = str(path)
        _apply_file(cfg, path, note)
        _permission_warning(path, cfg.data, env, note)
    _apply_env(cfg, env)
    _check_servers(cfg)
    return cfg


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
    """Write `data` to `path` atomically (a temporary file in the same folder, then rename),
    the file with `mode` and a new folder with `dir_mode`."""
    text = dumps(data)
    path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.chmod(path, mode)  # an existing file keeps no wider mode than asked
