#!/usr/bin/env python3
"""Generate the gpupool wire protocol code from protocol/gpupool.toml.

Outputs (all marked DO NOT EDIT with the spec's SHA-256):
  protocol/generated/gp_protocol.h   C declarations: ops, structs, encode/decode prototypes
  protocol/generated/gp_protocol.c   C encoders/decoders with full length checks
  protocol/python/gpupool_protocol/_generated.py   the same for Python (its runtime, by hand,
                                                    is gpupool_protocol/runtime.py beside it)
  protocol/golden/samples.hex        a sample of every message body, encoded by the Python side,
                                     that the C tests must reproduce byte for byte
  worker/generated/                  the worker's handler prototypes, dispatch table and driver
                                     function list (gen_worker.py beside this file)

The generator stops at the first error in the spec: a half-generated protocol is worse than none.
Usage: gen_protocol.py [--spec PATH] [--out-dir ROOT] [--cuda-symbols FILE]
  ROOT defaults to the repository root; FILE (libcuda's exports, which the worker's driver
  functions must come from) to client/shim/generated/gp_symbols.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import keyword
import re
import struct
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gen_worker import WorkerSpecError, generate_worker

REPO = Path(__file__).resolve().parent.parent
CUDA_SYMBOLS = REPO / "client" / "shim" / "generated" / "gp_symbols.txt"

SCALARS: dict[str, tuple[str, str, int]] = {
    # type: (C type, struct format, size)
    "u8": ("uint8_t", "B", 1),
    "u16": ("uint16_t", "H", 2),
    "u32": ("uint32_t", "I", 4),
    "u64": ("uint64_t", "Q", 8),
    "i32": ("int32_t", "i", 4),
    "i64": ("int64_t", "q", 8),
    "f32": ("float", "f", 4),
    "f64": ("double", "d", 8),
}
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
C_KEYWORDS = {"int", "char", "float", "double", "long", "short", "default", "register", "auto"}


class SpecError(Exception):
    pass


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # scalar | bytes | string | blob | array | bulk | record | records
    scalar: str = ""  # scalar type (for scalar and array)
    size: int = 0  # bytes:N size, or max length / count
    record: str = ""  # record, records: the record's name
    members: tuple[Field, ...] = ()  # record, records: its fields

    @property
    def fixed_size(self) -> int:
        if self.kind == "scalar":
            return SCALARS[self.scalar][2]
        if self.kind == "bytes":
            return self.size
        if self.kind in ("string", "blob", "array", "records"):
            return 4
        if self.kind == "record":
            return sum(m.fixed_size for m in self.members)
        return 8  # bulk: the u64 length

    @property
    def worst_size(self) -> int:
        """The most bytes this field can take in a body."""
        if self.kind in ("string", "blob"):
            return 4 + self.size
        if self.kind == "array":
            return 4 + self.size * SCALARS[self.scalar][2]
        if self.kind == "record":
            return sum(m.worst_size for m in self.members)
        if self.kind == "records":
            return 4 + self.size * sum(m.worst_size for m in self.members)
        return self.fixed_size


@dataclass(frozen=True)
class Record:
    """A named group of fields that messages embed (`record:NAME`): encoded as its fields in
    order, with no header of its own."""
    name: str
    doc: str
    fields: tuple[Field, ...]


@dataclass(frozen=True)
class Message:
    id: int
    name: str
    doc: str
    fields: tuple[Field, ...]
    reply: tuple[Field, ...] | None
    call_class: str | None = None  # the worker serves it (gen_worker.py); None: it does not
    group: str | None = None  # served: its API group, the worker's h_<group>.c


def parse_field(text: str, where: str, records: dict[str, Record] | None = None) -> Field:
    parts = text.split()
    if len(parts) != 2:
        raise SpecError(f"{where}: field {text!r} must be 'TYPE NAME'")
    typ, name = parts
    if not NAME_RE.match(name) or name in C_KEYWORDS or keyword.iskeyword(name):
        raise SpecError(f"{where}: bad field name {name!r}")
    if typ in SCALARS:
        return Field(name, "scalar", typ)
    pieces = typ.split(":")
    try:
        if pieces[0] == "bytes" and len(pieces) == 2:
            return Field(name, "bytes", size=int(pieces[1]))
        if pieces[0] in ("string", "blob") and len(pieces) == 2:
            return Field(name, pieces[0], size=int(pieces[1]))
        if pieces[0] == "array" and len(pieces) == 3 and pieces[1] in SCALARS:
            return Field(name, "array", scalar=pieces[1], size=int(pieces[2]))
        if typ == "bulk":
            return Field(name, "bulk")
        if pieces[0] in ("record", "records") and len(pieces) == (2 if pieces[0] == "record"
                                                                   else 3):
            rec = (records or {}).get(pieces[1])
            if rec is None:
                raise SpecError(f"{where}: no [[record]] named {pieces[1]!r} (records are "
                                "declared before the messages that use them)")
            size = int(pieces[2]) if pieces[0] == "records" else 0
            return Field(name, pieces[0], record=rec.name, members=rec.fields, size=size)
    except ValueError as exc:
        raise SpecError(f"{where}: bad size in {typ!r}") from exc
    raise SpecError(f"{where}: unknown type {typ!r}")


def parse_fields(items: list[str], where: str, max_body: int,
                 records: dict[str, Record] | None = None) -> tuple[Field, ...]:
    fields = tuple(parse_field(t, where, records) for t in items)
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise SpecError(f"{where}: duplicate field names")
    if "result" in names:
        raise SpecError(f"{where}: 'result' is implicit in replies")
    bulks = [i for i, f in enumerate(fields) if f.kind == "bulk"]
    if len(bulks) > 1 or (bulks and bulks[0] != len(fields) - 1):
        raise SpecError(f"{where}: at most one bulk field, and it must be last")
    worst = sum(f.worst_size for f in fields)
    if worst > max_body:
        raise SpecError(f"{where}: worst-case body {worst} exceeds max_body {max_body}")
    for f in fields:
        if f.kind in ("bytes", "string", "blob", "array", "records") and f.size <= 0:
            raise SpecError(f"{where}: field {f.name} needs a positive size")
    return fields


def load_spec(path: Path) -> tuple[dict, dict[str, int], set[int], list[Message]]:
    """(protocol table, every code by name, the informational codes, messages by id)."""
    raw = path.read_bytes()
    spec = tomllib.loads(raw.decode())
    proto = spec.get("protocol")
    if not isinstance(proto, dict):
        raise SpecError("missing [protocol] table")
    for key in ("magic", "major", "minor", "max_body", "header_size"):
        if not isinstance(proto.get(key), int):
            raise SpecError(f"[protocol] needs integer {key}")
    if proto["header_size"] != 16:
        raise SpecError("header_size must be 16 (u32 len, u16 op, u16 flags, u64 req)")
    consts = spec.get("constants", {})
    for name, value in consts.items():
        if not name.startswith("GP_") or not isinstance(value, int) or isinstance(value, bool):
            raise SpecError(f"[constants] {name}: names start with GP_ and values are integers")
    proto = {**proto, "constants": dict(consts)}
    results = spec.get("results", {})
    for name, value in results.items():
        if not name.startswith("GP_E") or not isinstance(value, int) or value < 100000:
            raise SpecError(f"[results] {name}: names start with GP_E and values are >= 100000")
    if len(set(results.values())) != len(results):
        raise SpecError("[results] values must be unique")
    # Informational notice codes share the name table and the number space of the results (a
    # client looks a code up in one place) but are never errors.
    info = spec.get("notice_codes", {})
    for name, value in info.items():
        if not name.startswith("GP_INFO_") or not isinstance(value, int) or value < 100100:
            raise SpecError(f"[notice_codes] {name}: names start with GP_INFO_ and values are "
                            ">= 100100")
    if len(set(info.values())) != len(info) or set(info.values()) & set(results.values()):
        raise SpecError("[notice_codes] values must be unique and distinct from [results]")
    records: dict[str, Record] = {}
    for i, r in enumerate(spec.get("record", [])):
        where = f"record #{i} ({r.get('name', '?')})"
        unknown = set(r) - {"name", "doc", "fields"}
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)}")
        name = r.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name) or name in records:
            raise SpecError(f"{where}: bad or duplicate name")
        fields = parse_fields(r.get("fields", []), where, proto["max_body"])
        if not fields or any(f.kind in ("bulk", "record", "records") for f in fields):
            raise SpecError(f"{where}: a record has fields, and no bulk or record among them")
        records[name] = Record(name, str(r.get("doc", "")).strip(), fields)
    proto["records"] = records
    messages = []
    seen_ids: set[int] = set()
    seen_names: set[str] = set()
    for i, m in enumerate(spec.get("message", [])):
        where = f"message #{i} ({m.get('name', '?')})"
        unknown = set(m) - {"id", "name", "doc", "fields", "reply", "call_class", "group"}
        if unknown:
            raise SpecError(f"{where}: unknown keys {sorted(unknown)}")
        mid, name = m.get("id"), m.get("name")
        if not isinstance(mid, int) or not 1 <= mid <= 0xFFFF:
            raise SpecError(f"{where}: id must be an integer in 1..65535")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise SpecError(f"{where}: bad name")
        if mid in seen_ids or name in seen_names:
            raise SpecError(f"{where}: duplicate id or name")
        seen_ids.add(mid)
        seen_names.add(name)
        fields = parse_fields(m.get("fields", []), where, proto["max_body"], records)
        reply = None
        if "reply" in m:
            reply = parse_fields(m["reply"], where + " reply", proto["max_body"], records)
        call_class, group = m.get("call_class"), m.get("group")
        if (call_class is None) != (group is None):
            raise SpecError(f"{where}: a message the worker serves has call_class and group, "
                            "any other neither")
        if call_class is not None and not (isinstance(call_class, str) and isinstance(group, str)
                                           and NAME_RE.match(group)):
            raise SpecError(f"{where}: call_class and group are names")
        messages.append(Message(mid, name, str(m.get("doc", "")).strip(), fields, reply,
                                call_class, group))
    if not messages:
        raise SpecError("no messages")
    used = {f.record for m in messages for f in (*m.fields, *(m.reply or ())) if f.record}
    if set(records) - used:
        raise SpecError(f"records no message uses: {sorted(set(records) - used)}")
    messages.sort(key=lambda msg: msg.id)
    return proto, {**results, **info}, set(info.values()), messages


# ------------------------------------------------------------------------------ sample values
def sample_value(f: Field, k: int, mid: int) -> object:
    """Deterministic sample values shared by the Python and C golden tests."""
    if f.kind == "scalar":
        if f.scalar in ("f32", "f64"):
            return k + 1.5
        bits = SCALARS[f.scalar][2] * 8
        v = (mid * 131 + (k + 1) * 0x01010101) & ((1 << bits) - 1)
        if f.scalar.startswith("i"):
            v = v if v < (1 << (bits - 1)) else v - (1 << bits)
            v = -v if k % 2 else v
        return v
    if f.kind == "bytes":
        return bytes(((k + 1) * (j + 3)) & 0xFF for j in range(f.size))
    if f.kind == "string":
        return f"s{k}-{f.name}"
    if f.kind == "blob":
        return bytes((mid + j * 7) & 0xFF for j in range(k + 3))
    if f.kind == "array":
        return [k, k + 1, k + 2]
    return 5 + k  # bulk length


# ------------------------------------------------------------------------------ C generation
def c_struct_members(fields: tuple[Field, ...], with_result: bool) -> list[str]:
    out = ["    int32_t result;"] if with_result else []
    for f in fields:
        if f.kind == "scalar":
            out.append(f"    {SCALARS[f.scalar][0]} {f.name};")
        elif f.kind == "bytes":
            out.append(f"    uint8_t {f.name}[{f.size}];")
        elif f.kind == "string":
            out.append(f"    const char *{f.name}; /* not NUL-terminated; <= {f.size} */")
            out.append(f"    uint32_t {f.name}_len;")
        elif f.kind == "blob":
            out.append(f"    const uint8_t *{f.name}; /* <= {f.size} bytes */")
            out.append(f"    uint32_t {f.name}_len;")
        elif f.kind == "array":
            out.append(f"    const uint8_t *{f.name}; /* {f.scalar} x count, little-endian */")
            out.append(f"    uint32_t {f.name}_count; /* <= {f.size} */")
        elif f.kind == "record":
            out.append(f"    gp_{f.record} {f.name};")
        elif f.kind == "records":
            out.append(f"    gp_record_span {f.name}; /* decoded: <= {f.size} records, read them "
                       f"with gp_{f.record}_next */")
            out.append(f"    const gp_{f.record} *{f.name}_items; /* to encode: {f.name}.count "
                       "records (NULL: re-encode the decoded span) */")
        else:
            out.append(f"    uint64_t {f.name}_len; /* raw bytes that follow the body */")
    if not out:
        out.append("    uint8_t unused_; /* no fields */")
    return out


def c_size_expr(fields: tuple[Field, ...], with_result: bool) -> str:
    fixed = (4 if with_result else 0) + sum(f.fixed_size for f in fields
                                            if f.kind not in ("record", "records"))
    parts = [str(fixed)]
    for f in fields:
        if f.kind in ("string", "blob"):
            parts.append(f"(size_t)m->{f.name}_len")
        elif f.kind == "array":
            parts.append(f"(size_t)m->{f.name}_count * {SCALARS[f.scalar][2]}")
        elif f.kind == "record":
            parts.append(f"gp_{f.record}_size_(&m->{f.name})")
        elif f.kind == "records":
            parts.append(f"gp_{f.record}_span_size_(&m->{f.name}, m->{f.name}_items)")
    return " + ".join(parts)


def c_encode_body(fields: tuple[Field, ...], with_result: bool) -> list[str]:
    out = []
    if with_result:
        out.append("    gp_wr_u32(p, (uint32_t)m->result); p += 4;")
    for f in fields:
        if f.kind == "scalar":
            t = f.scalar
            if t in ("f32", "f64"):
                bits = "32" if t == "f32" else "64"
                out.append(f"    {{ uint{bits}_t b; memcpy(&b, &m->{f.name}, sizeof b); "
                           f"gp_wr_u{bits}(p, b); p += {SCALARS[t][2]}; }}")
            elif t == "u8":
                out.append(f"    *p++ = m->{f.name};")
            else:
                bits = t[1:]
                out.append(f"    gp_wr_u{bits}(p, (uint{bits}_t)m->{f.name}); p += {int(bits)//8};")
        elif f.kind == "bytes":
            out.append(f"    memcpy(p, m->{f.name}, {f.size}); p += {f.size};")
        elif f.kind in ("string", "blob"):
            out.append(f"    gp_wr_u32(p, m->{f.name}_len); p += 4;")
            out.append(f"    if (m->{f.name}_len) memcpy(p, m->{f.name}, m->{f.name}_len);")
            out.append(f"    p += m->{f.name}_len;")
        elif f.kind == "array":
            sz = SCALARS[f.scalar][2]
            out.append(f"    gp_wr_u32(p, m->{f.name}_count); p += 4;")
            out.append(f"    if (m->{f.name}_count) memcpy(p, m->{f.name}, "
                       f"(size_t)m->{f.name}_count * {sz});")
            out.append(f"    p += (size_t)m->{f.name}_count * {sz};")
        elif f.kind == "record":
            out.append(f"    p = gp_{f.record}_put_(p, &m->{f.name});")
        elif f.kind == "records":
            out.append(f"    p = gp_{f.record}_span_put_(p, &m->{f.name}, m->{f.name}_items);")
        else:
            out.append(f"    gp_wr_u64(p, m->{f.name}_len); p += 8;")
    return out


def c_decode_body(fields: tuple[Field, ...], with_result: bool, whole: bool = True) -> list[str]:
    """The decoding statements; whole: the body ends after these fields (a message), else a
    record within one (the caller goes on from p)."""
    out = []

    def need(n: str) -> None:
        out.append(f"    if ((size_t)(end - p) < (size_t)({n})) return GP_PROTO_EMALFORMED;")

    if with_result:
        need("4")
        out.append("    m->result = (int32_t)gp_rd_u32(p); p += 4;")
    for f in fields:
        if f.kind == "scalar":
            t = f.scalar
            sz = SCALARS[t][2]
            need(str(sz))
            if t in ("f32", "f64"):
                bits = "32" if t == "f32" else "64"
                out.append(f"    {{ uint{bits}_t b = gp_rd_u{bits}(p); memcpy(&m->{f.name}, &b, "
                           f"sizeof b); p += {sz}; }}")
            elif t == "u8":
                out.append(f"    m->{f.name} = *p++;")
            else:
                out.append(f"    m->{f.name} = ({SCALARS[t][0]})gp_rd_u{t[1:]}(p); p += {sz};")
        elif f.kind == "bytes":
            need(str(f.size))
            out.append(f"    memcpy(m->{f.name}, p, {f.size}); p += {f.size};")
        elif f.kind in ("string", "blob"):
            need("4")
            out.append(f"    m->{f.name}_len = gp_rd_u32(p); p += 4;")
            out.append(f"    if (m->{f.name}_len > {f.size}u) return GP_PROTO_EMALFORMED;")
            need(f"m->{f.name}_len")
            ctype = "const char *" if f.kind == "string" else "const uint8_t *"
            out.append(f"    m->{f.name} = ({ctype})p; p += m->{f.name}_len;")
        elif f.kind == "array":
            sz = SCALARS[f.scalar][2]
            need("4")
            out.append(f"    m->{f.name}_count = gp_rd_u32(p); p += 4;")
            out.append(f"    if (m->{f.name}_count > {f.size}u) return GP_PROTO_EMALFORMED;")
            need(f"(size_t)m->{f.name}_count * {sz}")
            out.append(f"    m->{f.name} = p; p += (size_t)m->{f.name}_count * {sz};")
        elif f.kind == "record":
            out.append(f"    {{ int rc_ = gp_{f.record}_get_(&p, end, &m->{f.name}); "
                       "if (rc_ != 0) return rc_; }")
        elif f.kind == "records":
            out.append(f"    {{ int rc_ = gp_{f.record}_span_get_(&p, end, {f.size}u, "
                       f"&m->{f.name}); if (rc_ != 0) return rc_; }}")
        else:
            need("8")
            out.append(f"    m->{f.name}_len = gp_rd_u64(p); p += 8;")
    if whole:
        out.append("    return p == end ? 0 : GP_PROTO_ETRAILING;")
    return out


def c_sample_body(fields: tuple[Field, ...], with_result: bool, mid: int,
                  acc: str = "m->") -> list[str]:
    out = ["    memset(m, 0, sizeof *m);"] if acc == "m->" else []
    if with_result:
        out.append("    m->result = -7;")
    for k, f in enumerate(fields):
        if f.kind == "record":
            out += c_sample_body(f.members, False, mid, f"{acc}{f.name}.")
            continue
        if f.kind == "records":  # two records with the same sample values
            out.append(f"    {{ static gp_{f.record} items[2];")
            out.append("      memset(items, 0, sizeof items);")
            for i in (0, 1):
                out += c_sample_body(f.members, False, mid, f"items[{i}].")
            out.append(f"      {acc}{f.name}_items = items; {acc}{f.name}.count = 2; }}")
            continue
        v = sample_value(f, k, mid)
        if f.kind == "scalar":
            if f.scalar in ("f32", "f64"):
                out.append(f"    {acc}{f.name} = {v!r};")
            elif f.scalar.startswith("i"):
                out.append(f"    {acc}{f.name} = ({SCALARS[f.scalar][0]})({v}LL);")
            else:
                out.append(f"    {acc}{f.name} = ({SCALARS[f.scalar][0]}){v}ULL;")
        elif f.kind == "bytes":
            assert isinstance(v, bytes)
            out.append(f"    for (int j = 0; j < {f.size}; j++) "
                       f"{acc}{f.name}[j] = (uint8_t)(({k + 1} * (j + 3)) & 0xFF);")
        elif f.kind == "string":
            out.append(f'    {acc}{f.name} = "{v}"; {acc}{f.name}_len = {len(str(v))};')
        elif f.kind == "blob":
            assert isinstance(v, bytes)
            arr = ", ".join(str(b) for b in v)
            out.append(f"    {{ static const uint8_t d[] = {{{arr}}}; {acc}{f.name} = d; "
                       f"{acc}{f.name}_len = {len(v)}; }}")
        elif f.kind == "array":
            sz = SCALARS[f.scalar][2]
            data = b"".join(struct.pack("<" + SCALARS[f.scalar][1], x) for x in v)  # type: ignore[union-attr]
            arr = ", ".join(str(b) for b in data)
            out.append(f"    {{ static const uint8_t d[] = {{{arr}}}; {acc}{f.name} = d; "
                       f"{acc}{f.name}_count = {len(data) // sz}; }}")
        else:
            out.append(f"    {acc}{f.name}_len = {v};")
    return out


def gen_c(proto: dict, results: dict[str, int], info: set[int], messages: list[Message],
          digest: str) -> tuple[str, str]:
    banner = (f"/* GENERATED by protocol/gen_protocol.py from protocol/gpupool.toml "
              f"(sha256 {digest}). DO NOT EDIT. */\n")
    h: list[str] = [banner, "#ifndef GP_PROTOCOL_H", "#define GP_PROTOCOL_H", "",
                    "#include <stddef.h>", "#include <stdint.h>", "#include <string.h>", ""]
    h += [
        f"#define GP_PROTO_MAGIC 0x{proto['magic']:08x}u",
        f"#define GP_PROTO_MAJOR {proto['major']}",
        f"#define GP_PROTO_MINOR {proto['minor']}",
        f"#define GP_PROTO_MAX_BODY {proto['max_body']}u",
        "#define GP_PROTO_HEADER_SIZE 16",
        f'#define GP_PROTO_SPEC_SHA256 "{digest}"',
        "#define GP_FLAG_REPLY 0x1",
        "/* Decoders return 0, or one of these. With GP_PROTO_ETRAILING every known field was",
        " * decoded and more bytes follow them: the fields a newer minor version appended, which a",
        " * reader may ignore (docs/protocol.md, \"Versioning\"); anywhere else it is malformed. */",
        "#define GP_PROTO_EMALFORMED (-1)",
        "#define GP_PROTO_ETRAILING (-2)",
        "",
    ]
    h += [f"#define {n} {v}" for n, v in proto["constants"].items()]
    for name, value in sorted(results.items(), key=lambda kv: kv[1]):
        h.append(f"#define {name} {value}")
    h += ["", "enum gp_op {"]
    for m in messages:
        h.append(f"    GP_OP_{m.name.upper()} = {m.id},")
    h += ["};", ""]
    h += [
        "typedef struct gp_frame_header {",
        "    uint32_t len;   /* body bytes, excluding bulk data */",
        "    uint16_t op;",
        "    uint16_t flags;",
        "    uint64_t req;",
        "} gp_frame_header;",
        "",
        "static inline void gp_wr_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; "
        "p[1] = (uint8_t)(v >> 8); }",
        "static inline void gp_wr_u32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) "
        "p[i] = (uint8_t)(v >> (8 * i)); }",
        "static inline void gp_wr_u64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) "
        "p[i] = (uint8_t)(v >> (8 * i)); }",
        "static inline uint16_t gp_rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | "
        "(p[1] << 8)); }",
        "static inline uint32_t gp_rd_u32(const uint8_t *p) { uint32_t v = 0; "
        "for (int i = 3; i >= 0; i--) v = (v << 8) | p[i]; return v; }",
        "static inline uint64_t gp_rd_u64(const uint8_t *p) { uint64_t v = 0; "
        "for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; return v; }",
        "/* Element i of a decoded array field. */",
        "static inline uint32_t gp_arr_u32(const uint8_t *a, uint32_t i) "
        "{ return gp_rd_u32(a + 4 * (size_t)i); }",
        "static inline int32_t gp_arr_i32(const uint8_t *a, uint32_t i) "
        "{ return (int32_t)gp_rd_u32(a + 4 * (size_t)i); }",
        "static inline uint64_t gp_arr_u64(const uint8_t *a, uint32_t i) "
        "{ return gp_rd_u64(a + 8 * (size_t)i); }",
        "",
        "static inline void gp_header_encode(uint8_t out[16], const gp_frame_header *h) {",
        "    gp_wr_u32(out, h->len); gp_wr_u16(out + 4, h->op); gp_wr_u16(out + 6, h->flags);",
        "    gp_wr_u64(out + 8, h->req);",
        "}",
        "static inline void gp_header_decode(const uint8_t in[16], gp_frame_header *h) {",
        "    h->len = gp_rd_u32(in); h->op = gp_rd_u16(in + 4); h->flags = gp_rd_u16(in + 6);",
        "    h->req = gp_rd_u64(in + 8);",
        "}",
        "",
        "/* Name of an op (\"?\" if unknown), and whether requests with it are answered. */",
        "const char *gp_op_name(unsigned op);",
        "int gp_op_known(unsigned op);",
        "int gp_op_has_reply(unsigned op);",
        "/* Name of a GP_E* result or GP_INFO_* notice code, or NULL. */",
        "const char *gp_result_name(int code);",
        "/* 1 for an informational notice code (GP_INFO_*): print it, never record it as an error. */",
        "int gp_code_is_info(int code);",
        "",
    ]
    arrays = {f.record for m in messages for f in (*m.fields, *(m.reply or ()))
              if f.kind == "records"}
    h += ["/* An array of records as decoded: `count` records, encoded from p to end, checked by the",
          " * message's decoder; read them with gp_<record>_next (which advances p and count). */",
          "typedef struct gp_record_span {",
          "    const uint8_t *p, *end;",
          "    uint32_t count;",
          "} gp_record_span;", ""]
    for r in proto["records"].values():
        h.append(f"/* ---- record {r.name}{': ' + r.doc.splitlines()[0] if r.doc else ''} */")
        h.append(f"typedef struct gp_{r.name} {{")
        h += c_struct_members(r.fields, False)
        h.append(f"}} gp_{r.name};")
        if r.name in arrays:
            h.append("/* The next record of a decoded span into out (its strings point into the "
                     "body): 0, or -1 when none is left. */")
            h.append(f"int gp_{r.name}_next(gp_record_span *s, gp_{r.name} *out);")
        h.append("")
    c: list[str] = [banner, '#include "gp_protocol.h"', ""]
    for r in proto["records"].values():
        rn = f"gp_{r.name}"
        c.append(f"static size_t {rn}_size_(const {rn} *m) {{")
        c.append("    (void)m;")
        c.append(f"    return {c_size_expr(r.fields, False)};\n}}\n")
        c.append(f"static uint8_t *{rn}_put_(uint8_t *p, const {rn} *m) {{")
        c += c_encode_body(r.fields, False)
        c.append("    return p;\n}\n")
        c.append(f"static int {rn}_get_(const uint8_t **pp, const uint8_t *end, {rn} *m) {{")
        c.append("    const uint8_t *p = *pp;")
        c += c_decode_body(r.fields, False, whole=False)
        c.append("    *pp = p;\n    return 0;\n}\n")
        if r.name not in arrays:
            continue
        # Arrays of the record: a count, then the records; decoded as a checked span.
        c.append(f"static size_t {rn}_span_size_(const gp_record_span *s, const {rn} *items) {{")
        c.append("    size_t n = 4;")
        c.append("    if (!items) return n + (size_t)(s->end - s->p);")
        c.append(f"    for (uint32_t i = 0; i < s->count; i++) n += {rn}_size_(&items[i]);")
        c.append("    return n;\n}\n")
        c.append(f"static uint8_t *{rn}_span_put_(uint8_t *p, const gp_record_span *s, "
                 f"const {rn} *items) {{")
        c.append("    gp_wr_u32(p, s->count); p += 4;")
        c.append("    if (!items) {")
        c.append("        if (s->end > s->p) memcpy(p, s->p, (size_t)(s->end - s->p));")
        c.append("        return p + (s->end - s->p);\n    }")
        c.append(f"    for (uint32_t i = 0; i < s->count; i++) p = {rn}_put_(p, &items[i]);")
        c.append("    return p;\n}\n")
        c.append(f"static int {rn}_span_get_(const uint8_t **pp, const uint8_t *end, "
                 "uint32_t max, gp_record_span *s) {")
        c.append("    const uint8_t *p = *pp;")
        c.append("    if ((size_t)(end - p) < 4) return GP_PROTO_EMALFORMED;")
        c.append("    s->count = gp_rd_u32(p); p += 4;")
        c.append("    if (s->count > max) return GP_PROTO_EMALFORMED;")
        c.append("    s->p = p;")
        c.append("    for (uint32_t i = 0; i < s->count; i++) {")
        c.append(f"        {rn} tmp;")
        c.append(f"        int rc = {rn}_get_(&p, end, &tmp);")
        c.append("        if (rc != 0) return GP_PROTO_EMALFORMED;\n    }")
        c.append("    s->end = p;\n    *pp = p;\n    return 0;\n}\n")
        c.append(f"int {rn}_next(gp_record_span *s, {rn} *out) {{")
        c.append("    if (s->count == 0) return -1;")
        c.append("    const uint8_t *p = s->p;")
        c.append(f"    if ({rn}_get_(&p, s->end, out) != 0) return -1;")
        c.append("    s->p = p; s->count--;\n    return 0;\n}\n")
    c.append("const char *gp_op_name(unsigned op) {\n    switch (op) {")
    for m in messages:
        c.append(f'    case {m.id}: return "{m.name}";')
    c.append('    default: return "?";\n    }\n}\n')
    c.append("int gp_op_known(unsigned op) { return gp_op_name(op)[0] != '?'; }\n")
    c.append("int gp_op_has_reply(unsigned op) {\n    switch (op) {")
    for m in messages:
        if m.reply is not None:
            c.append(f"    case {m.id}:")
    c.append("        return 1;\n    default: return 0;\n    }\n}\n")
    c.append("const char *gp_result_name(int code) {\n    switch (code) {")
    for name, value in sorted(results.items(), key=lambda kv: kv[1]):
        c.append(f'    case {value}: return "{name}";')
    c.append("    default: return NULL;\n    }\n}\n")
    c.append("int gp_code_is_info(int code) {\n    switch (code) {")
    for value in sorted(info):
        c.append(f"    case {value}:")
    if info:
        c.append("        return 1;")
    c.append("    default: return 0;\n    }\n}\n")

    for m in messages:
        parts = [("", m.fields, False)]
        if m.reply is not None:
            parts.append(("_reply", m.reply, True))
        h.append(f"/* ---- {m.name} (op {m.id}){': ' + m.doc.splitlines()[0] if m.doc else ''} */")
        for suffix, fields, with_result in parts:
            sname = f"gp_{m.name}{suffix}"
            h.append(f"typedef struct {sname} {{")
            h += c_struct_members(fields, with_result)
            h.append(f"}} {sname};")
            h.append(f"size_t {sname}_size(const {sname} *m);")
            h.append(f"size_t {sname}_encode(uint8_t *out, const {sname} *m);")
            h.append(f"int {sname}_decode(const uint8_t *in, size_t len, {sname} *m);")
            h.append(f"/* Header + body into out (which holds 16 + {sname}_size(m) bytes). */")
            h.append(f"size_t {sname}_frame(uint8_t *out, uint64_t req, const {sname} *m);")
            h.append(f"void {sname}_sample({sname} *m); /* golden-test values */")
            c.append(f"size_t {sname}_size(const {sname} *m) {{")
            c.append("    (void)m;")
            c.append(f"    return {c_size_expr(fields, with_result)};\n}}\n")
            c.append(f"size_t {sname}_encode(uint8_t *out, const {sname} *m) {{")
            c.append("    uint8_t *p = out;")
            c.append("    (void)m;")
            c += c_encode_body(fields, with_result)
            c.append("    return (size_t)(p - out);\n}\n")
            c.append(f"int {sname}_decode(const uint8_t *in, size_t len, {sname} *m) {{")
            c.append("    const uint8_t *p = in, *end = in + len;")
            c.append("    memset(m, 0, sizeof *m);")
            c += c_decode_body(fields, with_result)
            c.append("}\n")
            flags = "GP_FLAG_REPLY" if with_result else "0"
            c.append(f"size_t {sname}_frame(uint8_t *out, uint64_t req, const {sname} *m) {{")
            c.append(f"    gp_frame_header hd = {{(uint32_t){sname}_size(m), {m.id}, {flags}, req}};")
            c.append("    gp_header_encode(out, &hd);")
            c.append(f"    return 16 + {sname}_encode(out + 16, m);\n}}\n")
            c.append(f"void {sname}_sample({sname} *m) {{")
            c += c_sample_body(fields, with_result, m.id)
            c.append("}\n")
        h.append("")
    # A table for the golden test: encode every sample.
    h.append("/* Golden-test support: encode the sample, decode bytes, decode+re-encode. */")
    h.append("typedef struct gp_sample_entry {")
    h.append("    const char *name;")
    h.append("    size_t (*enc)(uint8_t *out, size_t cap);")
    h.append("    int (*dec)(const uint8_t *in, size_t len);")
    h.append("    int (*rt)(const uint8_t *in, size_t len, uint8_t *out, size_t *outlen);")
    h.append("} gp_sample_entry;")
    h.append("extern const gp_sample_entry gp_samples[];")
    h.append(f"#define GP_SAMPLE_COUNT {sum(2 if m.reply is not None else 1 for m in messages)}")
    h += ["", "#endif /* GP_PROTOCOL_H */", ""]
    for m in messages:
        for suffix in ("", "_reply") if m.reply is not None else ("",):
            sname = f"gp_{m.name}{suffix}"
            c.append(f"static size_t sample_{sname}(uint8_t *out, size_t cap) {{")
            c.append(f"    {sname} m; {sname}_sample(&m);")
            c.append(f"    if ({sname}_size(&m) > cap) return 0;")
            c.append(f"    return {sname}_encode(out, &m);\n}}")
            c.append(f"static int dec_{sname}(const uint8_t *in, size_t len) {{")
            c.append(f"    {sname} m;\n    return {sname}_decode(in, len, &m);\n}}")
            c.append(f"static int rt_{sname}(const uint8_t *in, size_t len, uint8_t *out, "
                     "size_t *outlen) {")
            c.append(f"    {sname} m;\n    if ({sname}_decode(in, len, &m) != 0) return -1;")
            c.append(f"    *outlen = {sname}_encode(out, &m);\n    return 0;\n}}")
    c.append("const gp_sample_entry gp_samples[] = {")
    for m in messages:
        for suffix in ("", "_reply") if m.reply is not None else ("",):
            sn = f"gp_{m.name}{suffix}"
            c.append(f'    {{"{m.name}{suffix}", sample_{sn}, dec_{sn}, rt_{sn}}},')
    c.append("};\n")
    return "\n".join(h), "\n".join(c)


# ------------------------------------------------------------------------------ Python generation
# __eq__ and __repr__ of every generated class (messages and records), by their __slots__.
PY_EQ_REPR = [
    "    def __eq__(self, other: object) -> bool:",
    "        return type(self) is type(other) and all(",
    "            getattr(self, s) == getattr(other, s) for s in self.__slots__)",
    "",
    "    def __repr__(self) -> str:",
    "        inner = ', '.join(f'{s}={getattr(self, s)!r}' for s in self.__slots__)",
    "        return f'{type(self).__name__}({inner})'",
    "",
]


def py_record_name(record: str) -> str:
    return "".join(p.capitalize() for p in record.split("_"))


def py_record_class(r: Record) -> list[str]:
    cls = py_record_name(r.name)
    out = [f"class {cls}:"]
    out.append(f'    """record {r.name}: {r.doc.splitlines()[0] if r.doc else r.name}"""')
    out.append("")
    out.append(f"    __slots__ = ({', '.join(repr(f.name) for f in r.fields)},)")
    out.append("")
    params = ", ".join(f"{f.name}: {py_type(f)} = {py_default(f)}" for f in r.fields)
    out.append(f"    def __init__(self, {params}) -> None:")
    for f in r.fields:
        out.append(f"        self.{f.name} = {f.name}")
    out.append("")
    out += PY_EQ_REPR
    out.append("    def _put(self, w: _Writer) -> None:")
    for f in r.fields:
        out.append(f"        w.{f.kind}({py_enc_args(f)})")
    out.append("")
    out.append("    @classmethod")
    out.append(f"    def _get(cls, r: _Reader) -> {cls!r}:")
    args = ", ".join(f"{f.name}=r.{f.kind}({py_dec_args(f)})" for f in r.fields)
    out.append(f"        return cls({args})")
    out.append("")
    out.append("")
    return out


def py_sample(f: Field, k: int, mid: int) -> str:
    if f.kind == "records":
        one = py_sample(Field(f.name, "record", record=f.record, members=f.members), k, mid)
        return f"[{one}, {one}]"
    if f.kind == "record":
        inner = ", ".join(f"{g.name}={py_sample(g, j, mid)}" for j, g in enumerate(f.members))
        return f"{py_record_name(f.record)}({inner})"
    return repr(sample_value(f, k, mid))


def py_class(cls: str, m: Message, fields: tuple[Field, ...], with_result: bool,
             is_reply: bool) -> list[str]:
    allf = ([Field("result", "scalar", "i32")] if with_result else []) + list(fields)
    out = [f"class {cls}:"]
    doc = m.doc.splitlines()[0] if m.doc else m.name
    out.append(f'    """{m.name}{" reply" if is_reply else ""} (op {m.id}): {doc}"""')
    out.append("")
    out.append(f"    OP = {m.id}")
    out.append(f"    NAME = {m.name!r}")
    out.append(f"    IS_REPLY = {is_reply}")
    out.append(f"    __slots__ = ({', '.join(repr(f.name) for f in allf)}{',' if allf else ''})")
    out.append("")
    params = ", ".join(f"{f.name}: {py_type(f)} = {py_default(f)}" for f in allf)
    out.append(f"    def __init__(self{', ' if params else ''}{params}) -> None:")
    for f in allf:
        if f.kind == "record":
            out.append(f"        self.{f.name} = {py_record_name(f.record)}() if {f.name} is None "
                       f"else {f.name}")
        elif f.kind in ("records", "array"):
            out.append(f"        self.{f.name} = list({f.name})  # decode gives a list too")
        else:
            out.append(f"        self.{f.name} = {f.name}")
    if not allf:
        out.append("        pass")
    out.append("")
    out += PY_EQ_REPR
    out.append("    def encode(self) -> bytes:")
    out.append("        w = _Writer()")
    for f in allf:
        if f.kind == "record":
            out.append(f"        self.{f.name}._put(w)")
        else:
            out.append(f"        w.{f.kind}({py_enc_args(f)})")
    out.append("        return w.getvalue()")
    out.append("")
    out.append("    @classmethod")
    out.append(f"    def decode(cls, body: bytes, allow_trailing: bool = False) -> {cls!r}:")
    out.append('        """allow_trailing: ignore bytes after the known fields (a newer minor '
               'version\'s)."""')
    out.append("        r = _Reader(body)")
    args = ", ".join(f"{f.name}={py_record_name(f.record)}._get(r)" if f.kind == "record"
                     else f"{f.name}=r.{f.kind}({py_dec_args(f)})" for f in allf)
    out.append(f"        msg = cls({args})")
    out.append("        if not allow_trailing:")
    out.append("            r.finish()")
    out.append("        return msg")
    out.append("")
    out.append("    @classmethod")
    out.append(f"    def sample(cls) -> {cls!r}:")
    vals = []
    if with_result:
        vals.append("result=-7")
    for k, f in enumerate(fields):
        vals.append(f"{f.name}={py_sample(f, k, m.id)}")
    out.append(f"        return cls({', '.join(vals)})")
    out.append("")
    out.append("")
    return out


