"""``python -m pipe.viz``: the ``pipe-viz`` command (see :mod:`pipe.viz.cli`)."""
import sys

from pipe.viz.cli import main

sys.exit(main())
