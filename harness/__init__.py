"""The suite's run machinery, which a learner never needs to read: the Set up cell's checks (`checks`,
`parameters`), starting or attaching to Ray and the checks on every node (`cluster`), storage deadlines,
retries and streams (`storage`), the observers that watch a run from outside (progress lines, a planned
failure, MLflow tracking, the run log, results), smoke mode (tiny local models, fixture data and their
cache), one module per notebook of what the suite must know of it (`harness.notebooks`), and bf16 matrix
products on CPUs without bf16 instructions; and the notebooks' "will it fit?" plans and comparisons
(`sizing`).

The middle floor: it builds on `basics` and never imports `helpers`, the floor above, through which the
notebooks call the names they use from here (`helpers.watch`, `helpers.show_run`, `helpers.write_results`,
`helpers.storage.dcp_writer`).
"""