def py_type(f: Field) -> str:
    if f.kind == "record":
        return f"{py_record_name(f.record)} | None"
    if f.kind == "records":
        return f"list[{py_record_name(f.record)}]"
    if f.kind == "scalar":
        return "float" if f.scalar.startswith("f") else "int"
    return {"bytes": "bytes", "string": "str", "blob": "bytes", "array": "list[int]",
            "bulk": "int"}[f.kind]


def py_default(f: Field) -> str:
    if f.kind == "record":
        return "None"
    if f.kind == "records":
        return "()"
    if f.kind == "scalar":
        return "0.0" if f.scalar.startswith("f") else "0"
    if f.kind == "bytes":
        return f"bytes({f.size})"
    return {"string": "''", "blob": "b''", "array": "()", "bulk": "0"}[f.kind]  # type: ignore[return-value]


def py_enc_args(f: Field) -> str:
    if f.kind == "records":
        return f"self.{f.name}, {f.size}"
    if f.kind == "scalar":
        return f"{SCALARS[f.scalar][1]!r}, self.{f.name}"
    if f.kind == "array":
        return f"{SCALARS[f.scalar][1]!r}, self.{f.name}, {f.size}"
    if f.kind == "bulk":
        return f"self.{f.name}"
    return f"self.{f.name}, {f.size}"


