"""The pool: GPU slots and their states (pool/state.py, their one writer), the lease manager, the
idle detacher and the fleet queue (the policies that call its transitions), the wait queue, what a
client requires, the watchdog, the events the pool publishes and the views of it. No adapter
(HTTP, metrics, dashboard) is imported here."""
