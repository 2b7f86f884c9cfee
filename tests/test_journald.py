"""gpupoold under systemd, for real: run as a transient unit with the restart settings of
systemd/gpupoold.service, a configuration error leaves the unit failed with status 78 after one
try, `journalctl -p err` finds gpupoold's error, and gpupoold's records reach the journal with
their priority and the fields it indexes (`journalctl GPUPOOL_LEASE=7`).

systemd is not PID 1 on these machines (nor on most CI runners), and booting it as PID 1 in a
PID namespace is no way out: it runs the machine's units, and its tmpfiles step empties the
machine's /tmp. So the test runs systemd's own programs where they need no booted system: in a
private mount and PID namespace (tmpfs over /run/systemd, /run/log, /run/user and /var/log: the
machine's journal, its files and its services are never touched; every process dies with the
namespace), it starts systemd-journald and a systemd service manager (`systemd --user`, with a
unit path holding only an empty default.target, in a cgroup of its own that the test removes
afterwards), then starts gpupoold with `systemd-run --user` as a transient service: systemd
connects its output to journald and sets $JOURNAL_STREAM exactly as for the packaged unit.
A second unit exiting 1 under the same settings is restarted: the control that shows status 78
is what stops the restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, daemon_env, require

JOURNALD = Path("/lib/systemd/systemd-journald")
SYSTEMD = Path("/lib/systemd/systemd")
UNIT = REPO / "systemd" / "gpupoold.service"

GPUPOOLD = "from gpupoold.cli import main; raise SystemExit(main())"
LOGS = """
import logging
from gpupoold.log import journal_fields, setup_logging
setup_logging("info")
log = logging.getLogger("gpupoold.leases")
log.info("lease 7 ended (client exit): GPU 0", extra=journal_fields(7, 0, "alice@laptop pid 42"))
log.error("GPU 0 QUARANTINED: test. Investigate", extra=journal_fields(gpu=0))
try:
    raise ValueError("two\\nlines")
except ValueError:
    log.exception("lease 8: recording its end failed", extra=journal_fields(8))
"""

SCENARIO = r"""
set -euo pipefail
# The manager and its services go into a cgroup of their own (cpuset needs CPUs set: left alone).
for h in "${CGROUPS[@]}"; do mkdir -p "$h" && echo $$ > "$h/cgroup.procs"; done
mount -t tmpfs tmpfs /run/systemd
mkdir -p /run/systemd/journal /run/systemd/system  # system/: what sd_booted() looks for
mkdir -p /run/log && mount -t tmpfs tmpfs /run/log
mount -t tmpfs tmpfs /var/log && mkdir -p /var/log/journal
mkdir -p /run/user && mount -t tmpfs tmpfs /run/user && mkdir -m 700 /run/user/0
export XDG_RUNTIME_DIR=/run/user/0 HOME="$WORK/home" SYSTEMD_UNIT_PATH="$WORK/units"
"$JOURNALD" &
for _ in $(seq 200); do [[ -S /run/systemd/journal/socket ]] && break; sleep 0.05; done
"$SYSTEMD" --user > "$WORK/manager.log" 2>&1 &
for _ in $(seq 200); do [[ -S $XDG_RUNTIME_DIR/systemd/private ]] && break; sleep 0.05; done
start() {
    systemd-run --user --quiet --unit="$1" -p DefaultDependencies=no -p Restart="$RESTART" \
        -p RestartSec=0.2 -p RestartPreventExitStatus="$PREVENT" \
        --setenv=PYTHONPATH="$PYTHONPATH" "${@:2}"
}
start gp-config "$PY" -c "$GPUPOOLD" serve --config "$BAD"
start gp-retry /bin/sh -c "exit 1"
start gp-logs "$PY" -c "$LOGS"
for _ in $(seq 100); do  # until gp-config failed and gp-retry was restarted twice
    systemctl --user is-failed --quiet gp-config && \
        (( $(systemctl --user show -P NRestarts gp-retry) >= 2 )) && break
    sleep 0.1
done
for u in gp-config gp-retry; do
    echo "$u $(systemctl --user show -p ActiveState -p Result -p ExecMainStatus -p NRestarts $u | xargs)"
done
journalctl --sync
echo "--- err"
journalctl --no-pager -o json -p err
echo "--- lease 7"
journalctl --no-pager -o json GPUPOOL_LEASE=7
"""


def unit_setting(name: str) -> str:
    """A [Service] setting of the packaged unit (one source for what a failure does)."""
    values = [line.split("=", 1)[1].strip() for line in UNIT.read_text().splitlines()
              if line.startswith(f"{name}=")]
    assert len(values) == 1, f"{UNIT}: {name}= set {len(values)} times"
    return values[0]


def cgroups_for(name: str) -> list[Path]:
    """A cgroup named `name` in every hierarchy the manager may use (cgroup v1 or v2)."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.procs").exists():  # v2: one hierarchy
        return [root / name]
    return [h / name for h in sorted(root.iterdir())
            if (h / "cgroup.procs").exists() and not h.name.startswith("cpuset") and not h.is_symlink()]


