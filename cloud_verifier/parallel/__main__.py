"""`python -m cloud_verifier.parallel`: one tensor-parallel worker rank (`worker.main`), as `start`
launches it."""

import sys

from cloud_verifier.parallel.worker import main

if __name__ == "__main__":
    sys.exit(main())
