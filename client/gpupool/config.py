"""The client configuration: one file (a TOML subset) plus GPUPOOL_* environment variables.

The same rules, in the same order and with the same messages, as the shims' C reader
(client/common/client_config.c; docs/client-configuration.md), so that `gpupool config`,
`status` and `doctor` see what a program run with `gpupool run` sees
(tests/test_config_agreement.py runs both on one table of cases):

- The file: $GPUPOOL_CONFIG when set (it must exist; "none" reads no file; "~/" is the home
  folder), else ${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml when it exists, else
  /etc/gpupool/config.toml when it exists, else none. One file only, never merged.
- Only a subset of TOML, the one the C side reads and `gpupool login` writes: comments,
  `key = value` with basic or literal one-line strings (escapes \\" \\\\ \\n \\t \\uXXXX),
  integers, floats (TOML's decimal grammar), booleans, arrays of strings, the tables
  [requirements] and [[servers]]. Anything else is an error naming FILE:LINE; unknown keys and
  tables get one warning each and are ignored. This module parses the subset itself, as the C
  side does (a general TOML parser accepts more, and reads some of it differently).
- String values are stripped of blanks (space, tab, CR, LF, FF, VT); an empty one counts as
  unset. Relative paths are relative to the folder of the file after symlinks are resolved;
  "~" and "~/" are the home folder.
- Environment variables override the file key by key; every GPUPOOL_* value is stripped the same
  way and a blank one counts as unset. Timeouts in the environment are digits with an optional
  fraction ("10", "2.5").
"""

from __future__ import annotations

import math
import os
import pwd
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PORT = "7070"
MAX_SERVERS = 16  # GP_MAX_SERVERS of the C side
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_PROBE_TIMEOUT = 2.0  # also what probe_timeout = 0 means for a probe (never forever)
SYSTEM_FILE = Path("/etc/gpupool/config.toml")
TOKEN_MAX = 4096
TEXT_MAX = 255
PATH_MAX = 4095
MAX_FILE_SIZE = 1 << 20
MAX_STRING = 8191  # longest string value, in bytes
MAX_ITEMS = 64  # longest array of strings
MAX_NUMBER = 100  # longest number, as written
MAX_KEY = 63  # longest key or table name
MAX_KEYS = 64  # most keys in one table
BLANKS = " \t\n\r\f\v"  # stripped from both ends of every value
DIGITS = "0123456789"

SUBSET = ("the gpupool configuration is a TOML subset: comments, key = value with \"strings\", "
          "'strings', integers, floats, true/false and arrays of strings, [requirements] and "
          "[[servers]]")

GPU_HOW = "a GPU index of the server or a GPU UUID (prefix)"
MODEL_HOW = "a part of the GPU name, e.g. A100"
TOKEN_HOW = "the token gpupoold gave you"
PATH_HOW = "a file path"
SIZE_HOW = ("write bytes or a number with a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB "
            "(40*2^30), 512M, 17179869184")
TOP_KEYS = ("token", "tls", "tls_ca", "tls_cert", "tls_key", "connect_timeout", "probe_timeout",
            "compression", "servers")
# compression: "" (unset) and "off" -> off, "lz4" -> LZ4-compressed copies (docs/architecture.md);
# at the top level (every server's default) and in a [[servers]] table (that server's own).
COMPRESSION_VALUES = ("off", "lz4")
REQUIREMENT_KEYS = ("gpu", "model", "min_memory")
SERVER_KEYS = ("address", "token", "tls", "tls_ca", "tls_cert", "tls_key", "compression")
PATH_KEYS = ("tls_ca", "tls_cert", "tls_key")
TRUE_WORDS = ("1", "yes", "true", "on")
FALSE_WORDS = ("0", "no", "false", "off")
ZERO_MEANS = {"connect_timeout": "0: no limit", "probe_timeout": "0: the default, 2"}

# Units of min_memory / GPUPOOL_MIN_MEMORY, as the shim reads them (client/common/requirements.c):
# the SI ones are decimal on purpose (GPUs are sold by decimal sizes).
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
              "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
              "tb": 10**12, "tib": 1 << 40}
SIZE_RE = re.compile(r"[ \t]*([0-9]+)(?:\.([0-9]+))?[ \t]*([A-Za-z]*)[ \t]*")
SECONDS_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?")
KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

# What a [[servers]] entry sets itself (the C side's F_* bits).
F_TOKEN, F_TLS, F_CA, F_CERT, F_KEY, F_PREFIX, F_COMP = 1, 2, 4, 8, 16, 32, 64
PATH_BITS = {"tls_ca": F_CA, "tls_cert": F_CERT, "tls_key": F_KEY}


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
    compression: str = "off"  # GPUPOOL_COMPRESSION, else its own, else the top level's
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from

    @property
    def written(self) -> str:
        """The address as a user writes it (tls:// when it has TLS)."""
        return f"tls://{self.address}" if self.tls else self.address

    @property
    def key(self) -> tuple[str, str]:
        """(host, port) as the C side compares them: the host's ASCII letters in any case."""
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
    compression: str = "off"  # top level (or GPUPOOL_COMPRESSION): the servers' default
    file: str = ""  # the file read, "" for none
    file_reason: str = ""  # why that file (or why none)
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the file's content, as parsed
    file_defaults: ServerConfig | None = None  # the file's top-level token / TLS settings


