"""The daemon's limit of open files (descriptors), raised at start as far as it may go.

Every client connection costs gpupoold a descriptor while it is in its handshake or in the
queue, every lease a few more (its worker's pipes and socket), every HTTP connection one. The
soft limit most systems start a service with is 1,024; the unit sets `LimitNOFILE=65536`
(systemd/gpupoold.service), and `raise_open_files_limit` lifts the soft limit to the hard one,
which any process may do. A hard limit under `LOW` is logged with what to do about it
(docs/operator-guide.md, "Open files").
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("gpupoold")

LOW = 4096  # below this hard limit, a flood of connections could still use every descriptor
WANTED = 65536  # what the unit sets (LimitNOFILE=)


def raise_open_files_limit() -> tuple[int, int]:
    """Set the soft RLIMIT_NOFILE to the hard one; (soft, hard) after it. Logs the result."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, WANTED)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target,
                        exc)
    if hard != resource.RLIM_INFINITY and hard < LOW:
        log.warning("the open files limit is %d (hard limit %d): a flood of connections could "
                    "use them all; raise it to %d (systemd: LimitNOFILE=%d in the unit, as "
                    "systemd/gpupoold.service has it; a shell: ulimit -Hn)", soft, hard, WANTED,
                    WANTED)
    else:
        log.info("open files limit: %d", soft)
    return soft, hard
