import sys

from deployments.cli.main import main

sys.exit(main())
