import sys

from kdeploy.cli import main

sys.exit(main())
