import sys

from lowband.cli import main

sys.exit(main())