def remove_cgroups(paths: list[Path]) -> None:
    for top in paths:
        if top.exists():
            for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(d)


def entries(section: str) -> list[dict]:
    return [json.loads(line) for line in section.strip().splitlines() if line.startswith("{")]


def test_gpupoold_as_a_transient_unit_under_systemd(tmp_path):
    require(os.geteuid() == 0, "needs root (private mount and PID namespaces, cgroups)")
    for tool in ("unshare", "systemd-run", "systemctl", "journalctl"):
        require(shutil.which(tool) is not None, f"{tool} not found (Debian: util-linux, systemd)")
    for prog in (JOURNALD, SYSTEMD):
        require(prog.exists(), f"{prog} not found (Debian package systemd)")
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "default.target").write_text("[Unit]\nDescription=nothing else\n")
    (tmp_path / "home").mkdir()
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nbogus = 1\n")
    script = tmp_path / "scenario.sh"
    cgroups = cgroups_for(f"gpupool-test-{os.getpid()}-{tmp_path.name}")
    script.write_text(f"CGROUPS=({' '.join(shlex.quote(str(c)) for c in cgroups)})\n" + SCENARIO)
    env = daemon_env({"PY": sys.executable, "GPUPOOLD": GPUPOOLD, "LOGS": LOGS, "BAD": str(bad),
                      "JOURNALD": str(JOURNALD), "SYSTEMD": str(SYSTEMD), "WORK": str(tmp_path),
                      "RESTART": unit_setting("Restart"),
                      "PREVENT": unit_setting("RestartPreventExitStatus")})
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
                               "--mount-proc", "bash", str(script)],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        remove_cgroups(cgroups)
    manager = (tmp_path / "manager.log").read_text() if (tmp_path / "manager.log").exists() else ""
    out = f"{proc.stdout}\n--- stderr\n{proc.stderr}\n--- manager\n{manager}"
    assert proc.returncode == 0, out
    head, _, rest = proc.stdout.partition("--- err")
    err_part, _, lease_part = rest.partition("--- lease 7")

    # The configuration error: the unit failed with status 78 after one try; the control unit,
    # exiting 1 under the same settings, was restarted.
    units = {ln.split()[0]: dict(kv.split("=", 1) for kv in ln.split()[1:])
             for ln in head.splitlines() if ln.startswith("gp-")}
    assert units["gp-config"] == {"ActiveState": "failed", "Result": "exit-code",
                                  "ExecMainStatus": "78", "NRestarts": "0"}, out
    assert units["gp-retry"]["ExecMainStatus"] == "1" and int(units["gp-retry"]["NRestarts"]) >= 2, out
    # `journalctl -p err` finds gpupoold's error, from the unit's stream.
    errors = entries(err_part)
    config = [e for e in errors if "unknown setting 'server'" in e.get("MESSAGE", "")]
    assert len(config) == 1 and config[0]["PRIORITY"] == "3", errors
    assert config[0]["MESSAGE"].startswith("gpupoold: error: ")
    # (journald names the unit by its cgroup: _SYSTEMD_UNIT here, where the manager's cgroup is
    # not under a user slice.)
    assert "gp-config.service" in (config[0].get("_SYSTEMD_UNIT"), config[0].get("_SYSTEMD_USER_UNIT"))
    # Records logged by the daemon's logging go over the native protocol with their fields; a
    # traceback stays one entry.
    quarantine = [e for e in errors if "QUARANTINED" in e.get("MESSAGE", "")]
    assert len(quarantine) == 1, errors
    assert quarantine[0]["_TRANSPORT"] == "journal" and quarantine[0]["GPUPOOL_GPU"] == "0"
    assert quarantine[0]["MESSAGE"] == "gpupoold.leases: GPU 0 QUARANTINED: test. Investigate"
    assert quarantine[0]["SYSLOG_IDENTIFIER"] == "gpupoold"
    failed = [e for e in errors if "recording its end failed" in e.get("MESSAGE", "")]
    assert len(failed) == 1 and failed[0]["GPUPOOL_LEASE"] == "8", errors
    assert "Traceback" in failed[0]["MESSAGE"] and "ValueError: two\nlines" in failed[0]["MESSAGE"]
    # Informational records are not errors, and carry their lease, GPU and client.
    assert not any("lease 7 ended" in e.get("MESSAGE", "") for e in errors)
    lease = entries(lease_part)
    assert len(lease) == 1, lease_part
    assert lease[0]["PRIORITY"] == "6" and lease[0]["GPUPOOL_GPU"] == "0"
    assert lease[0]["GPUPOOL_CLIENT"] == "alice@laptop pid 42"
    assert lease[0]["GPUPOOL_LOGGER"] == "gpupoold.leases"
