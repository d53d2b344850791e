import sys

from trainscout.coordinator.main import main

sys.exit(main())
