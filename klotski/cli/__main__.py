"""`python -m klotski.cli`: the `klotski` command."""
import sys

from klotski.cli.main import main

sys.exit(main())
