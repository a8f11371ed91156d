from moeshrink.cli import main

raise SystemExit(main())
