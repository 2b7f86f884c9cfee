"""Tokens (their format and checks) and the authenticator the remoting port and the HTTP API share."""