# ------------------------------------------------------------------------------ small parsers
def _ascii_lower(text: str) -> str:
    return "".join(c.lower() if "A" <= c <= "Z" else c for c in text)


def _nbytes(text: str) -> int:
    """Length in bytes, as the C side counts it (undecodable bytes of the environment count 1)."""
    return len(text.encode("utf-8", "surrogateescape"))


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or c == "\x7f" for c in text)


def _is_utf8(text: str) -> bool:
    """False when text holds bytes that were not UTF-8 (surrogate escapes, lone surrogates)."""
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


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
    low = _ascii_lower(text.strip(BLANKS))
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


def parse_seconds(text: str) -> float | None:
    """Seconds as the environment writes them (the C side's grammar): digits with an optional
    fraction, "10" or "2.5"; no sign, exponent, underscore, inf or nan. None otherwise."""
    if not SECONDS_RE.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def split_address(text: str) -> tuple[str, str, str, bool]:
    """("host:port" as written without tls://, host, port, tls://) of a server address:
    host, host:port, [v6]:port, tls://host:port (the port 1..65535, at most 5 digits). Blanks
    around it are ignored. ValueError says what is wrong."""
    s = text.strip(BLANKS)
    prefix = False
    if s[:6].lower() == "tls://":
        prefix = True
        s = s[6:]
    if not s:
        raise ValueError(f"server address {text!r} is empty")
    if _nbytes(s) >= 512:
        raise ValueError(f"server address {text!r} is longer than 511 bytes")
    if any(ord(c) <= 0x20 or c in "\x7f/," for c in s):
        raise ValueError(f"server address {text!r}: no blanks, control characters, '/' or ',' "
                         "(only tls:// may come before host:port)")
    if ":" not in s and not s.startswith("["):
        host, port = s, DEFAULT_PORT
    elif s.startswith("["):
        close = s.find("]")
        if close < 0 or s[close + 1:close + 2] != ":":
            raise ValueError(f"server address {text!r}: write an IPv6 address as [addr]:port")
        host, port = s[1:close], s[close + 2:]
    else:
        host, _, port = s.rpartition(":")
    if not host or _nbytes(host) > 255:
        raise ValueError(f"server address {text!r}: not a host name or address")
    if not port or any(c not in DIGITS for c in port) or len(port) > 5 or not (
            0 < int(port) < 65536):
        raise ValueError(f"server address {text!r}: the port must be a number from 1 to 65535")
    return s, host, port, prefix


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _home(env: Mapping[str, str]) -> str:
    """$HOME, else the password database's home; "" when neither is known."""
    home = env.get("HOME") or ""
    if home:
        return home
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir or ""
    except KeyError:
        return ""


class _NoHome(Exception):
    pass


def _expand(text: str, base: str | None, env: Mapping[str, str]) -> str:
    """"~" / "~/x" -> the home folder (/x); a relative path -> base/path (base None: left as is).
    As strings, exactly as the C side joins them (no normalisation). _NoHome for "~" without a
    home folder."""
    if not text:
        return ""
    if text[0] == "~" and (len(text) == 1 or text[1] == "/"):
        home = _home(env)
        if not home:
            raise _NoHome
        return home + text[1:]
    if text[0] != "/" and base is not None:
        return f"{base}/{text}"
    return text


def _check_text(what: str, value: str, how: str, limit: int = TEXT_MAX) -> str:
    """A text setting stripped and checked as the C side's check_text: at most limit bytes, no
    control characters, UTF-8. ConfigError (without FILE:LINE) otherwise."""
    v = value.strip(BLANKS)
    if _nbytes(v) > limit:
        raise ConfigError(f"{what} is longer than {limit} bytes; set it to {how}")
    if _has_control(v):
        raise ConfigError(f"{what} contains a control character; set it to {how}")
    if not _is_utf8(v):
        raise ConfigError(f"{what} is not valid UTF-8; set it to {how}")
    return v


# --------------------------------------------------------------------- the TOML subset
class _Settings:
    """What the file sets (the C side's file_settings), with where each came from."""

    def __init__(self, file: str, folder: str, env: Mapping[str, str]) -> None:
        self.file = file
        self.folder = folder  # relative paths start here
        self.env = env
        self.servers: list[ServerConfig] = []
        self.bits: list[int] = []  # F_*: what each entry sets itself
        self.short_form_line = 0
        self.defaults = ServerConfig(address="", host="", port="")  # top-level token / TLS
        self.timeouts: dict[str, float] = {}
        self.gpu = ""
        self.model = ""
        self.min_memory = 0
        self.compression = "off"
        # A [[servers]] compression that is not a known value: (line, value), refused when its
        # entry ends, naming the entry's address (which may come after it).
        self.bad_compression: tuple[int, str] | None = None
        self.holds_token = False
        self.sources: dict[str, str] = {}  # connect_timeout, gpu, ... -> FILE:LINE


