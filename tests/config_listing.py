"""One check of the packaged default config (packaging/debian/gpupoold.toml), used on the source
file by tests/test_config.py (fast, every run) and on the copy inside the built .deb by
tests/test_debs.py: every setting is listed, commented out, with its default and a line that
explains it, and the file stays valid with every line uncommented."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gpupoold.config.file import load_settings
from gpupoold.config.settings import Settings, settings_info


def check_lists_every_setting(text: str, scratch: Path) -> None:
    assert tomllib.loads(text) == {}, "every setting is commented out"
    lines = dict(re.findall(r"^# (\w+) = (.+)$", text, re.M))
    defaults = Settings()
    for info in settings_info():
        assert info.name in lines, f"setting {info.name} is missing from packaging/debian/gpupoold.toml"
        if info.default is not None:
            value = tomllib.loads(f"v = {lines[info.name]}")["v"]
            want = getattr(defaults, info.name)
            assert (Path(value) if isinstance(want, Path) else value) == want, \
                f"{info.name}: the config shows {lines[info.name]}, the default is {info.default_text()}"
        comment = text.split(f"\n# {info.name} = ")[0].rsplit("\n", 1)[-1]
        assert comment.startswith("# ") and len(comment) > 10, f"{info.name} has no explanation line"
    # with every line uncommented the file is still valid (the examples too)
    uncommented = scratch / "all.toml"
    uncommented.write_text("\n".join(f"{k} = {v}" for k, v in lines.items()) + "\n")
    load_settings(uncommented)
