"""`python -m treespec_demo`: the demo (treespec_demo.demo)."""

import sys

from treespec_demo.demo import main

if __name__ == "__main__":
    sys.exit(main())
