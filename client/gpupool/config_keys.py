"""The keys of the client configuration file, as the reader declares them: its key table
(client/common/client_config_keys.c), asked through libgpupool-config.so. One table, three
readers: the reader itself, `gpupool config --help` (help_text) and the key table of
docs/client-configuration.md (markdown_table; `python -m gpupool.config_keys` prints it, and
tests/test_client_config_keys.py fails when the page differs).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from gpupool.shim import ShimNotFound, config_library

FIELDS = ("name", "table", "type", "values", "default", "env", "doc")
TABLE_HEADERS = {"": "", "requirements": "[requirements]", "servers": "[[servers]]"}


@dataclass(frozen=True)
class ConfigKey:
    """One entry of the key table (the C struct gp_config_key)."""

    name: str
    table: str  # "" (the top level), "requirements" or "servers"
    type: str
    values: str
    default: str
    env: str  # the GPUPOOL_* variable over it, "" for none
    doc: str

    @property
    def where(self) -> str:
        """Where the key is written: "top level", "[requirements]", "[[servers]]"."""
        return TABLE_HEADERS[self.table] or "top level"


def config_keys() -> list[ConfigKey]:
    """The key table, in the reader's order. Raises ShimNotFound (no library) or OSError (it
    does not load)."""
    lib = ctypes.CDLL(str(config_library()))
    lib.gpupool_config_key_count.restype = ctypes.c_size_t
    lib.gpupool_config_key_count.argtypes = []
    lib.gpupool_config_key_field.restype = ctypes.c_char_p
    lib.gpupool_config_key_field.argtypes = [ctypes.c_size_t, ctypes.c_char_p]
    keys = []
    for i in range(lib.gpupool_config_key_count()):
        values = []
        for field in FIELDS:
            raw = lib.gpupool_config_key_field(i, field.encode())
            if raw is None:  # a bug of ours: the library and this module disagree
                raise AssertionError(f"libgpupool-config.so: key {i} has no field {field!r}")
            values.append(raw.decode())
        keys.append(ConfigKey(*values))
    return keys


def markdown_table(keys: list[ConfigKey]) -> str:
    """The key table of docs/client-configuration.md."""
    lines = ["| key | where | type | values | default | variable | what |",
             "|---|---|---|---|---|---|---|"]
    for k in keys:
        env = f"`{k.env}`" if k.env else ""
        lines.append(f"| `{k.name}` | {k.where} | {k.type} | {k.values} | {k.default} | {env} "
                     f"| {k.doc} |")
    return "\n".join(lines) + "\n"


def help_text() -> str:
    """The keys for `gpupool config --help`: one line each, with its variable; a line saying why
    not when the library cannot be asked."""
    try:
        keys = config_keys()
    except (ShimNotFound, OSError) as exc:
        return f"The keys of the file: docs/client-configuration.md ({exc})."
    width = max(len(_written(k)) for k in keys)
    lines = ["The keys of the file (docs/client-configuration.md), with the variable over each:"]
    for k in keys:
        env = f" ({k.env})" if k.env else ""
        lines.append(f"  {_written(k):<{width}}  {k.doc}{env}")
    return "\n".join(lines)


def _written(k: ConfigKey) -> str:
    header = TABLE_HEADERS[k.table]
    return f"{header} {k.name}" if header else k.name


if __name__ == "__main__":
    print(markdown_table(config_keys()), end="")
