"""The suite's run machinery, which a learner never needs to read: smoke mode (tiny local models, fixture
data, their cache and each notebook's smoke values), the run log, the results contract, one module per
notebook of what the suite must know of it (`harness.notebooks`), and bf16 matrix products on CPUs without
bf16 instructions. The notebooks call `helpers`, which uses these.
"""
