"""Ask every configured server for `info`, in parallel (status, smi, doctor)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import gpupool_protocol as gp

from gpupool.config import ClientConfig, ServerConfig
from gpupool.wire import InfoResult, WireError, fetch_info


@dataclass
class Probe:
    server: ServerConfig
    info: InfoResult | None = None  # the answer (its .result may be a refusal)
    error: WireError | None = None  # could not be reached / spoke garbage

    @property
    def ok(self) -> bool:
        return self.info is not None and self.info.result == 0

    def problem(self) -> str:
        """Why this server cannot be used, in words ("" when it can)."""
        if self.error is not None:
            return str(self.error)
        assert self.info is not None
        if self.info.result == gp.GP_EVERSION:
            return (f"the server speaks protocol {self.info.major}.{self.info.minor}, this client "
                    f"{gp.MAJOR}.{gp.MINOR}: {self.info.message or 'major versions differ'}")
        if self.info.result != 0:
            return self.info.message or f"refused ({self.info.result_name()})"
        return ""


# probe_timeout = 0 means this for probes, as in the shims (client/common/info_client.h): a probe
# always has a limit.
PROBE_TIMEOUT_FOR_ZERO = 2.0


def probe_limit(cfg: ClientConfig) -> float:
    return cfg.probe_timeout if cfg.probe_timeout > 0 else PROBE_TIMEOUT_FOR_ZERO


def probe_one(cfg: ClientConfig, srv: ServerConfig, timeout: float | None = None) -> Probe:
    try:
        info = fetch_info(srv, probe_limit(cfg) if timeout is None else timeout, gpu=cfg.gpu,
                          model=cfg.model, min_memory=cfg.min_memory)
    except WireError as exc:
        return Probe(srv, error=exc)
    return Probe(srv, info=info)


def probe_all(cfg: ClientConfig, timeout: float | None = None) -> list[Probe]:
    """One Probe per configured server, in the configuration's order."""
    if not cfg.servers:
        return []
    with ThreadPoolExecutor(max_workers=min(len(cfg.servers), 16)) as pool:
        return list(pool.map(lambda s: probe_one(cfg, s, timeout), cfg.servers))
