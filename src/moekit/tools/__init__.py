"""The `moekit` command and what it runs (verify, bench, tune): built on the runtime, never imported by it."""
