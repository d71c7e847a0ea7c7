"""``python -m broker.cli``: the ``standmeet-jobs`` command."""

import sys

from broker.cli import main

sys.exit(main())
