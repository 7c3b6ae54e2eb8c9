"""`python -m cubeserve.rollout ...`, the same as `cubeserve rollout ...`."""

import sys

from cubeserve.rollout.cli import main

sys.exit(main())
