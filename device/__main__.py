"""``python -m specdec.device``: the `device-client` command (device/cli.py)."""
import sys

from specdec.device.cli import main

sys.exit(main())
