"""`python -m relayrl ...`: the same as the `relayrl` command, for when the script is not on PATH (or to pick the
interpreter, hence the installation, explicitly)."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
