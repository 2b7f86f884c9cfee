"""The client configuration reader (client/common/client_config.c, the only one: the shims link
it, `gpupool` calls it through libgpupool-config.so) on one table of cases, files and
environments, good and bad (docs/client-configuration.md): each gives the effective servers,
tokens, TLS settings and files, timeouts, requirements and warnings, or one-line error, that the
case says. Each case runs in a process of its own through `gpupool.config.load`, so that the
sanitizer build (GPUPOOL_SAN=1) runs the table under ASan/UBSan too."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from client_config_example import EXAMPLE
from conftest import REPO, _libasan, require, run_client
from gpupool import config as cc

# Two well-formed pins (43 base64 characters, the last one of a 32-byte value).
PIN_A = "SHA256:" + "A" * 42 + "E"
PIN_B = "SHA256:" + "x/+9" * 10 + "abc"

BLANKS = """\
token = "  gpt_x \\t"
tls_ca = " ca.pem "
tls_cert = "\\tcert.pem"
tls_key = "key.pem\\n"
[requirements]
gpu = " 1 "
model = "\\tH100 "
min_memory = " 40GiB "
[[servers]]
address = "  h:1 "
token = " own "
[[servers]]
address = "tls://g"
token = "   "
tls_ca = " "
tls_cert = "/abs/cert.pem"
tls_key = ""
"""


# Two servers under a top-level compression, each with a line of its own (or none).
TWO_SERVERS = """\
compression = "{top}"
[[servers]]
address = "near:1"
{near}
[[servers]]
address = "far:2"
{far}
"""


@dataclass
class Case:
    name: str
    text: str | bytes | None = None  # the file at {tmp}/cfg/config.toml (None: no file)
    env: dict[str, str] = field(default_factory=dict)  # {tmp} and {home} are filled in
    expect: str = "ok"  # or "error"
    words: str = ""  # in the error, or in the JSON of the result: what the case is about
    mode: int = 0o600
    layout: str = ""  # "symlink", "home", "xdg", "dir"


CASES = [
    # ---------------------------------------------------------------- good files
    Case("contract example", EXAMPLE, words="gpu2.example.com"),
    Case("blanks around strings, empty means unset", BLANKS, words='"token": "own"'),
    Case("gpu as an integer", "[requirements]\ngpu = 3\n", words='"gpu": "3"'),
    Case("gpu as an integer with underscores", "[requirements]\ngpu = 1_0\n",
         words='"gpu": "10"'),
    Case("numbers in the TOML grammar",
         "connect_timeout = 1_000\nprobe_timeout = +1.5e1\n[requirements]\n"
         "min_memory = 17179869184\n", words='"connect_timeout": 1000'),
    Case("gpus and memory in the file (issues 37, 32)",
         "[requirements]\ngpus = 4\nmemory = ' 8GiB '\n", words='"gpus": 4, "memory": 8589934592'),
    Case("GPUPOOL_GPUS and GPUPOOL_MEMORY over the file",
         "[requirements]\ngpus = 4\nmemory = 1\n",
         env={"GPUPOOL_GPUS": " 64 ", "GPUPOOL_MEMORY": "16G"},
         words='"gpus": 64, "memory": 16000000000'),
    Case("spread in the file (issue 37)", "[requirements]\ngpus = 4\nspread = true\n",
         words='"gpus": 4, "memory": 0, "keep_gpu": false, "spread": true'),
    Case("GPUPOOL_SPREAD=1 over the file's false", "[requirements]\nspread = false\n",
         env={"GPUPOOL_SPREAD": " on "}, words='"spread": true'),
    Case("GPUPOOL_SPREAD=0 over the file's true", "[requirements]\nspread = true\n",
         env={"GPUPOOL_SPREAD": "0"}, words='"spread": false'),
    Case("spread unset is false", "[requirements]\ngpus = 2\n", words='"spread": false'),
    Case("spread_copy unset is auto", "[requirements]\ngpus = 2\n", words='"spread_copy": "auto"'),
    Case("spread_copy in the file", "[requirements]\nspread_copy = ' client '\n",
         words='"spread_copy": "client"'),
    Case("GPUPOOL_SPREAD_COPY=server over the file's client",
         "[requirements]\nspread_copy = 'client'\n", env={"GPUPOOL_SPREAD_COPY": "server"},
         words='"spread_copy": "server"'),
    Case("GPUPOOL_SPREAD_COPY= (empty) is unset: the file's client stays",
         "[requirements]\nspread_copy = 'client'\n", env={"GPUPOOL_SPREAD_COPY": ""},
         words='"spread_copy": "client"'),
    Case("keep_gpu in the file", "keep_gpu = true\n", words='"keep_gpu": true'),
    Case("GPUPOOL_KEEP_GPU=1 over the file's false", "keep_gpu = false\n",
         env={"GPUPOOL_KEEP_GPU": "1"}, words='"keep_gpu": true'),
    Case("GPUPOOL_KEEP_GPU=0 over the file's true", "keep_gpu = true\n",
         env={"GPUPOOL_KEEP_GPU": "0"}, words='"keep_gpu": false'),
    Case("zero timeouts", "connect_timeout = 0\nprobe_timeout = 0.0\n",
         words='"probe_timeout": 0'),
    Case("a tiny float underflows to zero on both sides", "probe_timeout = 1e-400\n",
         words='"probe_timeout": 0'),
    Case("short form, blank items are unset",
         'servers = [" a ", "", "  ", "tls://b:99"]\ntoken = "t"\n', words='"host": "b"'),
    Case("CRLF, BOM, comments with any bytes",
         b"\xef\xbb\xbfservers = [  # \xff\xfe not UTF-8 in a comment\r\n  'a:1',\r\n]\r\n"
         b"token = 'q'  # \x01\r\n", words='"token": "q"'),
    Case("escapes", 'token = "q\\"b\\\\s\\u00e9\\t"\nservers = ["a"]\n', words="q\\\"b"),
    Case("escaped blanks at the ends are stripped",
         'token = "\\ttok\\n"\nservers = ["a"]\n', words='"token": "tok"'),
    Case("unknown keys and tables warn", "colour = 'blue'\nservers = ['a:1']\n[requirements]\n"
         "vendor = 'x'\n[extra]\nanything = ['goes']\n[[more]]\nx = 1\n[[servers2]]\n",
         words='"a:1"'),
    Case("an unknown table named like a key", "token = 'x'\nservers = ['a']\n[token]\ny = 2\n"
         "[tls]\n", words='"token": "x"'),
    Case("symlinked file: relative paths from the target's folder",
         'tls_ca = "ca.pem"\nservers = ["a"]\n', layout="symlink", words="/real/ca.pem"),
    Case("GPUPOOL_CONFIG with ~/", 'servers = ["a"]\ntls_ca = "~/ca.pem"\n', layout="home",
         env={"GPUPOOL_CONFIG": "~/conf/config.toml"}, words="/home/conf/config.toml"),
    Case("GPUPOOL_CONFIG with blanks", 'servers = ["a"]\n',
         env={"GPUPOOL_CONFIG": "  {tmp}/cfg/config.toml\t"}, words="/cfg/config.toml"),
    Case("the XDG file", 'servers = ["xdg:1"]\n', layout="xdg", env={"GPUPOOL_CONFIG": ""},
         words="xdg:1"),
    Case("a token readable by others under HOME warns", 'token = "gpt_x"\nservers = ["a"]\n',
         layout="home", env={"GPUPOOL_CONFIG": "{home}/conf/config.toml"}, mode=0o644,
         words="gpt_x"),
    Case("a blank token is no token: no mode warning", 'token = "  "\nservers = ["a"]\n',
         layout="home", env={"GPUPOOL_CONFIG": "{home}/conf/config.toml"}, mode=0o644,
         words='"token": ""'),
    # ---------------------------------------------------------------- good environments
    Case("environment with blanks", EXAMPLE, env={
        "GPUPOOL_SERVER": " a:1 ,\ttls://b ,, GPU1.example.com\n", "GPUPOOL_TOKEN": " tok ",
        "GPUPOOL_TLS": " Yes ", "GPUPOOL_TLS_CA": "~/env-ca.pem ",
        "GPUPOOL_TLS_CERT": "rel.pem", "GPUPOOL_TLS_KEY": "\t/k.pem",
        "GPUPOOL_CONNECT_TIMEOUT": " 3 ", "GPUPOOL_PROBE_TIMEOUT": "0.5\t", "GPUPOOL_GPU": " 2 ",
        "GPUPOOL_GPU_MODEL": " A100 ", "GPUPOOL_MIN_MEMORY": " 80G "}, words='"token": "tok"'),
    Case("blank variables are unset", EXAMPLE, env={
        "GPUPOOL_SERVER": "  ", "GPUPOOL_TOKEN": " \t", "GPUPOOL_TLS": " ",
        "GPUPOOL_CONNECT_TIMEOUT": " ", "GPUPOOL_GPU": "", "GPUPOOL_MIN_MEMORY": " "},
        words='"token": "gpt_one"'),
    Case("GPUPOOL_SERVER keeps a file entry's settings", EXAMPLE,
         env={"GPUPOOL_SERVER": "GPU2.EXAMPLE.COM:7071,other:9"}, words="/ca2.pem"),
    Case("GPUPOOL_DEVICE yields to GPUPOOL_GPU with a warning", None,
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_GPU": " 1", "GPUPOOL_DEVICE": "GPU-ab "},
         words='"gpu": "1"'),
    Case("GPUPOOL_DEVICE alone", None, env={"GPUPOOL_SERVER": "a", "GPUPOOL_DEVICE": "GPU-ab"},
         words='"gpu": "GPU-ab"'),
    Case("environment timeouts with a fraction", None,
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_CONNECT_TIMEOUT": "0010.250",
              "GPUPOOL_PROBE_TIMEOUT": "0"}, words='"connect_timeout": 10.25'),
    Case("GPUPOOL_CONFIG=none with blanks", EXAMPLE, env={"GPUPOOL_CONFIG": " none "},
         words='"file": ""'),
    Case("non-ASCII host names, matched by ASCII case only", "[[servers]]\n"
         "address = 'Bücher:1'\ntoken = 'own'\n[[servers]]\naddress = 'ÄB:2'\ntoken = 'two'\n",
         env={"GPUPOOL_SERVER": "bÜcher:1, bücher:1, äb:2, ÄB:2, [fe80::1]:7070"},
         words='"token": "own"'),
    Case("both halves of a client certificate", None,
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS_CERT": "c.pem", "GPUPOOL_TLS_KEY": "k.pem"},
         words='"tls_key": "k.pem"'),
    # ---------------------------------------------------------------- refused
    *[Case(f"GPUPOOL_{which}_TIMEOUT={value!r}", None, expect="error",
           env={"GPUPOOL_SERVER": "a", f"GPUPOOL_{which}_TIMEOUT": value},
           words="is not a number of seconds")
      for which in ("CONNECT", "PROBE")
      for value in ("+5", "1_0", "inf", "nan", "1e3", ".5", "5.", "-1", "0x10", "soon", "١")],
    *[Case(f"file timeout {value}", f"probe_timeout = {value}\n", expect="error",
           words=":1: ") for value in ("inf", "nan", "-1", '"2"', "1__0", "007", "0x10", "1e400",
                                       "true", "1.", ".5", "1_", "+-1")],
    Case("compression = 'lz4'", "compression = ' lz4 '\nservers = ['a']\n",
         words='"compression": "lz4"'),
    Case("compression off by default", "servers = ['a']\n", words='"compression": "off"'),
    Case("GPUPOOL_COMPRESSION over the file", "compression = 'lz4'\nservers = ['a']\n",
         env={"GPUPOOL_COMPRESSION": " off "}, words='"compression": "off"'),
    Case("GPUPOOL_COMPRESSION=lz4", None, env={"GPUPOOL_SERVER": "a", "GPUPOOL_COMPRESSION": "lz4"},
         words='"compression": "lz4"'),
    Case("compression not a known value", "compression = 'zstd'\n", expect="error",
         words='compression = "zstd" is not supported'),
    Case("compression not a string", "compression = true\n", expect="error", words=":1: "),
    # ---------------------------------------------------------------- per-server compression
    Case("per-server compression lz4 under a top level off", TWO_SERVERS.format(
        top="off", near="", far="compression = ' lz4 '"),
        words='"address": "far:2", "host": "far", "port": "2", "tls": true, "token": "", '
              '"tls_ca": "", "tls_cert": "", "tls_key": "", "compression": "lz4"'),
    Case("per-server compression off under a top level lz4", TWO_SERVERS.format(
        top="lz4", near="compression = 'off'", far=""),
        words='"address": "near:1", "host": "near", "port": "1", "tls": true, "token": "", '
              '"tls_ca": "", "tls_cert": "", "tls_key": "", "compression": "off"'),
    # ---------------------------------------------------------------- TLS by default, pins
    Case("TLS is the default", "servers = ['a']\n", words='"tls": true'),
    Case("tls = false at the top level: plain TCP", "tls = false\nservers = ['a']\n",
         words='"tls": false'),
    Case("tls = false for one server", "[[servers]]\naddress = 'a'\ntls = false\n"
         "[[servers]]\naddress = 'b'\n", words='"tls": false, "token": "", "tls_ca": "", '
         '"tls_cert": "", "tls_key": "", "compression": "off", "tls_fingerprint": ""}, '
         '{"address": "b", "host": "b", "port": "7070", "tls": true'),
    Case("GPUPOOL_TLS=0: plain TCP", None, env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS": "0"},
         words='"tls": false'),
    Case("tls:// over GPUPOOL_TLS=0", None, env={"GPUPOOL_SERVER": "tls://a", "GPUPOOL_TLS": "0"},
         words='"tls": true'),
    Case("a server's pin", f"[[servers]]\naddress = 'a'\ntls_fingerprint = ' {PIN_A} '\n",
         words=f'"tls_fingerprint": "{PIN_A}"'),
    Case("GPUPOOL_TLS_FINGERPRINT without a file", None,
         env={"GPUPOOL_SERVER": "a,b", "GPUPOOL_TLS_FINGERPRINT": PIN_B},
         words=f'"tls_fingerprint": "{PIN_B}"}}, {{"address": "b"'),
    Case("GPUPOOL_TLS_FINGERPRINT: not over an entry's own pin",
         f"[[servers]]\naddress = 'a'\ntls_fingerprint = '{PIN_A}'\n[[servers]]\naddress = 'b'\n",
         env={"GPUPOOL_TLS_FINGERPRINT": PIN_B},
         words=f'"tls_fingerprint": "{PIN_A}"}}, {{"address": "b", "host": "b", "port": "7070", '
               f'"tls": true, "token": "", "tls_ca": "", "tls_cert": "", "tls_key": "", '
               f'"compression": "off", "tls_fingerprint": "{PIN_B}"'),
    Case("GPUPOOL_SERVER keeps the file entry's pin",
         f"[[servers]]\naddress = 'a:1'\ntls_fingerprint = '{PIN_A}'\n",
         env={"GPUPOOL_SERVER": "a:1"}, words=f'"tls_fingerprint": "{PIN_A}"'),
    *[Case(f"tls_fingerprint = {bad!r}", f"[[servers]]\naddress = 'a'\ntls_fingerprint = '{bad}'\n",
           expect="error", words="is not a fingerprint: write what `gpupoold fingerprint` prints")
      for bad in (PIN_A[:-1], PIN_A + "A", "sha256:" + PIN_A[7:], "MD5:" + PIN_A[7:],
                  PIN_A[:-1] + "B", PIN_A[:10] + "=" + PIN_A[11:], PIN_A[:-1] + "=")],
    Case("tls_fingerprint not a string", "[[servers]]\naddress = 'a'\ntls_fingerprint = 1\n",
         expect="error", words="tls_fingerprint must be the server's fingerprint in quotes"),
    Case("GPUPOOL_TLS_FINGERPRINT not a fingerprint", None,
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS_FINGERPRINT": "SHA256:abc"}, expect="error",
         words="GPUPOOL_TLS_FINGERPRINT=SHA256:abc is not a fingerprint"),
    Case("GPUPOOL_COMPRESSION=off over every server's own", TWO_SERVERS.format(
        top="lz4", near="compression = 'lz4'", far=""), env={"GPUPOOL_COMPRESSION": " off "},
        words='"compression": "off"'),
    Case("GPUPOOL_COMPRESSION=lz4 over every server's own", TWO_SERVERS.format(
        top="off", near="compression = 'off'", far="compression = 'off'"),
        env={"GPUPOOL_COMPRESSION": "lz4"}, words='"compression": "lz4"'),
    Case("a blank per-server compression is unset", TWO_SERVERS.format(
        top="lz4", near="compression = '  '", far="compression = ''"),
        words='"compression": "lz4"'),
    Case("GPUPOOL_SERVER keeps a file entry's compression", TWO_SERVERS.format(
        top="off", near="", far="compression = 'lz4'"), env={"GPUPOOL_SERVER": "FAR:2,new:3"},
        words='"compression": "lz4"'),
    Case("per-server compression not a known value", TWO_SERVERS.format(
        top="off", near="", far="compression = ' zstd '"), expect="error",
        words=':7: server far:2: compression = "zstd" is not supported: write "off" or "lz4", '
              "or leave it out for the top-level compression"),
    Case("per-server compression not a known value, before the address",
         "[[servers]]\ncompression = 'gzip'\naddress = 'tls://far:2'\n[[servers]]\n"
         "address = 'b'\n", expect="error",
         words=':2: server far:2: compression = "gzip" is not supported'),
    Case("per-server compression refused, no address: the address first",
         "[[servers]]\ncompression = 'gzip'\n", expect="error",
         words=":1: this [[servers]] entry has no address"),
    Case("per-server compression not a string", "[[servers]]\naddress = 'a'\ncompression = 1\n",
         expect="error", words=':3: compression must be "off" or "lz4"'),
    Case("GPUPOOL_COMPRESSION not a known value", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_COMPRESSION": "LZ4"},
         words="GPUPOOL_COMPRESSION=LZ4 is not supported"),
    Case("GPUPOOL_TLS not a word", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS": "maybe"}, words="GPUPOOL_TLS=maybe"),
    Case("GPUPOOL_MIN_MEMORY not a size", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_MIN_MEMORY": " 40X "}, words="not a size"),
    *[Case(f"GPUPOOL_SERVER={value!r}", None, expect="error", env={"GPUPOOL_SERVER": value},
           words="GPUPOOL_SERVER")
      for value in ("a:0", "a:65536", "a:123456", "a:007070", "a:b", "http://a:1", "[::1]", " , ",
                    "a:", "tls://", "a b:1", "a\tb")],
    Case("17 servers in the environment", None, expect="error",
         env={"GPUPOOL_SERVER": ",".join(f"h{i}:1" for i in range(17))}, words="more than 16"),
    Case("a control character in GPUPOOL_TOKEN", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TOKEN": "a\x01b"}, words="control character"),
    Case("a control character in GPUPOOL_TLS_CA", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS_CA": "a\x7fb"}, words="control character"),
    Case("GPUPOOL_GPU too long", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_GPU": "x" * 256}, words="longer than 255"),
    Case("GPUPOOL_TOKEN too long", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TOKEN": "t" * 4097}, words="longer than 4096"),
    Case("a client certificate without its key", "tls_cert = 'c.pem'\nservers = ['a']\n",
         expect="error", words="tls_cert is set but tls_key is not"),
    Case("a key without its certificate (environment)", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_TLS_KEY": "k.pem"}, words="tls_key is set"),
    Case("GPUPOOL_CONFIG missing", None, expect="error",
         env={"GPUPOOL_CONFIG": "{tmp}/missing.toml"}, words="No such file or directory"),
    Case("GPUPOOL_CONFIG a folder", None, expect="error", layout="dir",
         env={"GPUPOOL_CONFIG": "{tmp}/cfg"}, words="is not a regular file"),
    Case("a NUL byte", b"token = 'a'\n\0\n", expect="error", words="NUL byte"),
    Case("invalid UTF-8 in a string", b"token = '\xff'\n", expect="error", words="UTF-8"),
    Case("a control character in a token", 'token = "a\\nb"\n', expect="error",
         words="token contains a control character"),
    Case("gpu negative", "[requirements]\ngpu = -1\n", expect="error", words="gpu must be"),
    Case("keep_gpu a string", "keep_gpu = 'yes'\n", expect="error", words="keep_gpu"),
    Case("spread a number", "[requirements]\nspread = 1\n", expect="error", words=":2: spread"),
    Case("spread_copy not a mode", "[requirements]\nspread_copy = 'peer'\n", expect="error",
         words=':2: spread_copy = "peer" is not understood: write "auto"'),
    Case("GPUPOOL_SPREAD_COPY not a mode", None, env={"GPUPOOL_SPREAD_COPY": "fast"},
         expect="error", words="GPUPOOL_SPREAD_COPY=fast is not understood: use auto"),
    Case("GPUPOOL_SPREAD not a boolean", None, env={"GPUPOOL_SPREAD": "2"},
         expect="error", words="GPUPOOL_SPREAD=2 is not understood: use 1"),
    Case("GPUPOOL_KEEP_GPU not a boolean", None, env={"GPUPOOL_KEEP_GPU": "maybe"},
         expect="error", words="GPUPOOL_KEEP_GPU=maybe is not understood"),
    Case("gpu a boolean", "[requirements]\ngpu = true\n", expect="error", words="gpu must be"),
    Case("gpu too big an integer", "[requirements]\ngpu = 99999999999999999999\n",
         expect="error", words="cannot read the value of gpu"),
    Case("min_memory past int64", "[requirements]\nmin_memory = 9223372036854775808\n",
         expect="error", words="cannot read the value"),
    Case("a number of 101 characters", "probe_timeout = " + "1" * 101 + "\n", expect="error",
         words="cannot read the value"),
    Case("a key of 64 characters", "k" * 64 + " = 1\n", expect="error",
         words="longer than 63 characters"),
    Case("port 0 in the file", "[[servers]]\naddress = 'h:0'\n", expect="error",
         words="'h:0' is not a server address"),
    Case("a comma in an address", "servers = ['a,b']\n", expect="error",
         words="'a,b' is not a server address"),
    Case("a blank address is no address", "[[servers]]\naddress = '  '\n", expect="error",
         words=":1: this [[servers]] entry has no address"),
    Case("the same key twice", "token = 'a'\n# x\ntoken = ''\n", expect="error",
         words=":3: token is set twice"),
    Case("inline table", "x = {a = 1}\n", expect="error", words="inline tables"),
    Case("lone CR", "token = 'a'\rservers = ['b']\n", expect="error",
         words="unexpected text after the value"),
    Case("a CR inside an array", "servers = ['a',\r'b']\n", expect="error",
         words="may only hold strings"),
    Case("[servers] as one table", "[servers]\naddress = 'a'\n", expect="error",
         words="write [[servers]]"),
    Case("both forms", "servers = []\n[[servers]]\naddress = 'b'\n", expect="error",
         words="use one form"),
    Case("17 servers in the file", "".join(f"[[servers]]\naddress = 'h{i}'\n" for i in range(17)),
         expect="error", words=":33: more than 16 servers"),
    Case("bad escape", 'token = "a\\qb"\n', expect="error", words="unsupported escape \\q"),
    Case("min_memory not a size", "[requirements]\nmin_memory = ' lots '\n", expect="error",
         words='min_memory = "lots" is not a size'),
    Case("memory not a size", "[requirements]\nmemory = '8 GiBs'\n", expect="error",
         words='memory = "8 GiBs" is not a size: write bytes or a number with a unit'),
    Case("gpus 0", "[requirements]\ngpus = 0\n", expect="error",
         words=":2: gpus must be a whole number of GPUs from 1 to 64, e.g. gpus = 4"),
    Case("gpus past 64, or a string", "[requirements]\ngpus = '65'\n", expect="error",
         words="gpus must be a whole number of GPUs from 1 to 64"),
    Case("GPUPOOL_GPUS not a number of GPUs", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_GPUS": "65"},
         words="GPUPOOL_GPUS=65 is not a number of GPUs: write a whole number of GPUs from 1 to 64"),
    Case("GPUPOOL_MEMORY not a size", None, expect="error",
         env={"GPUPOOL_SERVER": "a", "GPUPOOL_MEMORY": "lots"},
         words="GPUPOOL_MEMORY=lots is not a size"),
    Case("dotted key", "a.b = 1\n", expect="error", words="dotted keys"),
    Case("a string of 8192 bytes", "token = '" + "x" * 8192 + "'\n", expect="error",
         words="longer than 8191 bytes"),
    Case("a host of 256 bytes", "servers = ['" + "h" * 256 + ":1']\n", expect="error",
         words="is not a server address"),
    Case("65 items in an array", "servers = [" + "'a'," * 65 + "]\n", expect="error",
         words="more than 64 items"),
    Case("a key in an unknown table is skipped, its value is not", "[x]\nk = 0x1\n",
         expect="error", words=":2: cannot read the value of k"),
    Case("a date", "when = 2024-01-01\n", expect="error", words="cannot read the value of when"),
]


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp)).replace("{home}", str(tmp / "home"))


def _setup(case: Case, tmp: Path) -> dict[str, str]:
    """The files of the case under tmp, and its environment."""
    home = tmp / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    target = tmp / "cfg" / "config.toml"
    if case.layout == "symlink":
        target = tmp / "real" / "config.toml"
    elif case.layout == "home":
        target = home / "conf" / "config.toml"
    elif case.layout == "xdg":
        target = tmp / "xdg" / "gpupool" / "config.toml"
        env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    elif case.layout == "dir":
        (tmp / "cfg").mkdir()
    if case.text is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        data = case.text.encode() if isinstance(case.text, str) else case.text
        target.write_bytes(data)
        target.chmod(case.mode)
    config = tmp / "cfg" / "config.toml"
    if case.layout == "symlink":
        config.parent.mkdir()
        config.symlink_to(target)
    env["GPUPOOL_CONFIG"] = str(config) if case.text is not None else "none"
    env.update({k: _fill(v, tmp) for k, v in case.env.items()})
    return env


# Prints what gpupool.config.load gives, as JSON; warnings go to stderr as `gpupool` prints them.
DUMP = """
import json
from gpupool import config as cc
try:
    cfg = cc.load()
