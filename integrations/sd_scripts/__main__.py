"""python -m compile_accel.integrations.sd_scripts [--sd-scripts DIR] SCRIPT ARGS..."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
