"""`python -m gpupool ...` is the same as the `gpupool` command."""

import sys

from gpupool.cli import main

sys.exit(main())
