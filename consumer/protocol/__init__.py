"""bytes -> typed messages and back (spec §1-§5)."""
