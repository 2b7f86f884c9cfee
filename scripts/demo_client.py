"""The PyTorch demo client of `make demo`: unmodified PyTorch on a gpupool GPU.

Run through the shim (`gpupool run -- python scripts/demo_client.py`); it prints what PyTorch sees
and moves a tensor to the device and back, checking every byte.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    try:
        import torch
    except ImportError:
        print("demo_client: PyTorch is not installed (scripts/bootstrap.sh installs it)")
        return 1
    print(f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False: is gpupoold running and GPUPOOL_SERVER set?")
        return 1
    print(f"torch.cuda.is_available(): True, {torch.cuda.device_count()} device(s)")
    props = torch.cuda.get_device_properties(0)
    print(f"device 0: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
          f"compute capability {props.major}.{props.minor}")
    if "simulated" in props.name.lower():
        print("  (a SIMULATED GPU: device memory lives in the server's host memory)")
    host = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB
    start = time.perf_counter()
    dev = host.to("cuda")
    back = dev.cpu()
    elapsed = time.perf_counter() - start
    ok = torch.equal(host, back)
    print(f"tensor round trip of {host.numel() * 4 >> 20} MiB to {dev.device} and back: "
          f"{'bit-exact' if ok else 'MISMATCH'} in {elapsed * 1000:.1f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