def py_dec_args(f: Field) -> str:
    if f.kind == "records":
        return f"{py_record_name(f.record)}, {f.size}"
    if f.kind == "scalar":
        return f"{SCALARS[f.scalar][1]!r}"
    if f.kind == "array":
        return f"{SCALARS[f.scalar][1]!r}, {f.size}"
    if f.kind == "bulk":
        return ""
    return str(f.size)




def gen_py(proto: dict, results: dict[str, int], info: set[int], messages: list[Message],
           digest: str) -> str:
    out = [
        f"# GENERATED by protocol/gen_protocol.py from protocol/gpupool.toml (sha256 {digest}).",
        "# DO NOT EDIT.",
        "# ruff: noqa",
        '"""Message classes of the gpupool wire protocol (see protocol/gpupool.toml)."""',
        "",
        "from __future__ import annotations",
        "",
        "# The hand-written runtime these classes encode and decode with.",
        "from gpupool_protocol.runtime import (FLAG_REPLY, HEADER, HEADER_SIZE, ProtocolError,",
        "                                      Reader as _Reader, Writer as _Writer)",
        "",
        f"MAGIC = 0x{proto['magic']:08x}",
        f"MAJOR = {proto['major']}",
        f"MINOR = {proto['minor']}",
        f"MAX_BODY = {proto['max_body']}",
        f"SPEC_SHA256 = {digest!r}",
        "",
    ]
    out += [f"{n} = {v}" for n, v in proto["constants"].items()]
    for name, value in sorted(results.items(), key=lambda kv: kv[1]):
        out.append(f"{name} = {value}")
    out.append("")
    for r in proto["records"].values():
        out += py_record_class(r)
    requests, replies = [], []
    for m in messages:
        cls = "".join(p.capitalize() for p in m.name.split("_"))
        out += py_class(cls, m, m.fields, False, False)
        requests.append((m.id, cls))
        if m.reply is not None:
            out += py_class(cls + "Reply", m, m.reply, True, True)
            replies.append((m.id, cls + "Reply"))
    out.append("REQUESTS: dict[int, type] = {")
    out += [f"    {i}: {c}," for i, c in requests]
    out.append("}")
    out.append("REPLIES: dict[int, type] = {")
    out += [f"    {i}: {c}," for i, c in replies]
    out.append("}")
    out.append("RESULT_NAMES: dict[int, str] = {")
    for name, value in sorted(results.items(), key=lambda kv: kv[1]):
        out.append(f"    {value}: {name!r},")
    out.append("}")
    out.append("# Informational notice codes: printed by the client, never an error.")
    codes = ", ".join(map(str, sorted(info)))
    out.append(f"INFO_CODES: frozenset[int] = frozenset({{{codes}}})" if info
               else "INFO_CODES: frozenset[int] = frozenset()")
    out.append("")
    return "\n".join(out)


