"""Not a benchmark: the names benchmarks/auto_k0_cost.py imports (issue 44 part 2 is rewriting that script), now
served by `tandem bench profile`'s StepTimer (tandem/bench/profile.py). Delete this file with auto_k0_cost.py."""

from tandem.bench.profile import StepTimer

_timer = StepTimer()
TOTALS = _timer.totals
instrument = _timer.instrument
