from trainscout.cli import main

raise SystemExit(main())
