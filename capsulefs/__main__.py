from capsulefs.cli import main

raise SystemExit(main())
