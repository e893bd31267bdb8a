from kalos.cli import main

raise SystemExit(main())
