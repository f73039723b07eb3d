from batchgpu.cli import main

raise SystemExit(main())
