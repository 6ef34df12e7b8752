"""``python -m turbogrpo`` is the ``turbogrpo`` command."""

import sys

from turbogrpo.cli import main

sys.exit(main())
