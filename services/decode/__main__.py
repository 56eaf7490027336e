"""`python -m services.decode [flags]`: the same as `pdserve serve decode [flags]`."""

import sys

from pdserve.services.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", "decode", *sys.argv[1:]]))
