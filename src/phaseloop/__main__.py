from phaseloop.cli import main

raise SystemExit(main())