def gen_golden(py_source: str, messages: list[Message]) -> str:
    # The generated module imports its runtime (gpupool_protocol/runtime.py): from this checkout.
    python_dir = str(Path(__file__).resolve().parent / "python")
    if python_dir not in sys.path:
        sys.path.insert(0, python_dir)
    ns: dict[str, object] = {}
    exec(compile(py_source, "<generated>", "exec"), ns)  # noqa: S102 - our own generated code
    lines = ["# GENERATED by protocol/gen_protocol.py: sample bodies encoded by the Python side."]
    for m in messages:
        cls = "".join(p.capitalize() for p in m.name.split("_"))
        lines.append(f"{m.name} {ns[cls].sample().encode().hex()}")  # type: ignore[attr-defined]
        if m.reply is not None:
            lines.append(f"{m.name}_reply {ns[cls + 'Reply'].sample().encode().hex()}")
    return "\n".join(lines) + "\n"


def generate(spec_path: Path, cuda_symbols: Path = CUDA_SYMBOLS) -> dict[str, str]:
    """Return {relative output path: content}."""
    digest = hashlib.sha256(spec_path.read_bytes()).hexdigest()
    proto, results, info, messages = load_spec(spec_path)
    try:
        worker = generate_worker(tomllib.loads(spec_path.read_text()), messages, digest,
                                 cuda_symbols)
    except WorkerSpecError as exc:
        raise SpecError(str(exc)) from exc
    h, c = gen_c(proto, results, info, messages, digest)
    py = gen_py(proto, results, info, messages, digest)
    return {
        "protocol/generated/gp_protocol.h": h,
        "protocol/generated/gp_protocol.c": c,
        "protocol/python/gpupool_protocol/_generated.py": py,
        "protocol/golden/samples.hex": gen_golden(py, messages),
        **worker,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=REPO / "protocol" / "gpupool.toml")
    ap.add_argument("--out-dir", type=Path, default=REPO)
    ap.add_argument("--cuda-symbols", type=Path, default=CUDA_SYMBOLS)
    args = ap.parse_args()
    try:
        outputs = generate(args.spec, args.cuda_symbols)
    except (SpecError, tomllib.TOMLDecodeError) as exc:
        print(f"gen_protocol: error: {exc}", file=sys.stderr)
        return 1
    for rel, content in outputs.items():
        path = args.out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"gen_protocol: wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
