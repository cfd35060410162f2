import sys

from ckptconv.cli import main

sys.exit(main())
