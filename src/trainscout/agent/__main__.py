import sys

from trainscout.agent.main import main

sys.exit(main())
