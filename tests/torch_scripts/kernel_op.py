"""A PyTorch op that needs a real kernel (torch.ones -> a fill kernel).

On the simulated device this must fail with a clear error instead of a hang or a crash: the
shim names the kernel that the simulated device cannot run (on stderr), and PyTorch raises a
RuntimeError at the launch or the next synchronisation. On a real GPU it simply works.

Prints `RAISED <type>: <message>` or `COMPUTED <values>`, then exits 0; exits 1 when the op
neither raised nor computed the right values.
"""

import sys

import torch


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    if not torch.cuda.is_available():
        print("FAIL kernel_op: torch.cuda.is_available() is False")
        return 1
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}")
    try:
        x = torch.ones(8, device="cuda")
        torch.cuda.synchronize()
        vals = x.cpu().tolist()
    except RuntimeError as exc:
        msg = " ".join(str(exc).split())
        print(f"RAISED {type(exc).__name__}: {msg}")
        return 0
    print(f"COMPUTED {vals}")
    return 0 if vals == [1.0] * 8 else 1


if __name__ == "__main__":
    sys.exit(main())
