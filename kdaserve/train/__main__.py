from kdaserve.train.demo import main

raise SystemExit(main())
