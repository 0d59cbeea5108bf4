"""`python -m ftis_kernels.grpo`: the same as the `ftis-grpo` console script."""

import sys

from ftis_kernels.grpo.cli import main

sys.exit(main())
