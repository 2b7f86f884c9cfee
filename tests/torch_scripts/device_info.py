"""Prints what PyTorch sees of the CUDA device as one JSON object (tests/test_e2e_torch.py).

Run as a client of gpupool: LD_LIBRARY_PATH points at the shim, GPUPOOL_SERVER at the daemon.
Never raises: a failure is reported in the JSON (`error`) so the test can show it.
"""

import json
import sys
import traceback

import torch


def main() -> int:
    out: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        out["is_available"] = torch.cuda.is_available()
        out["device_count"] = torch.cuda.device_count()
        if out["is_available"]:
            p = torch.cuda.get_device_properties(0)
            out["name"] = p.name
            out["total_memory"] = p.total_memory
            out["major"] = p.major
            out["minor"] = p.minor
            out["multi_processor_count"] = p.multi_processor_count
            out["uuid"] = str(p.uuid)
            out["capability"] = list(torch.cuda.get_device_capability(0))
            out["device_name"] = torch.cuda.get_device_name(0)
            free, total = torch.cuda.mem_get_info(0)
            out["mem_get_info"] = [free, total]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
