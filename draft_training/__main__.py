import sys

from draft_training.cli import main

sys.exit(main())
