"""``python -m specdec.device``: the `device-client` command (device/cli.py)."""
import sys

from specdec.device.cli import main

if __name__ == "__main__":
    sys.exit(main())
