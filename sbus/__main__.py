from .tool import main
import sys

sys.exit(main())
