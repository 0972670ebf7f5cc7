import sys

from jaxppo.cli import main

sys.exit(main())
