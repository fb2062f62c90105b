"""mlcc.runtime.serve: what users run: the HTTP server, `mlcc chat`, `mlcc serve`, the load generator."""
