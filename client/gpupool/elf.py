"""The exported symbols of a shared library, read from its ELF file without loading it (to tell
our shims from NVIDIA's libraries, also in a --root tree of another machine)."""

from __future__ import annotations

import struct
from pathlib import Path

SHT_DYNSYM = 11
SHN_UNDEF = 0


class NotElf(ValueError):
    pass


def exported_symbols(path: str | Path) -> set[str]:
    """Names of the symbols the library defines in .dynsym. NotElf when it is not an ELF
    shared object this reader understands (32/64-bit, little-endian, with section headers)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise NotElf(f"{path} is not an ELF file")
    klass, order = data[4], data[5]
    if order != 1 or klass not in (1, 2):
        raise NotElf(f"{path}: not a little-endian ELF32/ELF64 file")
    wide = klass == 2
    try:
        if wide:
            shoff, = struct.unpack_from("<Q", data, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
            sh_fmt, sym_fmt = "<IIQQQQIIQQ", "<IBBHQQ"
        else:
            shoff, = struct.unpack_from("<I", data, 0x20)
            shentsize, shnum = struct.unpack_from("<HH", data, 0x2E)
            sh_fmt, sym_fmt = "<IIIIIIIIII", "<IIIBBH"
        sections = [struct.unpack_from(sh_fmt, data, shoff + i * shentsize)
                    for i in range(shnum)]
    except struct.error:
        raise NotElf(f"{path}: truncated ELF headers") from None
    if not sections:
        raise NotElf(f"{path} has no section headers")
    names: set[str] = set()
    sym_size = struct.calcsize(sym_fmt)
    for sh in sections:
        if sh[1] != SHT_DYNSYM:
            continue
        offset, size, link = sh[4], sh[5], sh[6]
        if link >= len(sections):
            raise NotElf(f"{path}: bad .dynsym string table link")
        str_off, str_size = sections[link][4], sections[link][5]
        strtab = data[str_off:str_off + str_size]
        for pos in range(offset, offset + size - sym_size + 1, sym_size):
            fields = struct.unpack_from(sym_fmt, data, pos)
            st_name = fields[0]
            shndx = fields[3] if wide else fields[5]
            if shndx == SHN_UNDEF or st_name == 0:
                continue
            end = strtab.find(b"\0", st_name)
            names.add(strtab[st_name:end if end >= 0 else None].decode(errors="replace"))
    return names
