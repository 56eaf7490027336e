"""`python -m services.prefill [flags]`: the same as `pdserve serve prefill [flags]`."""

import sys

from pdserve.services.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", "prefill", *sys.argv[1:]]))
