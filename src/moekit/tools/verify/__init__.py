"""`moekit verify`: every implementation of this machine against the float64 references, each backend
group in a child process (:mod:`.runner`), with the router and experts checks (:mod:`.router_checks`,
:mod:`.experts_checks`)."""