except cc.ConfigError as exc:
    print(json.dumps({"ok": False, "error": str(exc)}))
    raise SystemExit(0)
print(json.dumps({"ok": True, "file": cfg.file, "connect_timeout": cfg.connect_timeout,
                  "probe_timeout": cfg.probe_timeout, "gpu": cfg.gpu, "model": cfg.model,
                  "min_memory": cfg.min_memory, "gpus": cfg.gpus, "memory": cfg.memory,
                  "keep_gpu": cfg.keep_gpu, "spread": cfg.spread,
                  "spread_copy": cfg.spread_copy,
                  "compression": cfg.compression,
                  "servers": [{"address": s.address, "host": s.host, "port": s.port,
                               "tls": s.tls, "token": s.token, "tls_ca": s.tls_ca,
                               "tls_cert": s.tls_cert, "tls_key": s.tls_key,
                               "compression": s.compression,
                               "tls_fingerprint": s.tls_fingerprint} for s in cfg.servers]},
                 ensure_ascii=False))
"""


def _read(lib_dir: Path, env: dict[str, str], cwd: Path) -> tuple[dict[str, Any], list[str]]:
    """The case's configuration, read in a process whose environment is the case's (plus where
    the library and the package are; libasan first for the sanitizer build)."""
    run_env = {**env, "GPUPOOL_SHIM_DIR": str(lib_dir), "PYTHONPATH": str(REPO / "client")}
    if lib_dir.parent.name == "build-asan":
        asan = _libasan()
        require(asan is not None, "the sanitizer build needs libasan (cc -print-file-name)")
        run_env.update(LD_PRELOAD=str(asan), ASAN_OPTIONS="detect_leaks=0")
    proc = run_client([sys.executable, "-c", DUMP], env=run_env, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert all(line.startswith("gpupool: ") for line in lines), proc.stderr
    return json.loads(proc.stdout), [line[len("gpupool: "):] for line in lines]


@pytest.fixture(scope="module")
def lib_dir(native_build: Path) -> Path:
    folder = native_build / "client"
    require((folder / cc.CONFIG_LIB_NAME).is_file(), f"{folder / cc.CONFIG_LIB_NAME} not built")
    return folder


@pytest.mark.san
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_case_reads_as_it_says(case: Case, lib_dir: Path, tmp_path: Path) -> None:
    env = _setup(case, tmp_path)
    c, _ = _read(lib_dir, env, tmp_path)
    assert c["ok"] is (case.expect == "ok"), c
    shown = c["error"] if not c["ok"] else json.dumps(c, ensure_ascii=False)
    assert case.words in shown, shown


def test_the_table_says_what_it_means(lib_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A few cases checked for their exact meaning, not only for agreement."""
    by_name = {c.name: c for c in CASES}

    def run(name: str) -> tuple[dict[str, Any], list[str]]:
        case = by_name[name]
        tmp = tmp_path / name.replace(" ", "_").replace("/", "_")
        tmp.mkdir()
        env = _setup(case, tmp)
        monkeypatch.chdir(tmp)
        return _read(lib_dir, env, tmp)

    out, _ = run("blanks around strings, empty means unset")
    folder = os.path.realpath(os.getcwd() + "/cfg")
    one, two = out["servers"]
    assert (one["address"], one["token"], one["tls_ca"]) == ("h:1", "own", f"{folder}/ca.pem")
    assert (two["token"], two["tls_ca"], two["tls_cert"], two["tls_key"]) == (
        "gpt_x", f"{folder}/ca.pem", "/abs/cert.pem", f"{folder}/key.pem")  # "" = the default
    assert (out["gpu"], out["model"], out["min_memory"]) == ("1", "H100", 40 << 30)

    out, _ = run("symlinked file: relative paths from the target's folder")
    real = os.path.realpath(os.getcwd() + "/real")
    assert out["file"].endswith("/cfg/config.toml") and out["servers"][0]["tls_ca"] == \
        f"{real}/ca.pem"

    out, warnings = run("a token readable by others under HOME warns")
    assert len(warnings) == 1 and "(mode 0644): chmod 600" in warnings[0], warnings

    out, warnings = run("unknown keys and tables warn")
    assert len(warnings) == 5, warnings

    def compression(name: str) -> tuple[str, list[str]]:
        out, _ = run(name)
        return out["compression"], [s["compression"] for s in out["servers"]]

    # A server's own compression wins over the top level's, both ways; blank is unset;
    # GPUPOOL_COMPRESSION wins over all; GPUPOOL_SERVER keeps an entry's own.
    assert compression("per-server compression lz4 under a top level off") == ("off",
                                                                               ["off", "lz4"])
    assert compression("per-server compression off under a top level lz4") == ("lz4",
                                                                               ["off", "lz4"])
    assert compression("a blank per-server compression is unset") == ("lz4", ["lz4", "lz4"])
    assert compression("GPUPOOL_COMPRESSION=off over every server's own") == ("off",
                                                                              ["off", "off"])
    assert compression("GPUPOOL_COMPRESSION=lz4 over every server's own") == ("lz4",
                                                                              ["lz4", "lz4"])
    assert compression("GPUPOOL_SERVER keeps a file entry's compression") == ("off",
                                                                              ["lz4", "off"])

    out, warnings = run("GPUPOOL_DEVICE yields to GPUPOOL_GPU with a warning")
    assert warnings == ["GPUPOOL_DEVICE=GPU-ab ignored: GPUPOOL_GPU=1 is set (GPUPOOL_DEVICE is "
                        "its old name)"]


def test_what_login_writes_reads_back(lib_dir: Path, tmp_path: Path) -> None:
    """`gpupool login` writes the file with config.write_file: the reader takes it back."""
    data = {"token": 'q"uote\\back é', "tls": True, "connect_timeout": 2.5, "probe_timeout": 3,
            "requirements": {"gpu": 1, "model": "A100", "min_memory": "40GiB"},
            "servers": [{"address": "tls://h:1", "token": "t1"}, {"address": "g"}]}
    path = tmp_path / "sub" / "config.toml"
    cc.write_file(path, data)
    env = {"HOME": str(tmp_path), "GPUPOOL_CONFIG": str(path), "PATH": "/usr/bin:/bin"}
    c, warnings = _read(lib_dir, env, tmp_path)
    assert warnings == []
    assert c["ok"] and c["gpu"] == "1" and c["min_memory"] == 40 << 30
    assert [s["token"] for s in c["servers"]] == ["t1", data["token"]]
    assert [s["tls"] for s in c["servers"]] == [True, True]
    assert c["connect_timeout"] == 2.5 and c["probe_timeout"] == 3
