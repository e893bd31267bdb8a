from kalos.tools.cli import main

raise SystemExit(main())
