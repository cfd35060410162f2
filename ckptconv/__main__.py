import sys

from ckptconv.cli.main import main

sys.exit(main())
