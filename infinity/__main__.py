from infinity.cli import main

raise SystemExit(main())
