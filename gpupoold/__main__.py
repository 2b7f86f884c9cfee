"""`python -m gpupoold ...` is the same as the `gpupoold` command."""

import sys

from gpupoold.cli import main

sys.exit(main())
