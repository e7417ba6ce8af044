import sys

from resolver.cli import main

sys.exit(main())
