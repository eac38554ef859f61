import sys

from cloud_verifier.cli import main

sys.exit(main())
