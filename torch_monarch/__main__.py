"""python3 -m torch_monarch: see torch_monarch.cli."""

import sys

from .cli import main

sys.exit(main())
