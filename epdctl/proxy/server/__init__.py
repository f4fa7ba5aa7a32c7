"""The proxy as a server: the ASGI app, the handler that takes each request through
its stages and answers (errors included), and the log line writer of the process."""