class _Parser:
    """The C reader (client/common/client_config.c) line for line: the same grammar, the same
    checks in the same order, the same messages. Errors are ConfigError("FILE:LINE: ...");
    warnings go to `warn` as they are found. `data` keeps the values as written (for
    `gpupool login`, which rewrites the file)."""

    def __init__(self, text: str, st: _Settings, warn: Callable[[str], None]) -> None:
        self.s = text[1:] if text.startswith("\ufeff") else text
        self.n = len(self.s)
        self.i = 0
        self.line = 1
        self.st = st
        self.file = st.file
        self.warn = warn
        self.data: dict[str, Any] = {}
        self.unknown_table: tuple[str, bool] = ("", False)  # the [table] being skipped

    # ---- low level
    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"{self.file}:{self.line}: {what}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < self.n else ""

    def snippet(self, at: int) -> str:
        j = at
        while j < self.n and j - at < 20 and self.s[j] not in "\n\r":
            j += 1
        return self.s[at:j]

    def skip_blank(self) -> None:
        while self.i < self.n and self.s[self.i] in " \t":
            self.i += 1

    def skip_comment(self) -> None:
        while self.i < self.n and self.s[self.i] != "\n":
            self.i += 1

    def end_of_line(self, after: str) -> None:
        self.skip_blank()
        if self.peek() == "#":
            self.skip_comment()
        if self.peek() == "\r" and self.peek(1) == "\n":
            self.i += 1
        if self.i >= self.n:
            return
        if self.s[self.i] != "\n":
            raise self.fail(f"unexpected text after {after}: '{self.snippet(self.i)}'; {SUBSET}")
        self.i += 1
        self.line += 1

    def skip_array_space(self) -> None:
        while True:
            self.skip_blank()
            if self.peek() == "#":
                self.skip_comment()
            if self.peek() == "\r" and self.peek(1) == "\n":
                self.i += 1
            if self.peek() == "\n":
                self.i += 1
                self.line += 1
                continue
            return

    # ---- values
    def string(self) -> str:
        q = self.s[self.i]
        if self.peek(1) == q and self.peek(2) == q:
            raise self.fail(f"multi-line strings ({q * 3}) are not supported; write the value "
                            "on one line")
        self.i += 1
        out: list[str] = []
        size = 0

        def put(text: str) -> None:
            nonlocal size
            size += _nbytes(text)
            if size > MAX_STRING:
                raise self.fail(f"this string is longer than {MAX_STRING} bytes")
            out.append(text)

        while True:
            c = self.peek()
            if c in ("", "\n", "\r"):
                raise self.fail(f"this string has no closing {q} on its line")
            if c == q:
                self.i += 1
                break
            if (ord(c) < 0x20 and c != "\t") or c == "\x7f":
                raise self.fail("a control character inside a string; write it as an escape "
                                "(\\n, \\t, \\uXXXX)")
            if c == "\\" and q == '"':
                e = self.peek(1)
                self.i += 2
                plain = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}.get(e)
                if plain:
                    put(plain)
                    continue
                if e == "u":
                    cp = 0
                    for _ in range(4):
                        h = self.peek()
                        if not h or h not in "0123456789abcdefABCDEF":
                            raise self.fail("\\u needs four hex digits (\\u00e9)")
                        cp = cp * 16 + int(h, 16)
                        self.i += 1
                    if cp == 0 or 0xD800 <= cp <= 0xDFFF:
                        raise self.fail(f"\\u{cp:04x} is not a character a value may hold")
                    put(chr(cp))
                    continue
                shown = e if " " <= e < "\x7f" else "?"
                raise self.fail(f"unsupported escape \\{shown}; the supported escapes are \\\" "
                                "\\\\ \\n \\t \\uXXXX (or use a 'literal string')")
            put(c)
            self.i += 1
        value = "".join(out)
        if not _is_utf8(value):
            raise self.fail("this string is not valid UTF-8; save the file as UTF-8")
        return value

    def digit_run(self, p: int) -> tuple[int, str] | None:
        """Digits with single underscores between them: (where it ends, the digits)."""
        digits: list[str] = []
        want_digit = True
        while p < self.n:
            c = self.s[p]
            if c in DIGITS:
                digits.append(c)
                want_digit = False
            elif c == "_" and not want_digit:
                want_digit = True
            else:
                break
            p += 1
        return None if want_digit else (p, "".join(digits))

    def number(self) -> int | float | None:
        """TOML's decimal number grammar, at most MAX_NUMBER characters; integers within 64-bit
        signed, floats finite. None if the text here is not one."""
        p, s, d, is_float = self.i, self.s, "", False
        if p < self.n and s[p] in "+-":
            d += s[p]
            p += 1
        if p >= self.n or s[p] not in DIGITS:
            return None
        if s[p] == "0" and p + 1 < self.n and s[p + 1] in DIGITS:
            return None  # 007
        run = self.digit_run(p)
        if run is None:
            return None
        p, digits = run
        d += digits
        if p < self.n and s[p] == ".":
            is_float = True
            run = self.digit_run(p + 1)
            if run is None:
                return None
            p, digits = run
            d += "." + digits
        if p < self.n and s[p] in "eE":
            is_float = True
            d += "e"
            p += 1
            if p < self.n and s[p] in "+-":
                d += s[p]
                p += 1
            run = self.digit_run(p)
            if run is None:
                return None
            p, digits = run
            d += digits
        if p < self.n and s[p] not in " \t\r\n#,]":
            return None
        if p - self.i > MAX_NUMBER:
            return None
        value: int | float
        if is_float:
            value = float(d)
            if not math.isfinite(value):
                return None
        else:
            value = int(d)
            if not -(1 << 63) <= value < 1 << 63:
                return None
        self.i = p
        return value

    def value(self, key: str) -> Any:
        self.skip_blank()
        c = self.peek()
        if c in ("", "\n", "\r", "#"):
            raise self.fail(f"{key} has no value; write {key} = \"...\"")
        if c in ('"', "'"):
            return self.string()
        if c == "[":
            self.i += 1
            items: list[str] = []
            while True:
                self.skip_array_space()
                c = self.peek()
                if not c:
                    raise self.fail(f"the array of {key} has no closing ]")
                if c == "]":
                    self.i += 1
                    return items
                if c not in ('"', "'"):
                    raise self.fail(f"the array of {key} may only hold strings; {SUBSET}")
                if len(items) >= MAX_ITEMS:
                    raise self.fail(f"the array of {key} has more than {MAX_ITEMS} items")
                items.append(self.string())
                self.skip_array_space()
                if self.peek() == ",":
                    self.i += 1
                    continue
                if self.peek() == "]":
                    continue
                raise self.fail(f"expected , or ] in the array of {key}")
        for word, b in (("true", True), ("false", False)):
            if self.s.startswith(word, self.i):
                after = self.i + len(word)
                if after >= self.n or self.s[after] in " \t\r\n#":
                    self.i = after
                    return b
        if c == "{":
            raise self.fail(f"inline tables ({{...}}) are not supported; {SUBSET}")
        if c in DIGITS or c in "+-":
            number = self.number()
            if number is not None:
                return number
        raise self.fail(f"cannot read the value of {key} (strings need quotes: {key} = "
                        "\"...\"; dates, hex numbers, inf and nan are not supported); "
                        f"{SUBSET}")

    # ---- settings (the C side's apply_key)
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def want(self, key: str, v: Any, kind: type, how: str) -> None:
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, kind)
        if not ok:
            raise self.fail(f"{key} must be {how}")

    def string_value(self, key: str, v: Any, kind: str, how: str, limit: int) -> str:
        self.want(key, v, str, kind)
        s = v.strip(BLANKS)
        if _has_control(s):
            raise self.fail(f"{key} contains a control character; set it to {how}")
        if _nbytes(s) > limit:
            raise self.fail(f"{key} is longer than {limit} bytes; set it to {how}")
        return str(s)

    def path_value(self, key: str, v: Any) -> str:
        s = self.string_value(key, v, "a file path in quotes", PATH_HOW, PATH_MAX)
        try:
            out = _expand(s, self.st.folder, self.st.env)
        except _NoHome:
            raise self.fail(f"{key} = \"{s}\": ~ stands for the home folder, and HOME is not "
                            "set; write the whole path") from None
        if _nbytes(out) > PATH_MAX:
            raise self.fail(f"{key} is longer than {PATH_MAX} bytes once expanded; use a "
                            "shorter path")
        return out

    def token_value(self, key: str, v: Any) -> str:
        return self.string_value(key, v, "a string in quotes (the token gpupoold gave you)",
                                 TOKEN_HOW, TOKEN_MAX)

    def timeout_value(self, key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise self.fail(f"{key} must be a number of seconds, 0 or more ({ZERO_MEANS[key]}), "
                            f"e.g. {key} = 10")
        return float(v)

    def address_value(self, text: str) -> ServerConfig | None:
        s = text.strip(BLANKS)
        if not s:
            return None
        try:
            address, host, port, prefix = split_address(s)
        except ValueError:
            raise self.fail(f"'{s}' is not a server address: write host, host:port, [v6]:port "
                            "or tls://host:port") from None
        return ServerConfig(address=address, host=host, port=port, tls_prefix=prefix,
                            sources={"address": self.where()})

    def text_value(self, key: str, v: str, how: str) -> str:
        try:
            return _check_text(key, v, how)
        except ConfigError as exc:
            raise self.fail(str(exc)) from None

    def apply(self, section: str, key: str, v: Any) -> None:
        st, where = self.st, self.where()
        if section == "unknown":
            return
        if section == "top":
            if key == "token":
                st.defaults.token = self.token_value(key, v)
                st.holds_token |= bool(st.defaults.token)
                if st.defaults.token:
                    st.defaults.sources["token"] = where
                return
            if key == "tls":
                self.want(key, v, bool, "true or false")
                st.defaults.tls = v
                st.defaults.sources["tls"] = where
                return
            if key in PATH_KEYS:
                setattr(st.defaults, key, self.path_value(key, v))
                if getattr(st.defaults, key):
                    st.defaults.sources[key] = where
                return
            if key in ("connect_timeout", "probe_timeout"):
                st.timeouts[key] = self.timeout_value(key, v)
                st.sources[key] = where
                return
            if key == "compression":
                self.want(key, v, str, '"off" or "lz4"')
                t = v.strip(BLANKS)
                if t and t not in COMPRESSION_VALUES:
                    raise self.fail(f'compression = "{t}" is not supported: write "off" (the '
                                    'default) or "lz4"')
                st.compression = t or "off"
                st.sources["compression"] = where
                return
            if key == "servers":
                if not isinstance(v, list):
                    raise self.fail("servers must be an array of addresses, servers = "
                                    "[\"gpu1:7070\", \"tls://gpu2:7070\"] (or one [[servers]] "
                                    "table per server)")
                st.short_form_line = self.line
                for item in v:
                    if not item.strip(BLANKS):
                        continue  # a blank item: unset
                    if len(st.servers) >= MAX_SERVERS:
                        raise self.fail(f"more than {MAX_SERVERS} servers; keep the "
                                        f"{MAX_SERVERS} you prefer")
                    srv = self.address_value(item)
                    assert srv is not None
                    st.servers.append(srv)
                    st.bits.append(F_PREFIX if srv.tls_prefix else 0)
                return
        elif section == "requirements":
            if key == "gpu":
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    v = str(v)
                elif not isinstance(v, str):
                    raise self.fail("gpu must be a GPU index (1 or \"1\") or a GPU UUID (prefix) "
                                    "in quotes")
                st.gpu = self.text_value("gpu", v, GPU_HOW)
                if st.gpu:
                    st.sources["gpu"] = where
                return
            if key == "model":
                self.want(key, v, str, "a part of the GPU name in quotes (\"H100\")")
                st.model = self.text_value("model", v, MODEL_HOW)
                if st.model:
                    st.sources["model"] = where
                return
            if key == "min_memory":
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    st.min_memory = v
                elif not isinstance(v, str):
                    raise self.fail("min_memory must be a size in quotes (\"40GiB\", \"80G\") or "
                                    "bytes as an integer")
                else:
                    s = v.strip(BLANKS)
                    size = parse_size(s) if s else 0
                    if size is None:
                        raise self.fail(f"min_memory = \"{s}\" is not a size: {SIZE_HOW}")
                    st.min_memory = size
                if st.min_memory or isinstance(v, int):
                    st.sources["min_memory"] = where
                return
        elif section == "servers":
            srv, i = st.servers[-1], len(st.servers) - 1
            if key == "address":
                self.want(key, v, str, "a server address in quotes (\"gpu1:7070\")")
                parsed = self.address_value(v)
                if parsed is not None:
                    srv.address, srv.host, srv.port = parsed.address, parsed.host, parsed.port
                    srv.sources["address"] = where
                    if parsed.tls_prefix:
                        srv.tls_prefix = True
                        st.bits[i] |= F_PREFIX
                return
            if key == "token":
                srv.token = self.token_value(key, v)
                if srv.token:
                    st.bits[i] |= F_TOKEN
                    st.holds_token = True
                    srv.sources["token"] = where
                return
            if key == "tls":
                self.want(key, v, bool, "true or false")
                srv.tls = v
                st.bits[i] |= F_TLS
                srv.sources["tls"] = where
                return
            if key in PATH_KEYS:
                setattr(srv, key, self.path_value(key, v))
                if getattr(srv, key):
                    st.bits[i] |= PATH_BITS[key]
                    srv.sources[key] = where
                return
            if key == "compression":
                self.want(key, v, str, '"off" or "lz4"')
                t = v.strip(BLANKS)
                if t and t not in COMPRESSION_VALUES:  # check_entry refuses it, naming the server
                    st.bad_compression = (self.line, t)
                    return
                if t:  # blank: unset, the top level's applies
                    srv.compression = t
                    st.bits[i] |= F_COMP
                    srv.sources["compression"] = where
                return
        known, shown = {
            "top": ("token, tls, tls_ca, tls_cert, tls_key, connect_timeout, probe_timeout, "
                    "compression, servers", ""),
            "requirements": ("gpu, model, min_memory", " in [requirements]"),
            "servers": ("address, token, tls, tls_ca, tls_cert, tls_key, compression",
                        " in [[servers]]"),
        }[section]
        self.warn(f"{where}: unknown setting '{key}'{shown} ignored (known there: {known})")

    # ---- structure
    def header(self, state: dict[str, int]) -> str:
        dbl = self.peek(1) == "["
        self.i += 2 if dbl else 1
        self.skip_blank()
        start = self.i
        while self.i < self.n and self.s[self.i] in KEY_CHARS:
            self.i += 1
        name = self.s[start:self.i]
        self.skip_blank()
        if not name or self.i >= self.n or self.s[self.i] in ".\"'":
            raise self.fail(f"unsupported table header (quoted or dotted names); {SUBSET}")
        if len(name) > MAX_KEY:
            raise self.fail(f"the table name '{name[:20]}...' is longer than {MAX_KEY} "
                            f"characters; {SUBSET}")
        if self.peek() != "]" or (dbl and self.peek(1) != "]"):
            raise self.fail(f"this table header has no closing {']]' if dbl else ']'}")
        self.i += 2 if dbl else 1
        hline = self.line
        self.end_of_line("the table header")
        next_line, self.line = self.line, hline  # the errors below name the header's line
        st = self.st
        if name == "requirements":
            if dbl:
                raise self.fail("[[requirements]] is not supported: write [requirements] (one "
                                "table)")
            if state.get("requirements"):
                raise self.fail("[requirements] appears twice; merge the two tables")
            state["requirements"] = 1
            section = "requirements"
            self.data["requirements"] = {}
        elif name == "servers":
            if not dbl:
                raise self.fail("[servers] is not supported: write [[servers]] before each "
                                "server's address = \"...\" (or servers = [\"a:7070\", "
                                "\"b:7070\"] at the top)")
            if st.short_form_line:
                raise self.fail(f"[[servers]] together with servers = [...] (line "
                                f"{st.short_form_line}): use one form")
            if len(st.servers) >= MAX_SERVERS:
                raise self.fail(f"more than {MAX_SERVERS} servers; keep the {MAX_SERVERS} you "
                                "prefer")
            st.servers.append(ServerConfig(address="", host="", port=""))
            st.bits.append(0)
            section = "servers"
            self.data.setdefault("servers", []).append({})
        else:
            self.warn(f"{self.file}:{self.line}: unknown table {'[[' if dbl else '['}{name}"
                      f"{']]' if dbl else ']'} ignored (known: [requirements], [[servers]])")
            section = "unknown"
            self.unknown_table = (name, dbl)
            # Kept in data as written (gpupool login then refuses to rewrite what it cannot).
            if dbl and isinstance(self.data.get(name, []), list):
                self.data.setdefault(name, []).append({})
            elif not dbl and name not in self.data:
                self.data[name] = {}
        self.line = next_line
        return section

    def check_entry(self, section: str, header_line: int) -> None:
        """The [[servers]] entry that ended (or the last one) must have an address, and a known
        compression if it sets one."""
        if section != "servers":
            return
        srv = self.st.servers[-1]
        if not srv.address:
            self.line = header_line
            raise self.fail("this [[servers]] entry has no address; write address = "
                            "\"host:port\" under it")
        if self.st.bad_compression is not None:
            self.line, t = self.st.bad_compression
            raise self.fail(f'server {srv.address}: compression = "{t}" is not supported: write '
                            '"off" or "lz4", or leave it out for the top-level compression')

    def keep(self, section: str, key: str, v: Any) -> None:
        """The value as written, in data."""
        if section == "top":
            self.data[key] = v
        elif section == "requirements":
            self.data["requirements"][key] = v
        elif section == "servers":
            self.data["servers"][-1][key] = v
        else:
            name, dbl = self.unknown_table
            table = self.data.get(name)
            if dbl and isinstance(table, list) and table and isinstance(table[-1], dict):
                table[-1][key] = v
            elif not dbl and isinstance(table, dict):
                table[key] = v

    def run(self) -> None:
        section, header_line = "top", 0
        state: dict[str, int] = {}
        seen: list[str] = []
        while self.i < self.n:
            self.skip_blank()
            if self.i >= self.n:
                break
            c = self.s[self.i]
            if c in "\n\r#":
                self.end_of_line("the comment")
                continue
            if c == "[":
                self.check_entry(section, header_line)
                header_line = self.line
                section = self.header(state)
                seen = []
                continue
            if c in "\"'":
                raise self.fail("quoted keys are not supported; write the key bare (token = "
                                f"\"...\"); {SUBSET}")
            start = self.i
            while self.i < self.n and self.s[self.i] in KEY_CHARS:
                self.i += 1
            key = self.s[start:self.i]
            if not key:
                raise self.fail(f"expected key = value, a [table] or a comment, not "
                                f"'{self.snippet(start)}'; {SUBSET}")
            if len(key) > MAX_KEY:
                raise self.fail(f"the key '{key[:20]}...' is longer than {MAX_KEY} characters; "
                                f"{SUBSET}")
            self.skip_blank()
            if self.peek() == ".":
                raise self.fail(f"dotted keys ({key}.x = ...) are not supported; {SUBSET}")
            if self.peek() != "=":
                raise self.fail(f"expected = after {key} (key = value)")
            self.i += 1
            line = self.line
            v = self.value(key)
            value_end_line, self.line = self.line, line  # messages name the key's line
            if section != "unknown":
                if key in seen:
                    raise self.fail(f"{key} is set twice in the same table; keep one")
                if len(seen) >= MAX_KEYS:
                    raise self.fail(f"more than {MAX_KEYS} settings in one table; this is not a "
                                    "gpupool configuration")
                seen.append(key)
            self.apply(section, key, v)
            self.keep(section, key, v)
            self.line = value_end_line
            self.end_of_line("the value")
        self.check_entry(section, header_line)


# ------------------------------------------------------------------------------ the file
def _user_file_text(env: Mapping[str, str]) -> str | None:
    xdg = env.get("XDG_CONFIG_HOME") or ""
    if xdg:
        return f"{xdg}/gpupool/config.toml"
    home = _home(env)
    return f"{home}/.config/gpupool/config.toml" if home else None


def default_user_file(env: Mapping[str, str]) -> Path | None:
    text = _user_file_text(env)
    return Path(text) if text is not None else None


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def find_file(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The file to read (as the C side names it: no normalisation) and why, or None and why
    none. ConfigError when GPUPOOL_CONFIG names a file that is not there."""
    explicit = _env(env, "GPUPOOL_CONFIG")
    if explicit:
        if explicit == "none":
            return None, "GPUPOOL_CONFIG=none: no file is read"
        tail = "; point it at the configuration file, or set GPUPOOL_CONFIG=none to read none"
        try:
            path = _expand(explicit, None, env)
        except _NoHome:
            raise ConfigError(f"GPUPOOL_CONFIG={explicit}: ~ stands for the home folder, and "
                              f"HOME is not set{tail}") from None
        if _nbytes(path) > PATH_MAX:
            raise ConfigError(f"GPUPOOL_CONFIG={explicit}: the path is too long{tail}")
        try:
            os.stat(path)
        except OSError as exc:
            raise ConfigError(f"GPUPOOL_CONFIG={explicit}: {os.strerror(exc.errno or 0)}"
                              f"{tail}") from None
        return path, "from GPUPOOL_CONFIG"
    user = _user_file_text(env)
    if user is not None and _is_regular(user):
        return user, "the user's file"
    system = str(SYSTEM_FILE)
    if _is_regular(system):
        return system, f"the system file (no user file at {user})"
    return None, f"no file ({user} and {system} do not exist)"


def _read(path: str) -> tuple[bytes, os.stat_result]:
    """The file's bytes and its stat, with the C side's checks and messages."""
    tail = "; fix its permissions or set GPUPOOL_CONFIG to another file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: "
                          f"{os.strerror(exc.errno or 0)}{tail}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the configuration file {path} is not a regular file")
        if st.st_size > MAX_FILE_SIZE:
            raise ConfigError(f"the configuration file {path} is larger than {MAX_FILE_SIZE} "
                              "bytes; is it the right file?")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: "
                          f"{os.strerror(exc.errno or 0)}{tail}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if b"\0" in raw:
        raise ConfigError(f"the configuration file {path} holds a NUL byte: it must be a text "
                          "file")
    return raw, st


def _folder(path: str) -> str:
    """The folder of path after symlinks are resolved (relative paths in the file start
    there)."""
    real = os.path.realpath(path)
    head = real.rsplit("/", 1)[0]
    return head or "/"


def _parse(path: str, env: Mapping[str, str], warn: Callable[[str], None],
           ) -> tuple[_Parser, os.stat_result]:
    raw, st = _read(path)
    settings = _Settings(path, _folder(path), env)
    parser = _Parser(raw.decode("utf-8", "surrogateescape"), settings, warn)
    parser.run()
    return parser, st


def read_file(path: Path) -> tuple[dict[str, Any], str]:
    """The content of a config file (checked as the shims check it) as written, and its text."""
    parser, _ = _parse(str(path), os.environ, lambda msg: None)
    return parser.data, parser.s


def _mode_warning(path: str, st: os.stat_result, settings: _Settings, env: Mapping[str, str],
                  warn: Callable[[str], None]) -> None:
    """A file under the home folder that holds a token and is readable by others."""
    if not settings.holds_token or not st.st_mode & 0o044:
        return
    home = _home(env)
    if not home:
        return
    h = os.path.realpath(home) if os.path.exists(home) else home
    h = h.rstrip("/") or "/"
    p = os.path.realpath(path)
    if len(h) > 1 and p.startswith(h + "/"):
        mode = stat.S_IMODE(st.st_mode)
        warn(f"{path} holds a token and is readable by other users (mode {mode:04o}): "
             f"chmod 600 {path}")


# ------------------------------------------------------------------------ the environment
def _env(env: Mapping[str, str], name: str) -> str:
    """A GPUPOOL_* variable without the blanks at its ends ("" when unset or blank)."""
    return (env.get(name) or "").strip(BLANKS)


def _env_servers(listed: str, settings: _Settings) -> tuple[list[ServerConfig], list[int]]:
    if not _is_utf8(listed):  # blanks and control characters: refused item by item
        raise ConfigError(f"GPUPOOL_SERVER is not valid UTF-8: write host:port, [v6]:port, host "
                          f"(port {DEFAULT_PORT}) or tls://host:port, separated by commas")
    servers: list[ServerConfig] = []
    bits: list[int] = []
    for raw in listed.split(","):
        item = raw.strip(BLANKS)
        if not item:
            continue
        if len(servers) >= MAX_SERVERS:
            raise ConfigError(f"GPUPOOL_SERVER names more than {MAX_SERVERS} servers; keep "
                              f"the {MAX_SERVERS} you prefer")
        try:
            address, host, port, prefix = split_address(item)
        except ValueError:
            raise ConfigError(f"GPUPOOL_SERVER: '{item}' is not a server address: write "
                              f"host:port, [v6]:port, host (port {DEFAULT_PORT}) or "
                              "tls://host:port, separated by commas") from None
        srv = ServerConfig(address=address, host=host, port=port,
                           sources={"address": "GPUPOOL_SERVER"})
        flags = 0
        for j, same in enumerate(settings.servers):
            if same.key != srv.key:
                continue
            # That entry's token, TLS and compression settings (and where they came from).
            for key in ("token", "tls", *PATH_KEYS, "compression"):
                setattr(srv, key, getattr(same, key))
                if key in same.sources:
                    srv.sources[key] = same.sources[key]
            srv.tls_prefix = same.tls_prefix
            flags = settings.bits[j]
            break
        if prefix:
            srv.tls_prefix = True
            flags |= F_PREFIX
        servers.append(srv)
        bits.append(flags)
    if not servers:
        raise ConfigError(f"GPUPOOL_SERVER='{listed}' names no server: set "
                          "GPUPOOL_SERVER=host:port")
    return servers, bits


def _env_path(env: Mapping[str, str], name: str) -> str | None:
    v = _env(env, name)
    if not v:
        return None
    if _has_control(v):
        raise ConfigError(f"{name} contains a control character; set it to {PATH_HOW}")
    try:
        out = _expand(v, None, env)
    except _NoHome:
        raise ConfigError(f"{name}={v}: ~ stands for the home folder, and HOME is not set; "
                          "write the whole path") from None
    if _nbytes(out) > PATH_MAX:
        raise ConfigError(f"{name} is longer than {PATH_MAX} bytes once expanded; use a shorter "
                          "path")
    return out


def _apply(cfg: ClientConfig, settings: _Settings, env: Mapping[str, str],
           warn: Callable[[str], None]) -> None:
    """The list, the defaults for what an entry does not set, then the environment (the C side's
    load(), in the same order)."""
    listed = _env(env, "GPUPOOL_SERVER")
    if listed:
        servers, bits = _env_servers(listed, settings)
        cfg.sources["servers"] = "GPUPOOL_SERVER"
    else:
        servers, bits = settings.servers, settings.bits
    defaults = settings.defaults
    token = _env(env, "GPUPOOL_TOKEN")
    if token:
        token = _check_text("GPUPOOL_TOKEN", token, TOKEN_HOW, TOKEN_MAX)
    tls_word = _env(env, "GPUPOOL_TLS")
    tls: bool | None = None
    if tls_word:
        tls = parse_bool_word(tls_word)
        if tls is None:
            raise ConfigError(f"GPUPOOL_TLS={tls_word} is not understood: use 1 (TLS) or 0 "
                              "(plain TCP)")
    paths = {key: _env_path(env, f"GPUPOOL_{key.upper()}") for key in PATH_KEYS}
    for srv, flags in zip(servers, bits):
        if token:
            srv.token = token
            srv.sources["token"] = "GPUPOOL_TOKEN"
        elif not flags & F_TOKEN:
            srv.token = defaults.token
            _source(srv, "token", defaults)
        if flags & F_PREFIX:
            srv.tls = True
            srv.sources["tls"] = "tls:// in the address"
        elif tls is not None:
            srv.tls = tls
            srv.sources["tls"] = "GPUPOOL_TLS"
        elif not flags & F_TLS:
            srv.tls = defaults.tls
            _source(srv, "tls", defaults)
        for key, value in paths.items():
            if value is not None:
                setattr(srv, key, value)
                srv.sources[key] = f"GPUPOOL_{key.upper()}"
            elif not flags & PATH_BITS[key]:
                setattr(srv, key, getattr(defaults, key))
                _source(srv, key, defaults)
    cfg.servers = servers

    for key in ("connect_timeout", "probe_timeout"):
        name = f"GPUPOOL_{key.upper()}"
        v = _env(env, name)
        if v:
            value = parse_seconds(v)
            if value is None:
                raise ConfigError(f"{name}={v} is not a number of seconds: write e.g. 10 or 2.5 "
                                  f"({ZERO_MEANS[key]})")
            setattr(cfg, key, value)
            cfg.sources[key] = name
    gpu, old = _env(env, "GPUPOOL_GPU"), _env(env, "GPUPOOL_DEVICE")
    gpu_var = "GPUPOOL_GPU"
    if not gpu:
        gpu, gpu_var = old, "GPUPOOL_DEVICE"
    elif old and old != gpu:
        warn(f"GPUPOOL_DEVICE={old} ignored: GPUPOOL_GPU={gpu} is set (GPUPOOL_DEVICE is its "
             "old name)")
    if gpu:
        cfg.gpu = _check_text(gpu_var, gpu, GPU_HOW)
        cfg.sources["gpu"] = gpu_var
    model = _env(env, "GPUPOOL_GPU_MODEL")
    if model:
        cfg.model = _check_text("GPUPOOL_GPU_MODEL", model, MODEL_HOW)
        cfg.sources["model"] = "GPUPOOL_GPU_MODEL"
    mem = _env(env, "GPUPOOL_MIN_MEMORY")
    if mem:
        size = parse_size(mem)
        if size is None:
            raise ConfigError(f"GPUPOOL_MIN_MEMORY={mem} is not a size: {SIZE_HOW}")
        cfg.min_memory = size
        cfg.sources["min_memory"] = "GPUPOOL_MIN_MEMORY"
    comp = _env(env, "GPUPOOL_COMPRESSION")
    if comp:
        if comp not in COMPRESSION_VALUES:
            raise ConfigError(f"GPUPOOL_COMPRESSION={comp} is not supported: write off (the "
                              "default) or lz4")
        cfg.compression = comp
        cfg.sources["compression"] = "GPUPOOL_COMPRESSION"
    # Each server's compression: GPUPOOL_COMPRESSION, else its own, else the top level's.
    for srv, flags in zip(servers, bits):
        if comp or not flags & F_COMP:
            srv.compression = cfg.compression
            if "compression" in cfg.sources:
                srv.sources["compression"] = cfg.sources["compression"]
            else:
                srv.sources.pop("compression", None)

    # A client certificate needs its key, and a key its certificate.
    for srv in cfg.servers:
        if bool(srv.tls_cert) != bool(srv.tls_key):
            have, lack = ("tls_cert", "tls_key") if srv.tls_cert else ("tls_key", "tls_cert")
            raise ConfigError(f"server {srv.address}: {have} is set but {lack} is not: set both "
                              "(a client certificate and its key, GPUPOOL_TLS_CERT and "
                              "GPUPOOL_TLS_KEY) or neither")


def _source(srv: ServerConfig, key: str, defaults: ServerConfig) -> None:
    if key in defaults.sources:
        srv.sources[key] = defaults.sources[key]
    else:
        srv.sources.pop(key, None)


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
    settings = _Settings("", "", env)
    if path is not None:
        parser, st = _parse(path, env, note)
        settings = parser.st
        cfg.file = path
        cfg.data = parser.data
        _mode_warning(path, st, settings, env, note)
        for key, value in settings.timeouts.items():
            setattr(cfg, key, value)
        cfg.gpu, cfg.model, cfg.min_memory = settings.gpu, settings.model, settings.min_memory
        cfg.compression = settings.compression
        cfg.sources.update(settings.sources)
    cfg.file_defaults = settings.defaults
    _apply(cfg, settings, env, note)
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
