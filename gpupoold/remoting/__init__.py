"""The remoting port: the listener, the hello and info first frames, the queue notices, TLS on the
daemon side, hand-over to a worker."""
