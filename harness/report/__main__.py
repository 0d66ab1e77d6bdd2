import sys

from harness.report.build import main

sys.exit(main())
