"""gpupoold's logging against a real journald: `journalctl -p err` finds gpupoold's errors, and
its records carry the fields the journal indexes (`journalctl GPUPOOL_LEASE=7`).

systemd is not PID 1 on these machines (nor on most CI runners), so gpupoold cannot run as a
unit here. What systemd does for a unit's logging is reproduced with systemd's own programs: the
test starts systemd-journald in a private mount namespace (tmpfs over /run/systemd, /run/log and
/var/log: the machine's journal and its files are never touched), connects gpupoold's stdout and
stderr to it with systemd-cat (the stream protocol systemd uses for a service, with level
prefixes on), sets $JOURNAL_STREAM as systemd does for a service, and reads the result back with
journalctl. The exit status 78 of a configuration error, with `RestartPreventExitStatus=78` in
systemd/gpupoold.service (tests/test_systemd_units.py), is what leaves the unit failed after one
try (systemd.service(5)); the status itself is checked here too.

(Booting systemd itself in a PID namespace is no substitute: it runs the machine's units, and
its tmpfiles step empties the machine's /tmp.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, daemon_env, require

JOURNALD = Path("/lib/systemd/systemd-journald")

# As systemd does for a service whose stderr is the journal: $JOURNAL_STREAM = "DEV:INODE" of it.
AS_SERVICE = ("import os, sys; st = os.fstat(2); "
              "os.environ['JOURNAL_STREAM'] = f'{st.st_dev}:{st.st_ino}'; "
              "os.execv(sys.argv[1], sys.argv[1:])")
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
mount -t tmpfs tmpfs /run/systemd
mkdir -p /run/systemd/journal
mkdir -p /run/log && mount -t tmpfs tmpfs /run/log
mount -t tmpfs tmpfs /var/log
mkdir -p /var/log/journal
"$JOURNALD" &
jp=$!
trap 'kill $jp 2>/dev/null; wait $jp 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    [[ -S /run/systemd/journal/stdout && -S /run/systemd/journal/socket ]] && break
    sleep 0.05
done
set +e
systemd-cat -t gpupoold "$PY" -c "$AS_SERVICE" "$PY" -c "$GPUPOOLD" serve --config "$BAD"
echo "config-exit=$?"
set -e
systemd-cat -t gpupoold "$PY" -c "$AS_SERVICE" "$PY" -c "$LOGS"
journalctl --sync
echo "--- err"
journalctl --no-pager -o json -p err
echo "--- lease 7"
journalctl --no-pager -o json GPUPOOL_LEASE=7
"""


def entries(section: str) -> list[dict]:
    return [json.loads(line) for line in section.strip().splitlines() if line.startswith("{")]


def test_errors_and_fields_reach_a_real_journald(tmp_path):
    require(os.geteuid() == 0, "needs root (a private mount namespace for journald)")
    for tool in ("unshare", "systemd-cat", "journalctl"):
        require(shutil.which(tool) is not None, f"{tool} not found (Debian: util-linux, systemd)")
    require(JOURNALD.exists(), f"{JOURNALD} not found (Debian package systemd)")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nbogus = 1\n")
    script = tmp_path / "scenario.sh"
    script.write_text(SCENARIO)
    env = daemon_env({"PY": sys.executable, "AS_SERVICE": AS_SERVICE, "GPUPOOLD": GPUPOOLD,
                      "LOGS": LOGS, "BAD": str(bad), "JOURNALD": str(JOURNALD)})
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", str(script)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    head, _, rest = proc.stdout.partition("--- err")
    err_part, _, lease_part = rest.partition("--- lease 7")

    # A configuration error: status 78, and its line is an error in the journal.
    assert "config-exit=78" in head, out
    errors = [e for e in entries(err_part) if e.get("SYSLOG_IDENTIFIER") == "gpupoold"]
    config = [e for e in errors if "unknown setting 'server'" in e["MESSAGE"]]
    assert len(config) == 1 and config[0]["PRIORITY"] == "3", errors
    assert config[0]["MESSAGE"].startswith("gpupoold: error: ")
    # Errors logged by the daemon, sent over the native protocol with their fields; the
    # traceback stays one entry.
    quarantine = [e for e in errors if "QUARANTINED" in e["MESSAGE"]]
    assert len(quarantine) == 1, errors
    assert quarantine[0]["_TRANSPORT"] == "journal" and quarantine[0]["GPUPOOL_GPU"] == "0"
    assert quarantine[0]["MESSAGE"] == "gpupoold.leases: GPU 0 QUARANTINED: test. Investigate"
    failed = [e for e in errors if "recording its end failed" in e["MESSAGE"]]
    assert len(failed) == 1 and failed[0]["GPUPOOL_LEASE"] == "8", errors
    assert "Traceback" in failed[0]["MESSAGE"] and "ValueError: two\nlines" in failed[0]["MESSAGE"]
    # Informational records are not errors, and carry their lease, GPU and client.
    assert not any("lease 7 ended" in e["MESSAGE"] for e in errors)
    lease = entries(lease_part)
    assert len(lease) == 1, lease_part
    assert lease[0]["PRIORITY"] == "6" and lease[0]["GPUPOOL_GPU"] == "0"
    assert lease[0]["GPUPOOL_CLIENT"] == "alice@laptop pid 42"
    assert lease[0]["SYSLOG_IDENTIFIER"] == "gpupoold" and lease[0]["GPUPOOL_LOGGER"] == "gpupoold.leases"
