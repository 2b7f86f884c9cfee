"""The pool: GPU slots and their states, the lease manager, the wait queue, what a client requires,
the watchdog, the events the pool publishes and the views of it. No adapter (HTTP, metrics,
dashboard) is imported here."""
