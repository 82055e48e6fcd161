"""Cost model, planner, router and replanning policy: pure functions, no I/O."""
